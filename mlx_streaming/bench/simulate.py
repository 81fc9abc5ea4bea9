"""bench simulate: project decode tok/s from a routing trace and a
hardware profile, and check the projection against this machine.

The model of one decode token (one token per MoE call):

    compute                 the token's work with every expert resident: the
                            bytes of weights it touches over the bandwidth the
                            compute reaches (or, on this machine, measured)
    + moe_layers x sync     one paged MoE call's cost: its host sync and
                            bookkeeping, or on this machine's CPU backend
                            without prefetch, the call inside the graph
                            (``bench overhead`` measures both paths)
    + reads                 per call with m missed experts: latency + m x
                            (expert bytes / SSD bandwidth + the host's work
                            per missed record), after the sync; on the synced
                            path (``overlap``) less the compute of the call's
                            resident experts, which runs meanwhile

Misses come from replaying the trace through the eviction policy at the
pool size. The calls run one after another on one clock, with the disk as
the native reader drives it (``Disk``), so that with prefetch the
predictions the trace recorded (one and two layers ahead, with their
scores) are read as the live prefetch reads them: the calibration's bar
replayed, at most the bandwidth budget, one at a time behind demand reads,
cancelled when not started by the time their layer arrives, while the
layers before compute. A read ahead in flight when its layer arrives is
waited for; a demand read waits for the read ahead in flight.

Two modes:

  --validate   this machine: measure its profile (resident decode, a
               paged call's cost on each path, throttled disk rate), project
               each pool x policy x prefetch case of a model with the path it
               ran, run those cases with ``bench decode`` in the same run and
               report the error of each projection.
  --project    Apple Silicon profiles (published figures, sources in
               PROFILES) x large MoE models at 4 bits: projected tok/s at the
               largest pool each machine's memory allows. Hit rates come from
               the given trace at the same pool fraction: a proxy, since no
               trace of those models was recorded here.
"""

import argparse
import itertools
import math
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List

import numpy as np

from ..runtime.block import OVERLAP_MIN_READ_S
from ..runtime.memory import staging_records
from ..config import (DEFAULT_POLICY, DEFAULT_PREFETCH_DEPTH, DEFAULT_PREFETCH_PRECISION,
                      StreamConfig)
from ..format import read_manifest
from ..runtime.policy import make_policy
from ..runtime.prefetch.calibration import PrefetchCalibration, ReadEveryPrediction
from ..runtime.prefetch.predict import rank_order, within_bandwidth
from .cache import Call, decode_records, replay_misses
from .case import WARMUP_TOKENS
from .common import BenchError, figure, finish, paired_ratio, run_case


@dataclass(frozen=True)
class Profile:
    """What the projection needs of a machine."""

    name: str
    ssd_gbps: float  # sustained random reads of expert-sized records
    ssd_latency_s: float  # added once per call that reads
    weight_gbps: float  # bandwidth the compute reaches on weights (decode)
    sync_s: float  # one host sync of a paged MoE call, with its bookkeeping
    miss_s: float = 0.0  # host work per missed record beyond the read (tables, checks)
    memory_gb: float = 0.0
    sources: Dict[str, str] = field(default_factory=dict)


# Published figures. Memory bandwidth: Apple's product pages; MLX decode on
# these machines reaches roughly 60-70% of it on 4-bit weights (an
# assumption we apply as weight_gbps = 0.65 x peak). SSD: sequential read
# speeds reported by reviews of each machine (Blackmagic/AmorphousDiskMark,
# ~4-7 GB/s); we take 4 MiB+ random reads at that rate. Sync: the cost of one
# command buffer commit-and-wait plus our bookkeeping, ~100 us, an estimate
# (this machine's CPU backend measures ~50-80 us; Metal adds the GPU round
# trip).
_APPLE_SOURCES = {
    "weight_gbps": "0.65 x Apple's published unified memory bandwidth (apple.com tech specs)",
    "ssd_gbps": "reviewers' disk-speed tests of the internal SSD (1-2 TB configurations)",
    "ssd_latency_s": "NVMe queue + first byte, ~100 us (assumption)",
    "sync_s": "Metal commit + wait + bookkeeping, ~100 us (assumption)",
    "miss_s": "host work per missed record with the native step, 10 us (assumption; "
              "this 2-core x86 VM measured 2.1-6.5 us on 16 KiB records in bench simulate "
              "--validate; an expert's first-read checksum is paid once, not per miss)",
}
PROFILES = {
    "m4-pro-48gb": Profile("MacBook Pro M4 Pro 48 GB", 5.0, 1e-4, 0.65 * 273, 1e-4, 1e-5, 48,
                           _APPLE_SOURCES),
    "m4-max-128gb": Profile("MacBook Pro M4 Max 128 GB", 6.0, 1e-4, 0.65 * 546, 1e-4, 1e-5, 128,
                            _APPLE_SOURCES),
    "m3-ultra-256gb": Profile("Mac Studio M3 Ultra 256 GB", 6.5, 1e-4, 0.65 * 819, 1e-4, 1e-5, 256,
                              _APPLE_SOURCES),
    "m2-air-24gb": Profile("MacBook Air M2 24 GB", 3.0, 1e-4, 0.65 * 100, 1e-4, 1e-5, 24,
                           _APPLE_SOURCES),
}


