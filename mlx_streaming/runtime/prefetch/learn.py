"""What prefetch learns from the running model: ``PrefetchControl`` feeds the
learners of how many records to read ahead (``PrefetchBandwidth``), which
experts follow which (``Affinity``) and which predictions pay (calibrations)."""

import time
from typing import Callable, Optional, Sequence

import numpy as np

from ..events import Observer

CallHook = Callable[[int, int], None]  # (layer, tokens)
RouteHook = Callable[[int, np.ndarray, np.ndarray], None]  # (layer, ids, distinct experts)
StallHook = Callable[[int, float], None]  # (layer, seconds the device waited)


class PrefetchControl(Observer):
    """Feeds prefetch's learners from the paged calls' events (the factory wires them)."""

    def __init__(self, on_call: Sequence[CallHook] = (), on_route: Sequence[RouteHook] = (),
                 on_stall: Sequence[StallHook] = ()):
        self._call, self._route, self._stall = list(on_call), list(on_route), list(on_stall)

    def on_paged_call(self, layer: int, tokens: int, ids: np.ndarray, experts: np.ndarray,
                      hits: int, probs=None) -> None:
        for hook in self._call:
            hook(layer, tokens)
        for hook in self._route:
            hook(layer, ids, experts)

    def on_stall(self, layer: int, seconds: float) -> None:
        for hook in self._stall:
            hook(layer, seconds)



class NoPrefetch:
    """A layer that prefetches nothing."""

    def predict(self, x, tokens):
        return None

    def issue(self, predicted, ids) -> None:
        pass


class AlwaysOn:
    """The trial of ``prefetch="next-layer"``: none, always on."""

    enabled = True
    decision = "on"


class PrefetchBandwidth:
    """Stage per layer at most the records the disk reads within one layer's
    compute, both measured per decode token; starts at zero (docs/prefetch.md,
    "The bandwidth"; docs/design.md, "runtime/prefetch/learn.py")."""

    def __init__(self, first_layer: int, layers: int, record_bytes: int, max_tokens: int,
                 meter, clock=time.perf_counter, smoothing: float = 0.2, fixed=None):
        self.first_layer = first_layer
        self.layers = layers
        self.record_bytes = record_bytes
        self.max_tokens = max_tokens
        self.meter = meter  # () -> (bytes read, seconds busy), running totals
        self.clock = clock
        self.smoothing = smoothing
        # Records the user fixed (load's prefetch_records) are never measured.
        self.records = 0 if fixed is None else fixed
        # The share of one more record the disk reads within a layer's compute.
        self.partial = 0.0
        self.rate = None  # bytes per second
        self._mean_bytes = self._mean_busy = None
        self.layer_compute = None  # seconds
        self._last = None
        self._read_at_last = (0, 0.0)
        self._stall = 0.0

    def _mean(self, old, new):
        return new if old is None else old + self.smoothing * (new - old)

    def on_stall(self, layer, seconds):
        self._stall += seconds

    def on_call(self, layer, tokens):
        if layer != self.first_layer:
            return
        now = self.clock()
        read = self.meter()
        if self._last is not None and tokens <= self.max_tokens:
            compute = max(0.0, now - self._last - self._stall) / self.layers
            self.layer_compute = self._mean(self.layer_compute, compute)
            nbytes, busy = read[0] - self._read_at_last[0], read[1] - self._read_at_last[1]
            if busy > 0 and not nbytes:
                # A read in flight through the whole token: its seconds wait for its bytes.
                read = self._read_at_last
            elif nbytes and busy > 0:
                # A ratio of means, not a mean of ratios: bursts would outweigh slow tokens.
                self._mean_bytes = self._mean(self._mean_bytes, nbytes)
                self._mean_busy = self._mean(self._mean_busy, busy)
                self.rate = self._mean_bytes / self._mean_busy
        # Only decode-to-decode intervals measure: a prefill call starts none.
        self._last = now if tokens <= self.max_tokens else None
        self._read_at_last = read
        self._stall = 0.0
        if self.rate is not None and self.layer_compute is not None:
            cover = self.rate * self.layer_compute / self.record_bytes
            self.records, self.partial = int(cover), cover - int(cover)


