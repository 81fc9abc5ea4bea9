"""The speed model: seconds per decode token of a streamed model,

    compute   the weights a token reads with its experts resident, over the
              share of the memory bandwidth decode reaches
    + calls   a host sync and bookkeeping per MoE layer (every paged call
              syncs on a GPU)
    + reads   misses per token x record bytes, over the SSD's rate at the
              reader's queue depth

Misses per token are top-k x MoE layers x (1 - hit rate), the hit rate
from a curve (``curves``) at the pools' resident fraction; with approximate
routing only the experts a token must take can miss (``missable``). The two free
parameters are fitted on published measurements (docs/predict.md,
``scripts/predict_validation.py``).
"""

from dataclasses import dataclass
from typing import Optional, Tuple

from .curves import CARRY, CARRY_BAND, HitCurve
from .machines import Machine
from .shape import ModelShape

# Fitted: the share of peak memory bandwidth decode reaches on 4-bit
# weights, and one paged MoE call's host cost (docs/predict.md).
BANDWIDTH_SHARE = 0.54
CALL_S = 90e-6
# The least half-width of the band, where the hit rate leaves no spread.
MIN_BAND = 0.10
# Reader threads on a Mac (config.default_io_threads: 8 or the cores).
QUEUE_DEPTH = 8


@dataclass(frozen=True)
class SpeedModel:
    bandwidth_share: float = BANDWIDTH_SHARE
    call_s: float = CALL_S
    queue_depth: int = QUEUE_DEPTH


@dataclass(frozen=True)
class Forecast:
    """Decode tok/s and its parts at one resident fraction."""

    tok_s: float
    band: Tuple[float, float]
    resident: float  # share of each layer's experts in its pool
    hit_rate: float
    misses_per_token: float
    compute_s: float
    calls_s: float
    reads_s: float
    curve: str

    def report(self) -> dict:
        return dict(decode_tok_s=self.tok_s, decode_tok_s_band=list(self.band),
                    resident_fraction=self.resident, hit_rate=self.hit_rate,
                    misses_per_token=self.misses_per_token, compute_s=self.compute_s,
                    calls_s=self.calls_s, reads_s=self.reads_s, curve=self.curve)


def forecast(shape: ModelShape, machine: Machine, slots: int, curve: HitCurve,
             model: SpeedModel = SpeedModel(), miss_share: float = 1.0,
             extra_s: float = 0.0, paged: Optional[bool] = None,
             spine_read_bytes: int = 0, missable: Optional[int] = None) -> Forecast:
    """Decode speed of ``shape`` with ``slots`` per layer on ``machine``.
    ``miss_share``: bytes a miss reads as a share of a record (low-bit
    copies); ``extra_s``: time per token outside the model (all-reduces);
    ``paged``: whether calls sync (default: unless every expert is resident,
    where this runtime runs mlx-lm's own decode); ``spine_read_bytes``: the
    spine layers a token reads through the ring (those the plan streams);
    ``missable``: the experts per token that can miss (default top-k; fewer
    with approximate routing, ``routed_misses``)."""
    resident = min(1.0, slots / shape.experts)
    paged = resident < 1 if paged is None else paged
    compute = shape.active_bytes / (model.bandwidth_share * machine.memory_gbps * 1e9)
    calls = shape.moe_layers * model.call_s if paged else 0.0
    record = shape.record_bytes * miss_share
    rate = machine.ssd_rate(record, model.queue_depth)

    def parts(carry: float):
        hit = curve.carried(resident, shape.experts, shape.top_k, carry)
        misses = shape.moe_layers * (missable or shape.top_k) * (1 - hit)
        return hit, misses, misses * record / rate

    hit, misses, reads = parts(CARRY)
    spine = spine_read_bytes / machine.ssd_rate(spine_read_bytes, 1) if spine_read_bytes else 0
    base = compute + calls + extra_s + spine
    tok_s = 1 / (base + reads)
    ends = [1 / (base + parts(c)[2]) for c in CARRY_BAND]
    band = (min(min(ends), tok_s * (1 - MIN_BAND)), max(max(ends), tok_s * (1 + MIN_BAND)))
    return Forecast(tok_s, band, resident, hit, misses, compute, calls, reads, curve.name)


def cold_fill_s(nbytes: int, record_bytes: int, machine: Machine,
                model: SpeedModel = SpeedModel()) -> float:
    """Seconds to read ``nbytes`` of records into memory from the SSD."""
    return nbytes / machine.ssd_rate(record_bytes, model.queue_depth)


def prefill_tok_s(shape: ModelShape, machine: Machine, slots: int, step: int,
                  model: SpeedModel = SpeedModel()) -> float:
    """A bound on prompt tokens per second: each step of ``step`` tokens
    passes the weights once and reads every expert it routes to that is not
    resident (a step of many tokens routes to nearly all); the arithmetic
    of the step is not counted, so long prompts run slower than this."""
    routed = shape.experts * (1 - (1 - shape.top_k / shape.experts) ** step)
    missing = routed * (1 - min(1.0, slots / shape.experts)) * shape.moe_layers
    reads = missing * shape.record_bytes / machine.ssd_rate(shape.record_bytes, model.queue_depth)
    passes = (shape.active_bytes + missing * shape.record_bytes) / (
        model.bandwidth_share * machine.memory_gbps * 1e9)
    return step / (reads + passes + shape.moe_layers * model.call_s)


@dataclass(frozen=True)
class RoutingForecast:
    """How approximate routing (``StreamConfig.routing``) changes a token's
    misses: only the router's own top ``keep`` must be read; the others
    come from resident experts (cache-aware), are dropped (top-k-cut) or
    are skipped when missing (skip-misses)."""

    mode: str
    keep: int
    window: Optional[int]

    @property
    def approximate(self) -> bool:
        return self.mode != "exact"

    def assumption(self) -> str:
        if self.mode == "cache-aware":
            return (f"misses only among the router's own top {self.keep}; the others are "
                    f"taken from resident experts in its top {self.window} (assumed always "
                    "there: a lower bound on misses, and the kept ones hit as exact "
                    "routing's do)")
        if self.mode == "top-k-cut":
            return (f"only the router's top {self.keep} are computed and read; they hit as "
                    "exact routing's do (compute counted as exact routing's)")
        return (f"the router's top {self.keep} are always read; the other experts are "
                "skipped when missing, so never read (compute counted as exact routing's)")

    def report(self) -> dict:
        return dict(mode=self.mode, keep=self.keep, window=self.window,
                    approximate=self.approximate, assumption=self.assumption())