@dataclass(frozen=True)
class ModelShape:
    """A MoE model's sizes at 4 bits (group 64: ~4.5 bits per weight)."""

    name: str
    moe_layers: int
    experts: int
    top_k: int
    expert_params: float
    dense_active_params: float  # per token: attention, shared experts, dense layers, head
    total_params: float

    @property
    def num_experts(self) -> int:  # as a layer's spec names it (budget.prefetch_width)
        return self.experts

    def expert_bytes(self) -> float:
        return self.expert_params * 4.5 / 8

    def spine_bytes(self) -> float:
        return (self.total_params - self.moe_layers * self.experts * self.expert_params) * 4.5 / 8


# From each model's config.json on the Hub (layers, experts, top-k, widths).
SHAPES = {
    "qwen3-30b-a3b": ModelShape("Qwen3-30B-A3B", 48, 128, 8, 3 * 2048 * 768, 1.6e9, 30.5e9),
    "qwen3-235b-a22b": ModelShape("Qwen3-235B-A22B", 94, 128, 8, 3 * 4096 * 1536, 7.8e9,
                                  235e9),
    "deepseek-v3": ModelShape("DeepSeek-V3 (671B)", 58, 256, 8, 3 * 7168 * 2048, 16.5e9, 671e9),
}


class Disk:
    """The reader's disk as the native reader drives it: demand reads run
    before every read ahead not yet started; reads ahead run one at a time
    in the order queued; a read ahead not started when its layer's call
    arrives is cancelled (``Staging``). Times are seconds on one clock;
    counts are traced records."""

    def __init__(self, record_s: float, ahead_s: float, latency_s: float, capacity: int):
        self.record_s = record_s  # one traced record within a batch of demand reads
        self.ahead_s = ahead_s  # one traced record read ahead, latency included
        self.latency_s = latency_s  # once per batch of demand reads
        self.capacity = capacity  # staging's records (queued or read, not yet taken)
        self.free_at = 0.0  # when the read in flight ends
        self.queue = deque()  # reads ahead not started: (layer, expert, issued at, token)
        self.staged = {}  # (layer, expert) -> when its read ahead ends
        self.started = Counter()  # reads ahead started (bytes read), by the token they serve

    def advance(self, until: float) -> None:
        """Start the queued reads ahead whose turn comes before ``until``."""
        while self.queue:
            layer, expert, issued, token = self.queue[0]
            start = max(self.free_at, issued)
            if start >= until:
                return
            self.queue.popleft()
            self.free_at = start + self.ahead_s
            self.staged[layer, expert] = self.free_at
            self.started[token] += 1

    def arrive(self, layer: int) -> dict:
        """``layer``'s call: its reads ahead not started are cancelled; those
        started (expert -> when each ends) are handed over and leave."""
        self.queue = deque(q for q in self.queue if q[0] != layer)
        mine = {e: t for (l, e), t in self.staged.items() if l == layer}
        for e in mine:
            del self.staged[layer, e]
        return mine

    def demand(self, at: float, records: int) -> float:
        """When ``records`` demand reads issued at ``at`` end (after the read
        in flight)."""
        if records <= 0:
            return at
        self.free_at = max(at, self.free_at) + self.latency_s + records * self.record_s
        return self.free_at

    def stage(self, layer: int, experts, at: float, token: int) -> int:
        """Queue reads ahead of ``experts`` for ``layer``'s call of ``token``
        (skipping those staged or queued, and all once staging is full); how
        many were queued."""
        queued = {(l, e) for l, e, _, _ in self.queue}
        issued = 0
        for e in experts.tolist():
            key = (layer, e)
            if key in self.staged or key in queued:
                continue
            if len(self.staged) + len(self.queue) >= self.capacity:
                break
            self.queue.append((layer, e, at, token))
            queued.add(key)
            issued += 1
        return issued