class Affinity:
    """How often each expert of a layer followed each of the layer before, on
    this model's routing so far; counts start at ``prior`` (docs/prefetch.md)."""

    def __init__(self, pairs, prior: float = 1.0):
        # pairs: (layer, experts, next layer, its experts); the last may wrap to the first.
        self.counts = {a: np.full((ea, eb), prior, np.float32) for a, ea, _, eb in pairs}
        self.before = {b: a for a, _, b, _ in pairs}
        self.wraps = {b for a, _, b, _ in pairs if b <= a}
        self.pairs_seen = dict.fromkeys(self.counts, 0)
        self._last = {}  # layer -> [rows, k] ids of its last call

    def on_route(self, layer, ids, experts):
        rows = ids.reshape(-1, ids.shape[-1])
        before = self.before.get(layer)
        if before is not None:
            last = self._last.pop(before, None)
            # Row i is the same token in both calls, except across the wrap (decode only).
            if last is not None and len(last) == len(rows) and (
                    layer not in self.wraps or len(rows) == 1):
                self._count(before, last, rows)
        if layer in self.counts:
            self._last[layer] = rows

    def _count(self, layer, before, after):
        """Add every (expert before, expert after) pair of each token."""
        counts = self.counts[layer]
        width = counts.shape[1]
        pairs = (before[:, :, None] * width + after[:, None, :]).ravel()
        counts += np.bincount(pairs, minlength=counts.size).reshape(counts.shape)
        self.pairs_seen[layer] += len(before)

    def seen(self, layer: int) -> int:
        """Tokens counted for the pair that starts at ``layer``."""
        return self.pairs_seen[layer]

    def weights(self, layer: int, rows: np.ndarray) -> np.ndarray:
        """``[rows, next experts]``: per token, its experts' mean share of successors."""
        counts = self.counts[layer][rows]  # [rows, k, E']
        return (counts / counts.sum(axis=-1, keepdims=True)).mean(axis=1)


class UseCounts:
    """How often a layer's predictions were used, per bucket (a score's bin, a
    position), calls of several tokens counted apart; counts halve past ``window``.
    Subclasses say which bucket a candidate falls in and which are read."""

    def __init__(self, buckets: int, window: int = 4096):
        self.buckets = buckets
        self.window = window
        # Keyed by (layer, whether the calls have several tokens).
        self.predicted = {}
        self.used = {}
        self._pending = {}  # layer -> (candidates, their buckets, tokens)

    def _bucket(self, order, scores) -> np.ndarray: ...

    def _read(self, layer, order, buckets, rows) -> np.ndarray: ...

    def _counted(self, key) -> None:
        """A layer's counts changed."""

    def select(self, layer, order, scores, rows):
        """The candidates of ``order`` (best first) worth reading ahead into
        ``layer``, predicted from a call of ``rows`` tokens; counted at its routing."""
        buckets = self._bucket(order, scores)
        self._pending[layer] = (order, buckets, rows)
        return self._read(layer, order, buckets, rows)

    def on_route(self, layer, ids, experts):
        pending = self._pending.pop(layer, None)
        if pending is None:
            return
        order, buckets, rows = pending
        if ids.reshape(-1, ids.shape[-1]).shape[0] != rows:
            return
        key = (layer, rows > 1)
        routed = set(experts.tolist())  # sets: np.isin is slow on a few ids
        used = np.fromiter((e in routed for e in order.tolist()), bool, len(order))
        predicted = self.predicted.setdefault(key, np.zeros(self.buckets))
        np.add.at(predicted, buckets, 1.0)
        np.add.at(self.used.setdefault(key, np.zeros(self.buckets)), buckets, used)
        if predicted.sum() > self.window:
            predicted /= 2
            self.used[key] /= 2
        self._counted(key)

    def used_share(self, layer, expert, rows) -> Optional[float]:
        """The chance that ``expert`` of ``layer``'s last selection is used: its
        bucket's share used, with one used and one unused more; None: no counts."""
        key = (layer, rows > 1)
        pending = self._pending.get(layer)
        if key not in self.predicted or pending is None:
            return None
        order, buckets, _ = pending
        at = np.flatnonzero(order == expert)
        if not len(at):
            return None
        b = buckets[at[0]]
        return float((self.used[key][b] + 1) / (self.predicted[key][b] + 2))


