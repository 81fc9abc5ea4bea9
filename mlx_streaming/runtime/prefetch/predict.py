"""Cross-layer prefetch: the next MoE layer's router, applied to this layer's
input, predicts its experts, and the best that are not resident are read
into the staging area after this layer's demand reads (docs/prefetch.md)."""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from ..events import Events


@dataclass(frozen=True)
class Target:
    """A layer prefetch reads for: its scorer (None: affinity alone), store, calibration."""

    scorer: object
    store: object
    calibration: object


@dataclass(frozen=True)
class Shared:
    """What every layer's prefetcher shares: trial, bandwidth, affinity, events, limits."""

    trial: object
    bandwidth: object
    affinity: object  # an Affinity, or None
    events: Events
    max_tokens: int


class NextLayerPrefetch:
    """Prefetch of one layer's successor (``next``), and with ``two_ahead`` of
    the layer after next (docs/prefetch.md, "Two layers ahead")."""

    def __init__(self, layer: int, next: Target, width: int, shared: Shared,
                 two_ahead: Optional[Target] = None):
        self.layer = layer
        self.next = next
        self.width = width
        self.shared = shared
        self.two_ahead = two_ahead

    def predict(self, x: mx.array, tokens: int):
        """The arrays for this layer's sync to evaluate, or None: no prefetch."""
        if tokens > self.shared.max_tokens or not self.shared.trial.enabled:
            return None
        if self.next.scorer is None:
            return ()
        near = self.next.scorer.probabilities(x)  # [..., E]
        if self.two_ahead is None:
            return (near,)
        return (near, self.two_ahead.scorer.probabilities(x))

    def issue(self, predicted, ids: np.ndarray) -> None:
        """Stage the next layer's best predictions, then the layer after next's."""
        if predicted is None:
            return
        rows = ids.reshape(-1, ids.shape[-1])  # [tokens, top_k]
        probs = self._next_probabilities(predicted, rows)
        if probs is None:
            return
        issued = self._stage_next(probs, len(rows))
        # Records the layer before staged two ahead were read in its time, not this one's.
        room = self.shared.bandwidth.records - issued  # below 0 after a partly covered one
        if self.two_ahead is not None and len(predicted) > 1 and room > 0:
            self._stage_two_ahead(np.array(predicted[1]).reshape(len(rows), -1), len(rows),
                                  room)

    def _next_probabilities(self, predicted, rows: np.ndarray) -> Optional[np.ndarray]:
        """``[rows, E]`` scores of the next layer's experts, or None: nothing worth a read."""
        affinity = self.shared.affinity
        if predicted:
            probs = np.array(predicted[0]).reshape(len(rows), -1)
        elif affinity.seen(self.layer):
            probs = np.ones((len(rows), self.next.store.spec.num_experts), np.float32)
        else:
            return None
        # A sigmoid router's softmax is flat: weighed, affinity alone would decide.
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
        """Each row's ``width`` best ``[rows, width]`` with their scores, and the
        distinct ones not resident in ``store``, best first, with theirs."""
        probs = probs / probs.sum(axis=-1, keepdims=True)
        ranked = np.argsort(-probs, axis=-1, kind="stable")[:, : self.width]
        order = rank_order(ranked)
        order = order[~store.resident(order)]
        # A score of 1: the prediction cannot tell this expert from another.
        scale = probs.shape[-1]
        scores = probs.max(axis=0)[order] * scale
        return ranked, np.take_along_axis(probs, ranked, -1) * scale, order, scores


def within_bandwidth(order: np.ndarray, records: int, partial: float, chance) -> np.ndarray:
    """The reads ahead of ``order`` the bandwidth allows: the first ``records``,
    and the next one if its chance of use (``chance(e)``, None: unknown) is at
    least 1 - ``partial`` (docs/prefetch.md, "The bandwidth")."""
    if len(order) <= records or partial <= 0:
        return order[:records]
    p = chance(int(order[records]))
    return order[: records + (p is not None and p >= 1 - partial)]


def scores_calibrated(scorer) -> bool:
    """Whether ``scorer``'s predictions are binned by score: softmax, or affinity alone."""
    return scorer is None or scorer.softmax


def rank_order(ids: np.ndarray) -> np.ndarray:
    """Distinct ids of ``[rows, width]`` predictions, best first: those predicted
    for the most rows first (a verify call reads their union), then by position."""
    order = np.ascontiguousarray(ids.reshape(-1, ids.shape[-1]).T).ravel()
    unique, first, counts = np.unique(order, return_index=True, return_counts=True)
    return unique[np.lexsort((first, -counts))].astype(np.int64)