def _candidates(ranked, scores, resident: set):
    """Prefetch's candidates from a recorded prediction: the distinct ids
    best first that are not resident, each with its best row's score
    (what ``NextLayerPrefetch._candidates`` computes from the probabilities)."""
    order = rank_order(ranked)
    best = {}
    for e, x in zip(ranked.ravel().tolist(), scores.ravel().tolist()):
        best[e] = max(best.get(e, 0.0), x)
    keep = np.array([e not in resident for e in order.tolist()], bool)
    order = order[keep] if len(order) else order
    return order, np.array([best[e] for e in order.tolist()], np.float64)


def project_case(calls: Dict[int, List[Call]], fraction: float, policy: str, prefetch: int,
                 compute_s: float, sync_s: float, moe_layers: int, expert_bytes: float,
                 top_k: int, ssd_gbps: float, ssd_latency_s: float, skip: int = 0,
                 miss_s: float = 0.0, hit_compute_s: float = 0.0, precision: float = 0.0,
                 width: int = 0) -> dict:
    """Projected seconds per token and its parts: the trace's decode tokens
    replayed layer after layer on one clock, each layer's pool at
    ``fraction`` of its experts under ``policy``; the traced layers stand
    for all ``moe_layers`` (their stall per call, scaled), and each traced
    record for ``top_k`` / the trace's k of the model's. The first ``skip``
    tokens warm the pools and are not counted (as decode's warm-up tokens
    are not). ``hit_compute_s``: the compute of one resident expert, which
    hides as much of its call's demand reads (``Paged``'s overlap; 0 for
    none).

    ``prefetch``: MoE layers ahead read (0: off, 1 or 2: prefetch_depth).
    With it, each call, after its demand reads, queues reads ahead as the
    live ``NextLayerPrefetch`` does, from the predictions the trace holds:
    the next call's non-resident candidates held to the calibration's bar
    (``precision``, the live ``PrefetchCalibration`` replayed; 0 reads every
    one), at most the budget (the records the disk reads in a layer's
    compute, latency included, as ``PrefetchBandwidth`` measures it, and one
    more that the compute partly covers where ``within_bandwidth`` takes it),
    then with depth 2 the call after next's with the room left, held to
    their own bar (``PrefetchCalibration.bar``). Reads ahead run
    while the layer computes; a call takes what its layer's reads ahead
    read and waits for those in flight. Staging holds 2 x ``width``
    records."""
    layers = sorted(calls)
    tokens = min(len(calls[l]) for l in layers)
    k = calls[layers[0]][0].ids.shape[-1]
    scale = top_k / k  # the model's records per traced record
    layer_compute = compute_s / moe_layers
    span = layer_compute + sync_s  # a call's time beside its stall
    record_s = scale * expert_bytes / ssd_gbps / 1e9
    # A read ahead is a read of its own: its latency each time.
    ahead_s = scale * ssd_latency_s + record_s
    cover = layer_compute / ahead_s
    records, partial_share = int(cover), cover - int(cover)
    misses, resident = _replay_pools(calls, layers, tokens, fraction, policy)
    # A sigmoid router's layer reads every prediction, as the loader gives it.
    sigmoid = {l for l in layers if any(c.sigmoid_router for c in calls[l])}
    calibrated = [l for l in layers if l not in sigmoid]
    if prefetch and precision > 0 and any(
            c.ranked is not None and c.scores is None for l in calibrated for c in calls[l]):
        raise BenchError("this trace has predictions without scores, which the calibration "
                         "bins: record it again (bench decode records one), or use "
                         "--prefetch-precision 0")
    ranks = ReadEveryPrediction()
    calibration = PrefetchCalibration(calibrated, precision) if precision > 0 else ranks
    judges = {l: ranks if l in sigmoid else calibration for l in layers}
    learners = {calibration, ranks}  # one where precision is 0
    order = [(t, l) for t in range(tokens) for l in layers]  # the calls, as they run
    disk = Disk(record_s, ahead_s, ssd_latency_s, 2 * (width or 2 * k))
    clock, stall_sum, read_sum, hits, lookups, taken = 0.0, 0.0, 0.0, 0, 0, 0
    for i, (t, layer) in enumerate(order):
        call = calls[layer][t]
        for learner in learners:
            learner.on_route(layer, call.ids, call.experts)
        stall, read, from_stage = _call(disk, clock, layer, call, misses[layer][t], scale,
                                        miss_s, hit_compute_s)
        if t >= skip:
            stall_sum, read_sum, taken = stall_sum + stall, read_sum + read, taken + from_stage
            hits += call.ids.size - len(misses[layer][t])
            lookups += call.ids.size
        clock += stall
        if prefetch:
            _issue(disk, judges, calls, resident, order[i + 1:i + 1 + prefetch], records, partial_share,
                   clock)
        clock += span
    per_token = moe_layers / len(layers) / max(1, tokens - skip)  # traced calls -> a token's
    stall_s = stall_sum * per_token
    seconds = compute_s + moe_layers * sync_s + stall_s
    ahead = sum(n for t, n in disk.started.items() if t >= skip)
    return dict(seconds=seconds, tps=1 / seconds, stall_s=stall_s, hit_rate=hits / lookups,
                read_s=read_sum * per_token, read_ahead=ahead,
                wasted=(ahead - taken) / ahead if ahead else None,
                read_ahead_per_token=ahead * scale * per_token, cover=cover)


