"""Eviction policies of a slot pool: which resident experts give way to the
ones a call needs. ``mlx_streaming bench cache`` replays routing traces
through the same classes, so the live policy and the studied one agree.

A policy sees slots only: ``fill`` when a slot receives a new expert,
``touch`` when a call uses it, ``victims`` when slots must be freed."""

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

    def fill(self, slots: np.ndarray) -> None:
        self.touch(slots)

    def victims(self, n: int, protected: np.ndarray) -> np.ndarray:
        """``n`` slots to overwrite, never one of ``protected``.

        Empty slots (never touched) go first since their age is -1.
        """
        age = self.last_use.copy()
        age[protected] = np.iinfo(np.int64).max
        if n >= len(age):
            return np.argsort(age, kind="stable")[:n]
        return np.argpartition(age, n - 1)[:n]


class LFU:
    """Least frequently used while resident; ties go to the least recent."""

    name = "lfu"

    def __init__(self, slots: int):
        self.count = np.zeros(slots, dtype=np.int64)
        self.recency = LRU(slots)

    def touch(self, slots: np.ndarray) -> None:
        self.count[slots] += 1
        self.recency.touch(slots)

    def fill(self, slots: np.ndarray) -> None:
        self.count[slots] = 1
        self.recency.fill(slots)

    def victims(self, n: int, protected: np.ndarray) -> np.ndarray:
        # Frequency first, recency breaks ties: one combined sort key.
        key = self.count * (self.recency.clock + 2) + self.recency.last_use
        key[protected] = np.iinfo(np.int64).max
        return np.argsort(key, kind="stable")[:n]


class Pinned:
    """Some slots hold experts that never leave (the hot ones, chosen by
    the caller); the others follow ``inner``."""

    def __init__(self, inner, pinned: np.ndarray):
        self.inner = inner
        self.pinned = np.asarray(pinned, dtype=np.int64)
        self.name = f"pinned+{inner.name}"

    def touch(self, slots: np.ndarray) -> None:
        self.inner.touch(slots)

    def fill(self, slots: np.ndarray) -> None:
        self.inner.fill(slots)

    def victims(self, n: int, protected: np.ndarray) -> np.ndarray:
        return self.inner.victims(n, np.concatenate([protected, self.pinned]))
