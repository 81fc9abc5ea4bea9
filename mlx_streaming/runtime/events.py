"""What the stores and blocks announce (a lookup, a read, a host sync, a
routing decision), and the observers that hear it, outside the arithmetic."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

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
        """Prefetch's prediction of ``layer``'s routing, ``distance`` MoE layers ahead:
        ``ids`` [tokens, width], their ``scores``; ``softmax`` False: a sigmoid router."""
    def on_prefetch(self, layer: int, issued: int = 0, useful: int = 0, wasted: int = 0) -> None: ...
    def on_low_bits(self, layer: int, pairs: int) -> None:
        """``pairs`` missed (token, expert) pairs computed from low-bit copies."""
    def on_graph_calls(self, layer: int, calls: int, tokens: int, hits: int, misses: int,
                       distinct: int, records: int, nbytes: int, read_seconds: float,
                       stall_seconds: float) -> None:
        """Paged calls made inside the graph (store.NativeStore), summed per forward pass."""

    def on_paged_call(self, layer: int, tokens: int, ids: np.ndarray, experts: np.ndarray,
                      hits: int, probs: Optional[np.ndarray] = None) -> None:
        """A paged call after its sync: one event for the hot path (default: four finer)."""
        self.on_sync(layer)
        self.on_call(layer, tokens)
        self.on_route(layer, ids, experts, probs)
        self.on_lookup(layer, hits, ids.size - hits)


class Events:
    """Announces each event to every observer, in order."""

    def __init__(self, observers: Sequence[Observer]):
        self.observers = tuple(observers)

    def add(self, observer: Observer) -> None:
        """Announce to ``observer`` too, from the next event on."""
        self.observers = self.observers + (observer,)

    def on_call(self, layer, tokens):
        for o in self.observers:
            o.on_call(layer, tokens)

    def on_lookup(self, layer, hits, misses):
        for o in self.observers:
            o.on_lookup(layer, hits, misses)

    def on_read(self, layer, records, nbytes, seconds):
        for o in self.observers:
            o.on_read(layer, records, nbytes, seconds)

    def on_stall(self, layer, seconds):
        for o in self.observers:
            o.on_stall(layer, seconds)

    def on_route(self, layer, ids, experts, probs=None):
        for o in self.observers:
            o.on_route(layer, ids, experts, probs)

    def on_predict(self, layer, ids, scores=None, distance=1, softmax=True):
        for o in self.observers:
            o.on_predict(layer, ids, scores, distance, softmax)

    def on_prefetch(self, layer, issued=0, useful=0, wasted=0):
        for o in self.observers:
            o.on_prefetch(layer, issued, useful, wasted)

    def on_low_bits(self, layer, pairs):
        for o in self.observers:
            o.on_low_bits(layer, pairs)

    def on_graph_calls(self, layer, calls, tokens, hits, misses, distinct, records, nbytes,
                       read_seconds, stall_seconds):
        for o in self.observers:
            o.on_graph_calls(layer, calls, tokens, hits, misses, distinct, records, nbytes,
                             read_seconds, stall_seconds)

    def on_paged_call(self, layer, tokens, ids, experts, hits, probs=None):
        for o in self.observers:
            o.on_paged_call(layer, tokens, ids, experts, hits, probs)