def _layer_experts(seq: List[Call]) -> int:
    """A traced layer's experts: those seen, or the router's width where
    the trace has it (policies that weigh the router's probabilities need
    all of them)."""
    return max([1 + max(int(c.experts.max()) for c in seq)]
               + [c.probs.shape[-1] for c in seq[:1] if c.probs is not None])


def _replay_pools(calls, layers, tokens: int, fraction: float, policy: str):
    """Each layer's misses per call, and its resident experts before each."""
    misses, resident = {}, {}
    for layer in layers:
        seq = calls[layer][:tokens]
        experts = _layer_experts(seq)
        slots = max(len(seq[0].experts), round(fraction * experts))
        resident[layer] = []
        misses[layer] = replay_misses(seq, slots, make_policy(policy, experts),
                                      resident=resident[layer])
    return misses, resident


def _project_pool(calls: Dict[int, List[Call]], fraction: float, **case) -> dict:
    """``project_case`` at a pool between two whole slot counts of the
    trace's layers (its model, small, has far fewer experts a layer than
    the one projected): both are replayed and their seconds per token
    mixed, so that a share of a slot moves the projection by a share, not
    by a whole slot or none."""
    tokens = min(len(seq) for seq in calls.values())
    widths = {_layer_experts(seq[:tokens]) for seq in calls.values()}
    experts = widths.pop()
    slots = fraction * experts
    low, high = math.floor(slots), math.ceil(slots)
    if low == high or widths:  # layers of other widths round their own
        return project_case(calls, fraction, **case)
    a = project_case(calls, low / experts, **case)
    b = project_case(calls, high / experts, **case)
    w = slots - low
    mixed = {key: None if a[key] is None or b[key] is None else (1 - w) * a[key] + w * b[key]
             for key in a}
    wasted = mixed["wasted"] and ((1 - w) * a["read_ahead"] * a["wasted"]
                                  + w * b["read_ahead"] * b["wasted"]) / mixed["read_ahead"]
    return dict(mixed, tps=1 / mixed["seconds"], wasted=wasted)


def _call(disk: Disk, clock: float, layer: int, call: Call, missed, scale: float,
          miss_s: float, hit_compute_s: float):
    """One call at ``clock``: (its stall, its reads' wait, misses taken from
    reads ahead). It takes its layer's reads ahead, reads the rest of its
    misses on demand; its resident experts' compute hides part of the wait."""
    disk.advance(clock)
    staged = disk.arrive(layer)
    from_stage = [staged[e] for e in missed.tolist() if e in staged]
    end = max([disk.demand(clock, len(missed) - len(from_stage))] + from_stage)
    read = end - clock + len(missed) * scale * miss_s
    # Paged overlaps only calls whose reads take OVERLAP_MIN_READ_S or more.
    hidden = ((call.ids.size - len(missed)) * scale * hit_compute_s
              if read >= OVERLAP_MIN_READ_S else 0.0)
    return max(0.0, read - hidden), read, len(from_stage)


def _issue(disk: Disk, judges, calls, resident, ahead, records: int, partial_share: float,
           now: float) -> None:
    """A call's reads ahead: the next call's predictions within the bandwidth
    (``within_bandwidth``), then (depth 2) the one after's with the room left,
    as ``NextLayerPrefetch.issue``; ``judges`` holds each layer's
    calibration."""
    room = records
    for distance, (t, layer) in enumerate(ahead, 1):
        call = calls[layer][t]
        ranked, scores = ((call.ranked, call.scores) if distance == 1
                          else (call.ranked2, call.scores2))
        partly = distance == 1 and partial_share > 0  # a record the compute partly covers
        if ranked is None or (room <= 0 and not partly):
            return
        if scores is None:
            scores = np.ones(ranked.shape)
        order, order_scores = _candidates(ranked, scores, resident[layer][t])
        rows = len(call.ids)
        if distance == 1:
            picked = judges[layer].select(layer, order, order_scores, rows)
            order = within_bandwidth(picked, records, partial_share,
                                  lambda e: judges[layer].used_share(layer, e, rows))
        else:
            order = judges[layer].select_two_ahead(layer, order, order_scores, rows)[:room]
        room -= disk.stage(layer, order, now, t)


