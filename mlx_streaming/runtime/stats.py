"""The counters of a streaming model, and ``stats(model)``, which reads them
from outside the forward pass."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, List, Optional

from .events import Observer


@dataclass
class LayerCounters:
    calls: int = 0
    tokens: int = 0
    hits: int = 0
    misses: int = 0
    records_read: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    stall_seconds: float = 0.0
    syncs: int = 0
    graph_calls: int = 0  # paged calls made inside the graph, without a sync
    prefetch_issued: int = 0
    prefetch_useful: int = 0
    prefetch_wasted: int = 0
    routed: int = 0
    predicted_routed: int = 0
    distinct_experts: int = 0
    low_bit_pairs: int = 0  # missed (token, expert) pairs computed from low-bit copies

    def add(self, other: "LayerCounters") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        lookups = self.hits + self.misses
        d["hit_rate"] = self.hits / lookups if lookups else None
        d["read_gb_per_s"] = (
            self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else None
        )
        # Recall: the share of routed experts the previous layer's prediction named.
        d["prefetch_recall"] = (
            self.predicted_routed / self.routed if self.routed else None
        )
        # Distinct experts one call needs (known where calls sync).
        d["experts_per_call"] = (
            self.distinct_experts / (self.syncs + self.graph_calls)
            if self.syncs + self.graph_calls else None
        )
        return d


@dataclass
class SpecStats:
    """Counters of speculative decoding (``stats(model)["speculative"]``)."""

    calls: int = 0
    drafted: int = 0
    accepted: int = 0
    refeeds: int = 0

    def reset(self) -> None:
        self.calls = self.drafted = self.accepted = self.refeeds = 0

    def report(self) -> dict:
        return dict(calls=self.calls, drafted=self.drafted, accepted=self.accepted,
                    refeeds=self.refeeds,
                    acceptance_rate=self.accepted / self.drafted if self.drafted else None)


class Stats(Observer):
    """Counters per layer; ``report()`` adds the totals."""

    def __init__(self, layers: List[int]):
        self.layers = list(layers)
        self.reset()

    def reset(self) -> None:
        self.counters: Dict[int, LayerCounters] = {layer: LayerCounters() for layer in self.layers}
        self._predicted: Dict[int, set] = {}

    def on_call(self, layer, tokens):
        c = self.counters[layer]
        c.calls += 1
        c.tokens += tokens

    def on_lookup(self, layer, hits, misses):
        c = self.counters[layer]
        c.hits += hits
        c.misses += misses

    def on_read(self, layer, records, nbytes, seconds):
        c = self.counters[layer]
        c.records_read += records
        c.bytes_read += nbytes
        c.read_seconds += seconds

    def on_stall(self, layer, seconds):
        self.counters[layer].stall_seconds += seconds

    def on_sync(self, layer):
        self.counters[layer].syncs += 1

    def on_paged_call(self, layer, tokens, ids, experts, hits, probs=None):
        c = self.counters[layer]
        c.syncs += 1
        c.calls += 1
        c.tokens += tokens
        c.hits += hits
        c.misses += ids.size - hits
        c.distinct_experts += len(experts)
        if self._predicted:
            self._count_predicted(c, layer, experts)

    def on_low_bits(self, layer, pairs):
        self.counters[layer].low_bit_pairs += pairs

    def on_graph_calls(self, layer, calls, tokens, hits, misses, distinct, records, nbytes,
                       read_seconds, stall_seconds):
        c = self.counters[layer]
        c.calls += calls
        c.graph_calls += calls
        c.tokens += tokens
        c.hits += hits
        c.misses += misses
        c.distinct_experts += distinct
        c.records_read += records
        c.bytes_read += nbytes
        c.read_seconds += read_seconds
        c.stall_seconds += stall_seconds

    def on_predict(self, layer, ids, scores=None, distance=1, softmax=True):
        if distance != 1:  # the recall counted is the next layer's prediction's
            return
        # Sets, not np.isin, which is slow on a few ids.
        self._predicted[layer] = set(ids.ravel().tolist())

    def on_route(self, layer, ids, experts, probs=None):
        c = self.counters[layer]
        c.distinct_experts += len(experts)
        self._count_predicted(c, layer, experts)

    def _count_predicted(self, c, layer, experts):
        predicted = self._predicted.pop(layer, None)
        if predicted is None:
            return
        c.routed += len(experts)
        c.predicted_routed += sum(1 for e in experts.tolist() if e in predicted)

    def on_prefetch(self, layer, issued=0, useful=0, wasted=0):
        c = self.counters[layer]
        c.prefetch_issued += issued
        c.prefetch_useful += useful
        c.prefetch_wasted += wasted

    def report(self) -> dict:
        total = LayerCounters()
        for c in self.counters.values():
            total.add(c)
        return {
            "total": total.to_dict(),
            "layers": {layer: c.to_dict() for layer, c in self.counters.items()},
        }


def runtime_of(model):
    runtime = getattr(model, "streaming", None)
    if runtime is None:
        raise ValueError("this model was not loaded by mlx_streaming.load()")
    return runtime


def stats(model, wait: Optional[float] = None) -> dict:
    """Counters of a streaming model: hits, misses, bytes read, read and
    stall seconds, host syncs and prefetch telemetry, per layer and in
    total, with the I/O path that ran.

    Hits and misses count (token, expert) pairs: a pair is a hit when its
    expert was resident when the call began. ``records_read`` counts reads.
    ``syncs`` counts calls that waited for their ids on the host;
    ``graph_calls`` those that ran inside the graph (the native step on the
    CPU backend), reported when their forward pass ends. Read between
    forward passes: from another thread, it waits for the pass in flight,
    or at most ``wait`` seconds; past that the counters are read as they
    stand, maybe partway through a pass (``mid_pass`` True).
    """
    runtime = runtime_of(model)
    # Between passes: mid-pass, reads ahead could show used but not yet issued.
    if not runtime.lock.acquire(timeout=-1 if wait is None else wait):
        return dict(_report(runtime), mid_pass=True)
    try:
        return dict(_report(runtime), mid_pass=False)
    finally:
        runtime.lock.release()


def _report(runtime) -> dict:
    report = runtime.stats.report()
    config = runtime.config
    report.update(
        io=runtime.reader.name,
        io_reason=runtime.io_reason,
        direct_io=runtime.reader.direct,
        direct_io_reason=runtime.direct_io_reason,
        io_threads=config.io_threads,
        slots_per_layer=runtime.slots,
        num_experts=max(spec.num_experts for spec in runtime.manifest.layers),
        moe_layers=sum(not spec.module.startswith("mtp.") for spec in runtime.manifest.layers),
        pool_bytes=runtime.pool_bytes,
        residency="paged" if runtime.paged else "resident",
        path=dict(kind=runtime.path.kind, why=runtime.path.why),
        prefetch=config.prefetch,
        prefetch_decision=_prefetch_decision(runtime),
        prefetch_bandwidth=_bandwidth_of(runtime),
    )
    remote = runtime.reader.report()
    if remote is not None:
        report["remote"] = remote
    report["speculative"] = runtime.speculative.report()
    report["routing"] = _routing_of(runtime)
    report["miss_bits"] = _miss_bits_of(runtime, report["total"])
    report["pressure"] = runtime.pressure.report() if runtime.pressure is not None else None
    report["memory"] = runtime.plan.report()
    report["spine"] = runtime.ring.stats.report() if runtime.ring is not None else None
    if runtime.prefetch.staging is not None:
        # Dropped records whose reads had not started cost no bytes.
        t = report["total"]
        t["prefetch_cancelled"] = runtime.prefetch.cancelled()
        read = t["prefetch_issued"] - t["prefetch_cancelled"]
        t["prefetch_wasted_read_share"] = (
            max(0, read - t["prefetch_useful"]) / read if read > 0 else None)
    return report


def _routing_of(runtime) -> dict:
    """How the routing was changed: the router's own (token, expert) pairs
    passed over for resident experts, of all routed, and the share kept."""
    config = runtime.config
    out = dict(mode=config.routing)
    if config.routing == "exact" or not runtime.routers:
        return out
    routed = sum(r.routed for r in runtime.routers)
    passed = sum(r.passed_over for r in runtime.routers)
    top_k, keep, window, _ = runtime.routers[0].shape
    return dict(out, keep=keep, window=window, routed=routed, substituted=passed,
                route_agreement=1 - passed / routed if routed else None,
                approximate=not all(r.exact for r in runtime.routers))


def _miss_bits_of(runtime, total: dict) -> Optional[dict]:
    """Low-bit copies: width, threshold, and the missed pairs computed from them."""
    config = runtime.config
    if not any(r.copies is not None for r in runtime.residencies):
        return None
    low = total["low_bit_pairs"]
    return dict(bits=config.miss_bits, weight=config.miss_bits_weight, substituted=low,
                share_of_misses=low / total["misses"] if total["misses"] else None)


def _prefetch_decision(runtime) -> str:
    if runtime.config.prefetch == "off":
        return "off"
    if not runtime.paged:
        return "off: every expert resident"
    return runtime.prefetch.trial.decision


def _bandwidth_of(runtime):
    """Prefetch's bandwidth: whole records per layer, ``partial`` (the share of one
    more the compute covers), its inputs, and per layer the least score read ahead
    one and two layers early (None: nothing yet; absent: every prediction read)."""
    b = runtime.prefetch.bandwidth
    if b is None:
        return None
    calibration = runtime.prefetch.calibration
    two_ahead = getattr(calibration, "two_ahead", None)  # ReadEveryPrediction has none
    return dict(records=b.records, partial=b.partial,
                read_gb_per_s=b.rate / 1e9 if b.rate else None,
                layer_compute_s=b.layer_compute, lowest_score=calibration.lowest_scores(),
                lowest_score_two_ahead=two_ahead.lowest_scores() if two_ahead else {})


def reset_stats(model) -> None:
    runtime = runtime_of(model)
    # Between passes: a pass counts the reads ahead it staged as used there.
    with runtime.lock:
        _reset(runtime)


def _reset(runtime) -> None:
    for store in runtime.stores:
        store.drain_counters()  # calls made inside the graph and not yet reported
        # Reads ahead issued before the reset would count after it, against no issue.
        store.drop_staged()
    runtime.stats.reset()
    runtime.speculative.reset()
    for router in runtime.routers:
        router.routed = router.passed_over = 0
    runtime.reader.reset()
    if runtime.ring is not None:
        runtime.ring.reset_stats()
    if runtime.prefetch.staging is not None:
        runtime.prefetch.cancelled_at_reset = runtime.prefetch.staging.cancelled()
