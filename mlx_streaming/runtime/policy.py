"""Eviction policies of a slot pool: which resident experts give way to the
ones a call needs. State is kept by expert id, not slot; ``bench cache``
replays traces through the same classes (docs/design.md, "runtime/policy.py")."""

from collections import OrderedDict
from typing import Optional

import numpy as np


class Policy:
    """Base: a keep-score per expert; the victims are the resident experts
    with the lowest scores (empty slots first, protected slots never)."""

    name = "policy"
    router = False  # wants the router's probabilities in observe()

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.clock = 0
        self.last_use = self._scores(-1.0)
        self.expert_of_slot: Optional[np.ndarray] = None

    def _scores(self, fill: float) -> np.ndarray:
        """Per-expert scores and a last entry, -inf, that empty slots (id -1) index."""
        a = np.full(self.num_experts + 1, fill, dtype=np.float64)
        a[-1] = -np.inf
        return a

    def bind(self, expert_of_slot: np.ndarray) -> "Policy":
        """Read slot contents from this array (the pool updates it in place)."""
        self.expert_of_slot = expert_of_slot
        return self

    def observe(self, experts: np.ndarray, ids: np.ndarray, probs=None) -> None:
        self.clock += 1
        self.last_use[experts] = self.clock

    def filled(self, experts: np.ndarray) -> None:
        pass

    def hint(self, experts: np.ndarray) -> None:
        """Experts predicted for this layer's next call (prefetch's guess)."""

    def keep_score(self) -> np.ndarray:
        """``[num_experts + 1]``: higher is kept longer; the last is -inf (empty slot)."""
        raise NotImplementedError

    def _recency(self) -> np.ndarray:
        # In [0, 1): breaks ties of a coarser score in favour of the recent.
        return (self.last_use + 1) / (self.clock + 2)

    def victims(self, n: int, protected: np.ndarray) -> np.ndarray:
        key = self.keep_score()[self.expert_of_slot]  # a fresh array
        key[protected] = np.inf
        # Stable: ties go to the lowest slot, as in native/paged.cpp.
        return np.argsort(key, kind="stable")[:n]


class LRU(Policy):
    """Least recently used."""

    name = "lru"

    def keep_score(self):
        return self.last_use


class LFU(Policy):
    """Least frequently used while resident (the count restarts when an
    expert is read back in); ties go to the least recent."""

    name = "lfu"

    def __init__(self, num_experts):
        super().__init__(num_experts)
        self.count = self._scores(0.0)

    def observe(self, experts, ids, probs=None):
        super().observe(experts, ids, probs)
        self.count[experts] += 1

    def filled(self, experts):
        self.count[experts] = 1

    def keep_score(self):
        return self.count + self._recency()


def _decay(half_life: float) -> float:
    return 0.5 ** (1.0 / half_life)


class DecayedLFU(Policy):
    """LFU whose counts halve every ``half_life`` calls and survive eviction:
    an expert popular a while ago outranks one used once just now."""

    def __init__(self, num_experts, half_life: float = 32):
        super().__init__(num_experts)
        self.half_life = half_life
        self.decay = _decay(half_life)
        self.score = self._scores(0.0)
        self.name = f"lfu-decay{half_life:g}"

    def observe(self, experts, ids, probs=None):
        super().observe(experts, ids, probs)
        self.score *= self.decay
        self.score[experts] += 1

    def keep_score(self):
        # Decayed counts of different histories practically never tie.
        return self.score


class LRUK(Policy):
    """LRU-K with K=2: evict the expert whose second-to-last use is oldest
    (one-off uses go first), ties to the least recent."""

    name = "lru-2"

    def __init__(self, num_experts):
        super().__init__(num_experts)
        self.previous = self._scores(-1.0)

    def observe(self, experts, ids, probs=None):
        self.previous[experts] = self.last_use[experts]
        super().observe(experts, ids, probs)

    def keep_score(self):
        return self.previous + self._recency()


class RouterEMA(Policy):
    """Decayed sum of the router's probabilities over every expert, chosen or
    not (``chosen_only``: the chosen experts' weights only)."""

    router = True

    def __init__(self, num_experts, half_life: float = 16, chosen_only: bool = False):
        super().__init__(num_experts)
        self.decay = _decay(half_life)
        self.chosen_only = chosen_only
        self.score = self._scores(0.0)
        self.name = f"{'gate' if chosen_only else 'router'}-ema{half_life:g}"

    def observe(self, experts, ids, probs=None):
        super().observe(experts, ids, probs)
        self.score *= self.decay
        if probs is None:  # e.g. a router we could not find: plain decayed counts
            self.score[experts] += 1
        elif self.chosen_only:
            rows = np.arange(len(ids))[:, None]
            np.add.at(self.score, ids, probs[rows, ids])
        else:
            self.score[:-1] += probs.sum(axis=0)

    def keep_score(self):
        return self.score