def add_arguments(p) -> None:
    p.add_argument("--validate", action="store_true",
                   help="measure this machine and check projections against bench decode")
    p.add_argument("--project", action="store_true",
                   help="project Apple Silicon machines x large MoE models (needs --trace "
                        "or --model for hit rates)")
    p.add_argument("--model", help="stream directory (validate: the model run)")
    p.add_argument("--mlx-model", help="the same model as an mlx-lm directory (validate)")
    p.add_argument("--trace", type=Path, help="routing trace for --project hit rates")
    p.add_argument("--pools", default="0.25,0.5")
    p.add_argument("--policies", default=DEFAULT_POLICY)
    p.add_argument("--prefetch", default="off", help="off, next-layer, or both comma-separated")
    p.add_argument("--prefetch-precision", type=float, default=None,
                   help="prefetch_precision of the decode and overhead cases (validate) or "
                        "of the projection (default: load()'s)")
    p.add_argument("--prefetch-depth", default=None,
                   help="prefetch_depth, comma-separated to compare (e.g. 1,2; default: "
                        "load()'s)")
    p.add_argument("--read-mbps", type=float, default=None,
                   help="validate with reads throttled (cgroup blkio), as bench decode")
    p.add_argument("--pace-mbps", type=float, default=None,
                   help="validate with the reader emulating a disk of this rate "
                        "(read_pace_mbps), as bench decode")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench-results/simulate"))


def run(args) -> dict:
    if args.validate == args.project:
        raise BenchError("bench simulate needs exactly one of --validate or --project")
    args.out.mkdir(parents=True, exist_ok=True)
    return validate(args) if args.validate else project(args)


# The partial pool bench overhead measures the host's per-record work on.
OVERHEAD_POOL = 0.25
# The two paths of a paged call on this machine.
IN_GRAPH, SYNCED = "calls in the graph", "a host sync per call"


