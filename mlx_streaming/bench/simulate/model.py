"""The model of decode on one clock: the calls of a trace run one after
another against a disk that behaves as the native reader drives it.
"""

import math
from collections import Counter, deque
from typing import Dict, List
import numpy as np
from ...runtime.block import OVERLAP_MIN_READ_S
from ...runtime.policy import make_policy
from ...runtime.prefetch.calibration import PrefetchCalibration, ReadEveryPrediction
from ...runtime.prefetch.predict import rank_order, within_bandwidth
from ..cache import Call, replay_misses
from ..common import BenchError


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


def project_pool(calls: Dict[int, List[Call]], fraction: float, **case) -> dict:
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
