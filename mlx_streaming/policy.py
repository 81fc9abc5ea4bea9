"""Eviction policies of a slot pool: which resident experts give way to the
ones a call needs. ``mlx_streaming.bench cache`` replays routing traces
through the same classes, so the live policy and the studied one agree."""

import numpy as np


class LRU:
    """Least recently used: evict the slots touched longest ago."""

    name = "lru"

    def __init__(self, slots: int):
        self.last_use = np.full(slots, -1, dtype=np.int64)
        self.clock = 0

    def touch(self, slots: np.ndarray) -> None:
        self.clock += 1
        self.last_use[slots] = self.clock

    def victims(self, n: int, protected: np.ndarray) -> np.ndarray:
        """``n`` slots to overwrite, never one of ``protected``.

        Empty slots (never touched) go first since their age is -1.
        """
        age = self.last_use.copy()
        age[protected] = np.iinfo(np.int64).max
        if n >= len(age):
            return np.argsort(age, kind="stable")[:n]
        return np.argpartition(age, n - 1)[:n]