def validate(args) -> dict:
    from . import decode, overhead

    if not (args.model and args.mlx_model):
        raise BenchError("--validate needs --model and --mlx-model")
    manifest = read_manifest(args.model)
    spec = manifest.layers[0]
    # bench decode's own defaults, then what this validation sets.
    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    ns = parser.parse_args(["--model", str(args.model)])
    vars(ns).update(
        mlx_model=args.mlx_model, pools=args.pools, temp=args.temp,
        max_tokens=args.max_tokens, prefetch=args.prefetch,
        prefetch_precision=None if args.prefetch_precision is None else str(
            args.prefetch_precision), prefetch_depth=args.prefetch_depth,
        direct_io="on" if args.read_mbps or args.pace_mbps else "auto",
        policies=args.policies, read_mbps=args.read_mbps, pace_mbps=args.pace_mbps,
        repeats=args.repeats, out=args.out / "decode")
    measured = decode.run(ns)
    ov = overhead.run(argparse.Namespace(model=args.model, repeats=500, tokens=args.max_tokens,
                                         rounds=max(3, args.repeats), policy="lru",
                                         pool=OVERHEAD_POOL,
                                         prefetch_precision=args.prefetch_precision,
                                         out=args.out / "overhead"))
    warm = _read_cost(args.model, spec)
    seconds = {int(n): t for n, t in warm["seconds"].items()}
    batch = max(seconds)
    iso = seconds[batch] / batch  # one record read in isolation
    gbps, latency = warm["gbps"], warm["latency_s"]
    if args.read_mbps:
        # A token-bucket throttle lets short bursts through at the disk's own
        # speed, so single reads overstate it; over a token it holds the rate.
        gbps, latency = args.read_mbps / 1e3, 0.0
    elif args.pace_mbps:
        # The paced reader's device: its rate, one read after another.
        gbps, latency = min(gbps, args.pace_mbps / 1e3), 0.0
    d, layers = ov["decode"], ov["moe_layers"]
    partial = f"paged, pool {OVERHEAD_POOL:.0%}"

    def profile(path, calls_case, misses_case):
        return Profile(f"this machine, {path}", gbps, latency, 0.0,
                       _call_cost(d[calls_case], d["resident"], layers),
                       _host_per_miss(d[misses_case], iso))

    # A resident expert's compute, from the isolated expert call (top-k of them).
    hit_compute = ov["pieces"]["resident_call"] / 1e6 / spec.top_k

    # A paged call takes one of two paths here, each with its own costs:
    # inside the graph (the CPU backend's native step, no host sync), or a
    # host sync per call (prefetch's path, and every call's on a GPU).
    in_graph = profile(IN_GRAPH, "paged, all hits", partial)
    synced = profile(SYNCED, f"{partial}, prefetch", f"{partial}, prefetch")
    resident = measured["rows"][0]
    resident_tps = resident["decode_tps"]
    calls = decode_records(args.out / "decode" / "decode-trace.jsonl")
    rows = []
    for row in measured["rows"][2:]:
        load = row.get("load") or {}
        # The path the case ran, as its own counters say.
        path = SYNCED if (row.get("syncs_per_token") or 0) > 0 else IN_GRAPH
        here = synced if path == SYNCED else in_graph
        overlap = path == SYNCED and load.get("overlap", True)
        p = project_case(calls, row["pool"], load.get("policy") or DEFAULT_POLICY,
                         _depth(load), 1 / resident_tps, here.sync_s,
                         len(manifest.layers), spec.expert_nbytes, spec.top_k, here.ssd_gbps,
                         here.ssd_latency_s, skip=WARMUP_TOKENS, miss_s=here.miss_s,
                         hit_compute_s=hit_compute if overlap else 0.0,
                         precision=load.get("prefetch_precision", DEFAULT_PREFETCH_PRECISION),
                         width=load.get("prefetch_width") or 0)
        # Judged as ratios to mlx-lm resident, paired round by round: the
        # machine's speed drifts between rounds by more than the error allowed.
        measured_ratio = paired_ratio(row["runs_tps"], resident["runs_tps"])
        projected_ratio = p["tps"] / resident_tps
        rows.append(dict(case=row["case"], pool=row["pool"], path=path,
                         measured_tps=row.get("decode_tps"),
                         projected_tps=p["tps"], measured_ratio=measured_ratio,
                         projected_ratio=projected_ratio, projected_hit=p["hit_rate"],
                         measured_hit=row.get("hit_rate"),
                         measured_wasted=row.get("prefetch_wasted_share"),
                         projected_wasted=p["wasted"],
                         error=projected_ratio / measured_ratio - 1 if measured_ratio else None))
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    if not errors:
        raise BenchError("no streamed case of bench decode ran: nothing to validate")
    result = dict(rows=rows, profiles=[asdict(in_graph), asdict(synced)],
                  resident_tps=resident_tps, hit_compute_s=hit_compute,
                  max_abs_error=max(errors))
    title = (f"bench simulate --validate: projected vs measured decode on this machine "
             f"(max error {result['max_abs_error']:.0%})")
    cols = [("case", "case", "s"), ("pool", "pool", ".0%"), ("path", "paged calls", "s"),
            ("measured_tps", "measured", ".3g"),
            ("projected_tps", "projected", ".3g"),
            ("measured_ratio", "measured x resident (paired)", ".3f"),
            ("projected_ratio", "projected x resident", ".3f"), ("error", "error", "+.0%"),
            ("measured_hit", "hit", ".0%"), ("projected_hit", "proj. hit", ".0%"),
            ("measured_wasted", "read ahead wasted", ".0%"),
            ("projected_wasted", "proj. wasted", ".0%")]
    return finish(args.out, "simulate", result, rows, cols, title, _plot_validate)


def _depth(load: dict) -> int:
    """MoE layers ahead a case read (0: prefetch off). ``auto`` is replayed
    as on: its trial is not modelled."""
    if load.get("prefetch", "off") == "off":
        return 0
    return load.get("prefetch_depth") or DEFAULT_PREFETCH_DEPTH


def _call_cost(case: dict, resident: dict, layers: int) -> float:
    """Seconds a paged call adds to a token beyond its stall on reads: each
    round of ``case`` (``bench overhead``'s decode) against the resident
    model's same round, the median."""
    costs = [(1 / a - 1 / r - reads["stall_seconds"] / reads["tokens"]) / layers
             for a, r, reads in zip(case["runs_tps"], resident["runs_tps"], case["runs_reads"])]
    return max(0.0, float(np.median(costs)))


