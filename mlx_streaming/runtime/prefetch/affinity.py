"""Which experts of a layer follow which of the layer before it.
"""

import numpy as np


class Affinity:
    """How often each expert of a layer followed each expert of the layer
    before it, counted on this model's routing so far (every paged call).

    The next layer's router applied one layer early misses what this
    layer's experts add to the hidden state; which experts this layer chose
    carries part of that, most for the early layers (docs/prefetch.md).
    Counts start at ``prior`` so that an expert never seen is not ruled
    out.
    """

    def __init__(self, pairs, prior: float = 1.0):
        # pairs: (layer, its experts, next layer, the next layer's experts);
        # the last pair may wrap around, from the last layer to the first.
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
            # Row i of both calls is the same token, except across the wrap:
            # there only one-token calls follow each other (decode).
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
        """``[len(rows), next experts]``: per token, the mean over its
        experts at ``layer`` of the share of their successors that each
        next-layer expert was."""
        counts = self.counts[layer][rows]  # [rows, k, E']
        return (counts / counts.sum(axis=-1, keepdims=True)).mean(axis=1)
