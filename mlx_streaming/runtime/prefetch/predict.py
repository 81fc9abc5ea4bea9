"""Cross-layer prefetch: predict the next MoE layer's experts from this
layer's input with the next layer's own router, and read them ahead.

While layer L runs, layer L+1's router is applied to layer L's MoE input,
evaluated in L's one host sync with its ids. Each expert's probability is
weighed by how often it followed the experts L chose (``Affinity``), and the
best that are not resident are read into the staging area, once L's own
demand reads are done: queued earlier, they would delay them. The reads run
while L's experts compute. When layer L+1 routes, the predicted experts it
really uses are moved into slots; the rest are dropped without evicting
anything. ``PrefetchBandwidth`` bounds the reads per layer by what the disk
reads in one layer's compute time; the calibration keeps to the
predictions whose scores were used often enough (docs/prefetch.md).
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from ..events import Events


@dataclass(frozen=True)
class Target:
    """A layer prefetch reads for: its router applied to the predicting
    layer's input (None: predicted from affinity alone), its store, and the
    calibration that judges its predictions."""

    scorer: object
    store: object
    calibration: object


@dataclass(frozen=True)
class Shared:
    """What every layer's prefetcher shares: the model's trial, bandwidth
    and affinity, the events, and the width and token limit of a
    prediction."""

    trial: object
    bandwidth: object
    affinity: object  # an Affinity, or None
    events: Events
    max_tokens: int


class NextLayerPrefetch:
    """Prefetch of one layer's successor (``next``). The last MoE layer's
    successor is the first MoE layer of the next token: no router can see
    that token yet (``next.scorer`` None), so it is predicted from affinity
    alone.

    With ``two_ahead`` (``prefetch_depth=2``), the disk time that the
    successor's reads leave in this layer's bandwidth reads the likeliest
    experts of the layer after next, predicted by its router on this
    layer's input: a read queued a layer earlier has two layers' compute to
    finish in. The successor's own prediction of that layer, one call
    later, tops it up.
    """

    def __init__(self, layer: int, next: Target, width: int, shared: Shared,
                 two_ahead: Optional[Target] = None):
        self.layer = layer
        self.next = next
        self.width = width
        self.shared = shared
        self.two_ahead = two_ahead

    def predict(self, x: mx.array, tokens: int):
        """The arrays to evaluate in this layer's sync, or None: no prefetch
        in this call."""
        if tokens > self.shared.max_tokens or not self.shared.trial.enabled:
            return None
        if self.next.scorer is None:
            return ()
        near = self.next.scorer.probabilities(x)  # [..., E]
        if self.two_ahead is None:
            return (near,)
        return (near, self.two_ahead.scorer.probabilities(x))

    def issue(self, predicted, ids: np.ndarray) -> None:
        """Stage the best predictions of the next layer, given this layer's
        ``ids`` (called after this layer's demand reads), then those of the
        layer after next with the bandwidth left."""
        if predicted is None:
            return
        rows = ids.reshape(-1, ids.shape[-1])
        probs = self._next_probabilities(predicted, rows)
        if probs is None:
            return
        issued = self._stage_next(probs, len(rows))
        # The bandwidth is reads in this layer's compute time: those of the
        # next layer's records that the layer before staged two layers
        # early (skipped now) were read in its time.
        room = self.shared.bandwidth.records - issued  # below 0 after a partly covered one
        if self.two_ahead is not None and len(predicted) > 1 and room > 0:
            self._stage_two_ahead(np.array(predicted[1]).reshape(len(rows), -1), len(rows),
                                  room)

    def _next_probabilities(self, predicted, rows: np.ndarray) -> Optional[np.ndarray]:
        """``[rows, E]`` scores of the next layer's experts, or None: no
        guess worth a read (affinity alone, and nothing counted yet)."""
        affinity = self.shared.affinity
        if predicted:
            probs = np.array(predicted[0]).reshape(len(rows), -1)
        elif affinity.seen(self.layer):
            probs = np.ones((len(rows), self.next.store.spec.num_experts), np.float32)
        else:
            return None
        # A sigmoid router's softmax is flat (scores within ~1 of each other):
        # weighed, affinity would decide alone. It keeps its own order.
        if affinity is not None and scores_calibrated(self.next.scorer):
            probs = probs * affinity.weights(self.layer, rows)
        return probs

    def _stage_next(self, probs: np.ndarray, rows: int) -> int:
        target, bandwidth = self.next, self.shared.bandwidth
        layer = target.store.layer
        ranked, ranked_scores, order, scores = self._candidates(probs, target.store)
        picked = target.calibration.select(layer, order, scores, rows)
        order = within_bandwidth(picked, bandwidth.records, bandwidth.partial,
                                 lambda e: target.calibration.used_share(layer, e, rows))
        issued = target.store.stage(order)
        events = self.shared.events
        events.on_predict(layer, ranked, ranked_scores, 1, scores_calibrated(target.scorer))
        events.on_prefetch(layer, issued=issued)
        return issued

    def _stage_two_ahead(self, probs: np.ndarray, rows: int, room: int) -> None:
        target = self.two_ahead
        layer = target.store.layer
        ranked, ranked_scores, order, scores = self._candidates(probs, target.store)
        order = target.calibration.select_two_ahead(layer, order, scores, rows)[:room]
        events = self.shared.events
        events.on_prefetch(layer, issued=target.store.stage(order))
        events.on_predict(layer, ranked, ranked_scores, 2, scores_calibrated(target.scorer))

    def _candidates(self, probs: np.ndarray, store):
        """The ``width`` best of each row and their scores, and the distinct
        ones that are not resident in ``store``, best first, with theirs."""
        probs = probs / probs.sum(axis=-1, keepdims=True)
        ranked = np.argsort(-probs, axis=-1, kind="stable")[:, : self.width]
        order = rank_order(ranked)
        order = order[~store.resident(order)]
        # A score of 1: the prediction cannot tell this expert from another.
        scale = probs.shape[-1]
        scores = probs.max(axis=0)[order] * scale
        return ranked, np.take_along_axis(probs, ranked, -1) * scale, order, scores


def within_bandwidth(order: np.ndarray, records: int, partial: float, chance) -> np.ndarray:
    """The reads ahead of ``order`` (best first) that the bandwidth allows:
    the first ``records``, which the disk reads within the layer's compute,
    and the one after them if the chance that it is used (``chance(e)``)
    is at least 1 - ``partial``. The disk reads only ``partial`` of that
    record within the compute, and the rest runs into the next layer's
    demand reads: used, it saved them ``partial`` of a read; wasted, it
    cost them the rest. This is what a disk slower than a layer's compute
    can still read ahead. Where the chance is not known yet (None: nothing
    counted) it is not read."""
    if len(order) <= records or partial <= 0:
        return order[:records]
    p = chance(int(order[records]))
    return order[: records + (p is not None and p >= 1 - partial)]


def scores_calibrated(scorer) -> bool:
    """Whether predictions from ``scorer`` (None: affinity alone) are binned
    by score: a softmax router's are, a sigmoid router's are too flat to
    bin, so the layer it predicts reads every prediction the bandwidth
    allows."""
    return scorer is None or scorer.softmax


def rank_order(ids: np.ndarray) -> np.ndarray:
    """Distinct ids of ``[rows, width]`` predictions, best first: those
    predicted for the most rows first (a verify call needs the union of its
    tokens' experts, and shared ones serve several), then every row's first
    choice before any row's second."""
    order = np.ascontiguousarray(ids.reshape(-1, ids.shape[-1]).T).ravel()
    unique, first, counts = np.unique(order, return_index=True, return_counts=True)
    return unique[np.lexsort((first, -counts))].astype(np.int64)