def _host_per_miss(case: dict, iso_s: float) -> float:
    """What a missed record costs beyond its disk read: the stall of
    ``case``'s rounds less its disk reads, each at ``iso_s`` (a read in
    isolation), per miss: the host's work (tables, copies, the checksum
    of an expert's first read), and what makes a read in decode slower
    than one in isolation (on 3.9 MB records, most of it). Misses served
    from prefetch's staging are not read from disk, but the wait for a
    read ahead still in flight is in the stall, so on prefetch's path this
    counts some disk time that ``project_case`` also charges: small where
    reads are fast."""
    reads = case["runs_reads"]
    misses = sum(r["misses"] for r in reads)
    stall = sum(r["stall_seconds"] - r["records_read"] * iso_s for r in reads)
    return max(0.0, stall / misses) if misses else 0.0


def _read_cost(model, spec) -> dict:
    """The reader's latency per call and rate from the page cache, read
    into a pool's slots."""
    rd = run_case(dict(op="reads", kind="streaming", model=model, batch=spec.top_k,
                       load=dict(slots_per_layer=spec.top_k, checksums="off", direct_io=False)))
    if rd["status"] != "ok":
        raise BenchError(f"measuring the reader failed: {rd.get('error', rd['status'])}")
    return rd


def project(args) -> dict:
    trace = args.trace or (Path(args.model) / "routing-trace.jsonl" if args.model else None)
    if trace is None:
        raise BenchError("--project needs --trace (a routing trace of a learned-routing model)")
    if not Path(trace).is_file():
        raise BenchError(f"no routing trace at {trace}: bench cache --model STREAM records one "
                         "(routing-trace-w*.jsonl in its --out)")
    calls = _read_trace(Path(trace))
    from .decode import config_values

    policies = config_values("--policies", args.policies, "policy", str)
    settings = _project_prefetch(args, calls)
    rows = []
    for key, prof in PROFILES.items():
        for shape in SHAPES.values():
            row = dict(machine=prof.name, model=shape.name, spine_gb=shape.spine_bytes() / 1e9,
                       experts_gb=shape.moe_layers * shape.experts * shape.expert_bytes() / 1e9)
            fraction = _pool_fraction(prof, shape, prefetch=False)
            if fraction < shape.top_k / shape.experts:
                row.update(pool=max(0.0, fraction), note="pool below one token's experts")
                rows.append(row)
                continue
            active = shape.dense_active_params * 4.5 / 8 + \
                shape.moe_layers * shape.top_k * shape.expert_bytes()
            compute = active / (prof.weight_gbps * 1e9)
            # Every call syncs on a GPU; its resident experts compute while
            # its misses are read (Paged's overlap).
            hit_compute = shape.expert_bytes() / (prof.weight_gbps * 1e9)
            for policy, (prefetch, depth, precision) in itertools.product(policies, settings):
                case = dict(row, policy=policy, prefetch=prefetch)
                fraction = _pool_fraction(prof, shape, prefetch=bool(depth))
                if fraction >= 1:  # every expert resident: mlx-lm's own decode
                    if prefetch == "off":
                        rows.append(dict(case, pool=1.0, hit_rate=1.0,
                                         projected_tps=1 / compute, read_share=0.0))
                    continue
                p = _project_pool(calls, fraction, policy=policy, prefetch=depth,
                                  compute_s=compute, sync_s=prof.sync_s,
                                  moe_layers=shape.moe_layers, expert_bytes=shape.expert_bytes(),
                                  top_k=shape.top_k, ssd_gbps=prof.ssd_gbps,
                                  ssd_latency_s=prof.ssd_latency_s, skip=WARMUP_TOKENS,
                                  miss_s=prof.miss_s, hit_compute_s=hit_compute,
                                  precision=precision)
                rows.append(dict(case, pool=fraction, hit_rate=p["hit_rate"],
                                 projected_tps=p["tps"], read_share=p["stall_s"] / p["seconds"],
                                 read_ahead=p["read_ahead_per_token"],
                                 cover=p["cover"] if depth else None))
    result = dict(rows=rows, profiles={k: asdict(v) for k, v in PROFILES.items()},
                  shapes={k: asdict(v) for k, v in SHAPES.items()}, trace=str(trace))
    cols = [("machine", "machine", "s"), ("model", "model", "s"), ("policy", "policy", "s"),
            ("spine_gb", "spine GB", ".1f"), ("experts_gb", "experts GB", ".0f"),
            ("pool", "pool", ".0%"), ("hit_rate", "hit", ".0%"),
            ("prefetch", "prefetch", "s"), ("projected_tps", "projected tok/s", ".3g"),
            ("read_share", "reads", ".0%"), ("read_ahead", "read ahead / token", ".1f"),
            ("cover", "records a layer's compute reads", ".2f")]
    title = "bench simulate --project: PROJECTED decode tok/s (not measured), 4-bit models"
    return finish(args.out, "projection", result, rows, cols, title, _plot_project)


