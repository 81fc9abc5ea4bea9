"""Which predictions are worth a read: how often each was used, counted per
score bin or per rank.
"""

from typing import Optional

import numpy as np


class UseCounts:
    """How often a layer's predictions were used, counted per bucket (a
    score's bin, a rank): every candidate of a selection, read or not,
    counts in its bucket, and the layer's next call says whether it was
    used. Calls of several tokens (verifying drafts) are counted apart, and
    judged only by a call of as many tokens (not by the prefill that
    follows a request's last token). A layer's counts halve whenever they
    pass ``window`` predictions, so that the text can move them.
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
        ``layer``, predicted from a call of ``rows`` tokens; counted when
        ``layer`` routes."""
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
        routed = set(experts.tolist())  # sets: np.isin costs ~150 us on a few ids
        used = np.fromiter((e in routed for e in order.tolist()), bool, len(order))
        predicted = self.predicted.setdefault(key, np.zeros(self.buckets))
        np.add.at(predicted, buckets, 1.0)
        np.add.at(self.used.setdefault(key, np.zeros(self.buckets)), buckets, used)
        if predicted.sum() > self.window:
            predicted /= 2
            self.used[key] /= 2
        self._counted(key)

    def used_share(self, layer, expert, rows) -> Optional[float]:
        """The chance that ``expert``, a candidate of ``layer``'s last
        selection (from a call of ``rows`` tokens), is used: the share used
        of the predictions in its bucket, with one used and one unused more
        (a bucket of few counts, common early and in a short text, is
        neither trusted nor refused outright); None where the layer counts
        nothing."""
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
    """``prefetch_precision=0``, and the layers a sigmoid router predicts:
    every prediction is worth a read (within the bandwidth). For the record
    that the bandwidth covers only in part (``within_bandwidth``) it counts
    how often each rank of a layer's candidates was used: its chance."""

    RANKS = 64  # ranks counted; those past it count as the last

    def __init__(self, window: int = 4096):
        super().__init__(self.RANKS, window)

    def _bucket(self, order, scores):
        return np.minimum(np.arange(len(order)), self.RANKS - 1)

    def _read(self, layer, order, buckets, rows):
        return order

    def select_two_ahead(self, layer, order, scores, rows):
        return order  # not counted: no partly covered read two layers early

    def forget(self, layer) -> None:
        pass

    def lowest_scores(self) -> dict:
        return {}


class PrefetchCalibration(UseCounts):
    """``prefetch_precision > 0``: reads ahead only predictions likely
    enough to be used, so that at least ``target`` of what a layer reads
    ahead is used.

    A prediction's score is its share of the row's (affinity-weighed)
    probability, times the number of experts: 1 is an expert the
    prediction cannot tell from any other. Per layer, every prediction of
    an expert not resident, read or not, counts in a bin of its score
    (``UseCounts``; calls of several tokens predict and use the union of
    their tokens' experts, each scored by its best row). A layer reads the
    bins from the highest down to the lowest whose predictions together
    were used at least ``target`` of the time. Predictions made two layers
    early (``select_two_ahead``) are counted apart, in a calibration of
    their own (``two_ahead``): at the same score they are used less often.

    Softmax routers only: a sigmoid router's probabilities lie within a
    factor of ~3 of each other, too few bins to tell (the loader gives
    those layers ``ReadEveryPrediction``).

    Scores tell more than ranks (docs/prefetch.md, "precision").

    Nothing is read ahead until a layer's predictions have been counted,
    and the lowest bin read always has counts.
    """

    # Half-octave bins of scores from 1/4 to 512 (a score is at most the
    # number of experts).
    EDGES = 2.0 ** (np.arange(-4, 19) / 2)

    def __init__(self, layers, target: float, window: int = 4096,
                 two_ahead: bool = True):
        super().__init__(len(self.EDGES) + 1, window)
        self.target = target
        # Predictions made two layers early, counted where the bandwidth
        # leaves them room.
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
        """``select`` for the predictions of a layer made two layers early
        (``prefetch_depth=2``), counted and judged apart."""
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
        """Per layer, the least score its decode calls read ahead (None:
        nothing is)."""
        edges = np.concatenate([[0.0], self.EDGES])
        return {layer: float(edges[b]) if b < len(edges) else None
                for (layer, multi), b in sorted(self.lowest.items()) if not multi}
