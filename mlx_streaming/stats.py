"""Diagnostics as observers of the expert stores.

The stores and blocks announce what happened (a lookup, a read, a host sync,
a routing decision) through ``Events``; observers count it (``Stats``) or
record it (``TraceWriter``). Nothing here sits in the arithmetic of a
forward pass, and ``stats(model)`` reads the counters from outside.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Dict, List, Optional

from .errors import ConfigError

if TYPE_CHECKING:  # numpy is imported where used: the package imports this module
    import numpy as np


class Observer:
    """Base observer: every event is a no-op unless overridden."""

    def on_call(self, layer: int, tokens: int) -> None: ...
    def on_lookup(self, layer: int, hits: int, misses: int) -> None: ...
    def on_read(self, layer: int, records: int, nbytes: int, seconds: float) -> None: ...
    def on_stall(self, layer: int, seconds: float) -> None: ...
    def on_sync(self, layer: int) -> None: ...
    def on_route(self, layer: int, ids: np.ndarray, experts: np.ndarray,
                 probs: Optional[np.ndarray] = None) -> None: ...
    def on_predict(self, layer: int, ids: np.ndarray, scores: Optional[np.ndarray] = None,
                   distance: int = 1, softmax: bool = True) -> None:
        """Prefetch's prediction of ``layer``'s routing, made ``distance``
        MoE layers before it: ``ids`` ``[tokens, width]`` best first, and
        their ``scores`` (share of the row's probability times the number of
        experts), as the calibration bins them; ``softmax`` False: ``layer``
        has a sigmoid router, whose scores prefetch does not calibrate."""
    def on_prefetch(self, layer: int, issued: int = 0, useful: int = 0, wasted: int = 0) -> None: ...
    def on_graph_calls(self, layer: int, calls: int, tokens: int, hits: int, misses: int,
                       distinct: int, records: int, nbytes: int, read_seconds: float,
                       stall_seconds: float) -> None:
        """Paged calls made inside the graph, with no sync (store.NativeStore),
        summed over one forward pass."""

    def on_paged_call(self, layer: int, tokens: int, ids: np.ndarray, experts: np.ndarray,
                      hits: int, probs: Optional[np.ndarray] = None) -> None:
        """A paged call after its sync: one event for the hot path, which
        an observer may count at once; by default the four finer ones."""
        self.on_sync(layer)
        self.on_call(layer, tokens)
        self.on_route(layer, ids, experts, probs)
        self.on_lookup(layer, hits, ids.size - hits)


class Events:
    """Fans each event out to the observers."""

    def __init__(self, observers: List[Observer]):
        self.observers = list(observers)

    def __getattr__(self, name):
        if not name.startswith("on_"):
            raise AttributeError(name)
        handlers = [getattr(o, name) for o in self.observers]

        def emit(*args, **kwargs):
            for h in handlers:
                h(*args, **kwargs)

        # Cache the bound fan-out so later events skip __getattr__.
        setattr(self, name, emit)
        return emit


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
        # Recall: the share of routed experts that the previous layer's
        # prediction named.
        d["prefetch_recall"] = (
            self.predicted_routed / self.routed if self.routed else None
        )
        # Distinct experts one call needs (known where calls sync).
        d["experts_per_call"] = (
            self.distinct_experts / (self.syncs + self.graph_calls)
            if self.syncs + self.graph_calls else None
        )
        return d


class Stats(Observer):
    """Counters per layer; ``report()`` adds the totals."""

    def __init__(self, layers: List[int]):
        self.layers = list(layers)
        self.reset()

    def reset(self) -> None:
        self.counters: Dict[int, LayerCounters] = {l: LayerCounters() for l in self.layers}
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
        # Sets, not np.isin: on a few ids np.isin costs ~150 us a call.
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
            "layers": {l: c.to_dict() for l, c in self.counters.items()},
        }


class TraceWriter(Observer):
    """Writes one JSON line per MoE call: the layer, the expert ids each
    token was routed to, prefetch's predictions of them when it made them
    (``predicted`` and ``predicted_scores`` from the layer before,
    ``predicted2`` and ``predicted2_scores`` from the layer before that, and
    ``sigmoid_router`` where the layer's router is one, whose scores prefetch
    does not calibrate), and the router's probabilities when the policy asks for them
    (``mlx_streaming bench cache`` and ``bench simulate`` replay them)."""

    def __init__(self, path: str):
        self.path = path
        self._predicted = {}
        self._sigmoid = set()  # layers predicted with a sigmoid router's scores
        try:
            self._file = open(path, "w")
        except OSError as e:
            raise ConfigError(f"cannot write the trace to {path} ({e.strerror})") from None

    def on_predict(self, layer, ids, scores=None, distance=1, softmax=True):
        self._predicted[layer, distance] = (ids, scores)
        if not softmax:
            self._sigmoid.add(layer)

    def on_route(self, layer, ids, experts, probs=None):
        record = {"layer": layer, "ids": ids.reshape(-1, ids.shape[-1]).tolist()}
        for distance, key in ((1, "predicted"), (2, "predicted2")):
            predicted, scores = self._predicted.pop((layer, distance), (None, None))
            if predicted is not None:
                record[key] = predicted.reshape(-1, predicted.shape[-1]).tolist()
            if scores is not None:
                rows = scores.reshape(len(record[key]), -1).tolist()
                record[key + "_scores"] = [[round(x, 4) for x in row] for row in rows]
        if layer in self._sigmoid and ("predicted" in record or "predicted2" in record):
            record["sigmoid_router"] = True
        if probs is not None:
            record["probs"] = [[round(p, 5) for p in row] for row in probs.tolist()]
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def read_trace(path: str):
    """Yield ``(layer, ids[tokens, k])`` from a trace file."""
    for record in read_trace_records(path):
        yield record["layer"], record["ids"]


def read_trace_records(path: str):
    """Yield each call of a trace file as a dict: ``layer``, ``ids``
    ``[tokens, k]``, and where recorded ``predicted``, ``predicted2``, their
    ``_scores``, ``sigmoid_router`` and ``probs``."""
    import numpy as np

    with open(path) as f:
        for line in f:
            d = json.loads(line)
            d["ids"] = np.array(d["ids"], dtype=np.int64)
            for key in ("predicted", "predicted2"):
                if key in d:
                    d[key] = np.array(d[key], dtype=np.int64)
                if key + "_scores" in d:
                    d[key + "_scores"] = np.array(d[key + "_scores"], dtype=np.float64)
            if "probs" in d:
                d["probs"] = np.array(d["probs"], dtype=np.float64)
            yield d


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
    # Between forward passes, as reset_stats: a pass counts as it goes,
    # and a report read inside one (a thread switch between two counters)
    # could show a layer's reads ahead used but not yet issued.
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
        num_experts=max(l.num_experts for l in runtime.manifest.layers),
        moe_layers=sum(not l.module.startswith("mtp.") for l in runtime.manifest.layers),
        cache_bytes=runtime.cache_bytes,
        residency="paged" if runtime.paged else "resident",
        prefetch=config.prefetch,
        prefetch_decision=_prefetch_decision(runtime),
        prefetch_budget=_budget_of(runtime),
    )
    if runtime.reader.name == "remote":
        report["remote"] = runtime.reader.report()
    report["speculative"] = runtime.speculative.report()
    report["pressure"] = runtime.pressure.report()
    report["memory"] = runtime.plan.report()
    report["spine"] = runtime.ring.stats.report() if runtime.ring is not None else None
    staging = getattr(runtime, "staging", None)
    if staging is not None:
        # Dropped records whose reads had not started cost no bytes.
        t = report["total"]
        t["prefetch_cancelled"] = staging.cancelled() - runtime.cancelled_at_reset
        read = t["prefetch_issued"] - t["prefetch_cancelled"]
        t["prefetch_wasted_read_share"] = (
            max(0, read - t["prefetch_useful"]) / read if read > 0 else None)
    return report


def _prefetch_decision(runtime) -> str:
    if runtime.config.prefetch == "off":
        return "off"
    if not runtime.paged:
        return "off: every expert resident"
    return runtime.prefetch_switch.decision


def _budget_of(runtime):
    """The bandwidth budget of prefetch: whole records per layer, the share
    of one more that a layer's compute covers (``spare``), its inputs, and
    per layer the least score ``prefetch_precision`` lets it read ahead of
    the predictions made one layer early (``lowest_score``) and two
    (``lowest_score_two_ahead``) (None: nothing yet, or a layer no decode
    call predicts; absent, or all absent: the layer reads every
    prediction)."""
    b = getattr(runtime, "prefetch_budget", None)
    if b is None:
        return None
    calibration = runtime.prefetch_calibration
    far = getattr(calibration, "far", None)  # ReadEveryPrediction has none
    return dict(records=b.records, spare=b.spare,
                read_gb_per_s=b.rate / 1e9 if b.rate else None,
                layer_compute_s=b.layer_compute, lowest_score=calibration.lowest_scores(),
                lowest_score_two_ahead=far.lowest_scores() if far is not None else {})


def reset_stats(model) -> None:
    runtime = runtime_of(model)
    # Between forward passes: a pass stages reads ahead for its next layer
    # and counts them used there, so a reset inside one would leave reads
    # counted used that no issued count holds.
    with runtime.lock:
        _reset(runtime)


def _reset(runtime) -> None:
    for store in runtime.stores:
        drain = getattr(store, "drain_counters", None)
        if drain is not None:
            drain()  # calls made inside the graph and not yet reported
        # Reads ahead issued before the reset would be counted used or
        # wasted after it, against no issued count.
        store.drop_staged()
    runtime.stats.reset()
    runtime.speculative.reset()
    if runtime.reader.name == "remote":
        runtime.reader.reset()
    if runtime.ring is not None:
        runtime.ring.reset_stats()
    if getattr(runtime, "staging", None) is not None:
        runtime.cancelled_at_reset = runtime.staging.cancelled()