def _pool_fraction(prof: Profile, shape: ModelShape, prefetch: bool) -> float:
    """The share of each MoE layer's experts its pool holds: memory less a
    quarter left to the OS and apps, the spine, and with prefetch its
    staging area, which the loader's memory plan counts only where some
    experts are not resident."""
    room = prof.memory_gb * 0.75e9 - shape.spine_bytes()
    if prefetch and _pool_fraction(prof, shape, prefetch=False) < 1:
        staging = staging_records(StreamConfig(prefetch="next-layer"), [shape])
        room -= staging * shape.expert_bytes()
    return min(1.0, room / shape.expert_bytes() / shape.moe_layers / shape.experts)


def _read_trace(trace: Path) -> Dict[int, List[Call]]:
    """A trace's decode calls, with enough tokens to replay past the
    warm-up; a trace cut short or not a trace is refused in one line."""
    try:
        calls = decode_records(trace)
    except (ValueError, KeyError, TypeError, IndexError, OSError) as e:  # JSONDecodeError
        # is a ValueError
        raise BenchError(f"{trace} is not a routing trace that bench simulate can read "
                         f"({type(e).__name__}: {e}); record it again") from None
    tokens = min((len(seq) for seq in calls.values()), default=0)
    if tokens <= WARMUP_TOKENS:
        raise BenchError(f"{trace} holds {tokens} decode tokens; the projection needs more "
                         f"than the {WARMUP_TOKENS} that warm the pools (record a longer one)")
    return calls


def _project_prefetch(args, calls) -> list:
    """(label, depth, precision) of each projected setting, checked as
    bench decode checks them; prefetch needs the predictions of a decode
    trace."""
    from .decode import config_values

    depths = config_values("--prefetch-depth", args.prefetch_depth, "prefetch_depth", int)
    precision = config_values("--prefetch-precision", None if args.prefetch_precision is None
                               else str(args.prefetch_precision), "prefetch_precision", float)[0]
    if precision is None:
        precision = DEFAULT_PREFETCH_PRECISION
    settings = []
    for prefetch in args.prefetch.split(","):
        if prefetch == "off":
            settings.append(("off", 0, 0.0))
        elif prefetch == "next-layer":
            for depth in depths:
                depth = depth or DEFAULT_PREFETCH_DEPTH
                settings.append((f"next-layer, depth {depth}", depth, precision))
        else:
            raise BenchError(f"--prefetch {prefetch!r}: project takes off, next-layer or both "
                             "comma-separated")
    predicted = any(c.ranked is not None for seq in calls.values() for c in seq)
    if any(depth for _, depth, _ in settings) and not predicted:
        raise BenchError("this trace holds no predictions to read ahead: project prefetch "
                         "from the decode trace bench decode records (decode-trace.jsonl)")
    two_ahead = any(c.ranked2 is not None for seq in calls.values() for c in seq)
    if any(depth == 2 for _, depth, _ in settings) and not two_ahead:
        raise BenchError("this trace holds no predictions two layers ahead (recorded at "
                         "prefetch_depth 1, or a model of fewer than 3 MoE layers): project "
                         "--prefetch-depth 1, or record the trace again with bench decode")
    return settings


def _plot_validate(rows, path, title):
    plt = figure()
    fig, ax = plt.subplots(figsize=(6, 5))
    m = [r["measured_tps"] or 0 for r in rows]
    p = [r["projected_tps"] for r in rows]
    ax.scatter(m, p)
    hi = max(m + p) * 1.1
    ax.plot([0, hi], [0, hi], "k--", lw=1)
    ax.fill_between([0, hi], [0, hi * 0.85], [0, hi * 1.15], alpha=0.15, label="±15%")
    ax.set_xlabel("measured tok/s")
    ax.set_ylabel("projected tok/s")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_project(rows, path, title):
    plt = figure()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ok = [r for r in rows if r.get("projected_tps")]
    labels = [f"{r['machine']}\n{r['model']}" for r in ok]
    ax.barh(range(len(ok)), [r["projected_tps"] for r in ok])
    ax.set_yticks(range(len(ok)), labels, fontsize=6)
    ax.set_xlabel("projected decode tok/s (a projection, not a measurement)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