class ReadEveryPrediction(UseCounts):
    """``prefetch_precision=0`` and sigmoid-router layers: every prediction is read
    (within the bandwidth); counts by position give the partial record's chance."""

    POSITIONS = 64  # positions counted; those past it count as the last

    def __init__(self, window: int = 4096):
        super().__init__(self.POSITIONS, window)

    def _bucket(self, order, scores):
        return np.minimum(np.arange(len(order)), self.POSITIONS - 1)

    def _read(self, layer, order, buckets, rows):
        return order

    def select_two_ahead(self, layer, order, scores, rows):
        return order  # not counted: no partly covered read two layers early

    def forget(self, layer) -> None:
        pass

    def lowest_scores(self) -> dict:
        return {}


class PrefetchCalibration(UseCounts):
    """``prefetch_precision > 0``: reads ahead only the score bins whose
    predictions were used at least ``target`` of the time, two-ahead ones
    counted apart; softmax routers only (docs/prefetch.md, "Precision")."""

    # Half-octave bins of scores from 1/4 to 512 (a score is at most the experts).
    EDGES = 2.0 ** (np.arange(-4, 19) / 2)

    def __init__(self, layers, target: float, window: int = 4096,
                 two_ahead: bool = True):
        super().__init__(len(self.EDGES) + 1, window)
        self.target = target
        # Predictions made two layers early, counted apart.
        self.two_ahead = (PrefetchCalibration(layers, target, window, two_ahead=False)
                          if two_ahead else None)
        keys = [(layer, multi) for layer in layers for multi in (False, True)]
        self.predicted = {k: np.zeros(self.buckets) for k in keys}
        self.used = {k: np.zeros(self.buckets) for k in keys}
        self.lowest = dict.fromkeys(keys, self.buckets)  # lowest bin read: none yet

    def forget(self, layer) -> None:
        """``layer`` reads every prediction: nothing of it to count or report."""
        for multi in (False, True):
            for table in (self.predicted, self.used, self.lowest):
                table.pop((layer, multi), None)
        if self.two_ahead is not None:
            self.two_ahead.forget(layer)

    def _bucket(self, order, scores):
        return np.searchsorted(self.EDGES, scores, side="right")

    def _read(self, layer, order, bins, rows):
        return order[bins >= self.lowest[(layer, rows > 1)]]

    def select_two_ahead(self, layer, order, scores, rows):
        """``select`` for predictions made two layers early, counted apart."""
        if self.two_ahead is None:  # this is the two-ahead calibration itself
            return self.select(layer, order, scores, rows)
        return self.two_ahead.select(layer, order, scores, rows)

    def on_route(self, layer, ids, experts):
        if self.two_ahead is not None:
            self.two_ahead.on_route(layer, ids, experts)
        super().on_route(layer, ids, experts)

    def _counted(self, key) -> None:
        self.lowest[key] = self._lowest(key)

    def _lowest(self, key) -> int:
        # For each bin, the share used of every prediction in it or above.
        used = np.cumsum(self.used[key][::-1])[::-1]
        predicted = np.cumsum(self.predicted[key][::-1])[::-1]
        ok = np.flatnonzero((used >= self.target * predicted) & (self.predicted[key] > 0))
        return int(ok[0]) if len(ok) else len(predicted)

    def lowest_scores(self) -> dict:
        """Per layer, the least score its decode calls read ahead (None: none)."""
        edges = np.concatenate([[0.0], self.EDGES])
        return {layer: float(edges[b]) if b < len(edges) else None
                for (layer, multi), b in sorted(self.lowest.items()) if not multi}