class ARC(Policy):
    """Adaptive Replacement Cache (Megiddo & Modha, 2003) over expert ids:
    recency and frequency lists, their ghosts, and an adapting target size."""

    name = "arc"

    def __init__(self, num_experts):
        super().__init__(num_experts)
        self.t1, self.t2 = OrderedDict(), OrderedDict()
        self.b1, self.b2 = OrderedDict(), OrderedDict()
        self.p = 0.0

    def observe(self, experts, ids, probs=None):
        super().observe(experts, ids, probs)
        slots = len(self.expert_of_slot)
        for e in experts.tolist():
            if e in self.t1:
                del self.t1[e]
                self.t2[e] = True
            elif e in self.t2:
                self.t2.move_to_end(e)
            elif e in self.b1:
                self.p = min(slots, self.p + max(1.0, len(self.b2) / len(self.b1)))
                del self.b1[e]
                self.t2[e] = True
            elif e in self.b2:
                self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
                del self.b2[e]
                self.t2[e] = True
            else:
                self.t1[e] = True

    def victims(self, n, protected):
        held = self.expert_of_slot
        slot_of = {int(e): s for s, e in enumerate(held.tolist()) if e >= 0}
        keep = set(held[protected].tolist())
        out = [s for s, e in enumerate(held.tolist()) if e < 0][:n]
        while len(out) < n:
            # ARC's REPLACE: take from T1 while it is above its target.
            first = self.t1 if len(self.t1) > max(self.p, 0) else self.t2
            victim = next((e for e in first if e not in keep and e in slot_of), None)
            if victim is None:
                first = self.t2 if first is self.t1 else self.t1
                victim = next((e for e in first if e not in keep and e in slot_of), None)
            if victim is None:  # only protected experts are listed
                rest = [s for s in range(len(held)) if s not in out and held[s] not in keep]
                out.extend(rest[: n - len(out)])
                break
            ghost = self.b1 if first is self.t1 else self.b2
            del first[victim]
            ghost[victim] = True
            keep.add(victim)
            out.append(slot_of[victim])
        for ghost in (self.b1, self.b2):
            while len(ghost) > len(held):
                ghost.popitem(last=False)
        return np.array(out, dtype=np.int64)


class Adaptive(DecayedLFU):
    """Evicts per layer as LRU or decayed LFU, whichever misses less in its
    shadow pool; state as in native/paged.cpp (docs/design.md, "Eviction")."""

    def __init__(self, num_experts, half_life: float = 32, window: float = 16,
                 lru_margin: float = 0.9):
        super().__init__(num_experts, half_life)
        self.regret_decay = _decay(window)
        self.lru_margin = lru_margin
        self.shadow = np.zeros((2, num_experts + 1), dtype=bool)  # rows: LRU, decayed LFU
        self.misses = np.zeros(2)  # each arm's decayed shadow misses
        self.name = "adaptive"

    def observe(self, experts, ids, probs=None):
        super().observe(experts, ids, probs)  # last_use and score first
        slots = len(self.expert_of_slot)
        for arm, key in enumerate((self.last_use, self.score)):
            member = self.shadow[arm]
            missed = experts[~member[experts]]
            member[missed] = True
            over = int(member.sum()) - slots
            if over > 0:
                member[experts] = False  # the call's experts stay
                held = np.flatnonzero(member)
                member[held[np.argsort(key[held], kind="stable")[:over]]] = False
                member[experts] = True
            self.misses[arm] = self.misses[arm] * self.regret_decay + len(missed)

    @property
    def follows_lru(self) -> bool:
        return bool(self.misses[0] < self.lru_margin * self.misses[1])

    def keep_score(self):
        return self.last_use if self.follows_lru else self.score


class Predicted(Policy):
    """Wraps a policy: experts the prefetch prediction named for this layer
    (beyond the ones the call needs) are evicted last."""

    def __init__(self, inner: Policy):
        super().__init__(inner.num_experts)
        self.inner = inner
        self.router = inner.router
        self.predicted = np.zeros(inner.num_experts + 1, dtype=bool)
        self.name = f"predicted+{inner.name}"

    def bind(self, expert_of_slot):
        self.inner.bind(expert_of_slot)
        return super().bind(expert_of_slot)

    def observe(self, experts, ids, probs=None):
        self.inner.observe(experts, ids, probs)

    def filled(self, experts):
        self.inner.filled(experts)

    def hint(self, experts):
        self.predicted[:] = False
        self.predicted[experts] = True

    def keep_score(self):
        score = self.inner.keep_score()
        return score + self.predicted * (np.abs(score[:-1]).max() + 1)


POLICIES = {
    "adaptive": Adaptive,
    "lru": LRU,
    "lfu": LFU,
    "lfu-decay": DecayedLFU,
    "lru-2": LRUK,
    "arc": ARC,
    "router-ema": RouterEMA,
    "gate-ema": lambda n: RouterEMA(n, chosen_only=True),
}


def make_policy(name: str, num_experts: int) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of "
                         f"{', '.join(POLICIES)}")
    return POLICIES[name](num_experts)
