"""bench cache: how close are cache policies to optimal?

Records a routing trace from the model reading real text (teacher-forced,
one token per call, as in decode), then replays each layer's decode calls
through LRU, LFU, pinned-hot + LRU and Belady's optimal MIN at several
capacities. Hits count (token, expert) pairs, as ``stats()`` does. Every
policy starts empty.
"""

from pathlib import Path
from typing import Dict, List

import numpy as np

from ..format import read_manifest
from ..policy import LFU, LRU, Pinned
from . import routing
from .common import decode_calls, figure, finish


def add_arguments(p) -> None:
    p.add_argument("--model", help="stream directory whose routing is recorded")
    p.add_argument("--trace", type=Path, help="replay this trace instead of recording one")
    p.add_argument("--tokens", type=int, default=512, help="tokens of text to record")
    p.add_argument("--capacities", default="0.125,0.25,0.375,0.5,0.75",
                   help="pool sizes as fractions of each layer's experts")
    p.add_argument("--out", type=Path, default=Path("bench-results/cache"))


def simulate(calls: List[np.ndarray], capacity: int, policy, preload=()) -> float:
    """Hit rate of ``policy`` on one layer's calls with ``capacity`` slots,
    the experts of ``preload`` loaded into the first slots beforehand."""
    expert_in = np.full(capacity, -1, dtype=np.int64)
    expert_in[: len(preload)] = preload
    slot_of = {int(e): i for i, e in enumerate(preload)}
    hits = total = 0
    for now, need in enumerate(calls):
        resident = np.array([slot_of[e] for e in need if e in slot_of], dtype=np.int64)
        missing = [int(e) for e in need if e not in slot_of]
        hits += len(resident)
        total += len(need)
        policy.touch(resident)
        if missing:
            victims = policy.victims(len(missing), resident, now, expert_in)
            for e, s in zip(missing, victims):
                slot_of.pop(int(expert_in[s]), None)
                expert_in[s] = e
                slot_of[e] = int(s)
            policy.fill(victims)
    return hits / total if total else 0.0


class Live:
    """A live pool policy (``mlx_streaming.policy``) in the simulator."""

    def __init__(self, policy):
        self.policy = policy

    def touch(self, slots):
        self.policy.touch(slots)

    def fill(self, slots):
        self.policy.fill(slots)

    def victims(self, n, protected, now, expert_in):
        return self.policy.victims(n, protected)


class Belady:
    """Optimal offline (MIN): evict the expert needed again farthest ahead."""

    def __init__(self, calls: List[np.ndarray]):
        self.uses: Dict[int, List[int]] = {}
        for t, need in enumerate(calls):
            for e in need:
                self.uses.setdefault(int(e), []).append(t)

    def touch(self, slots):
        pass

    def fill(self, slots):
        pass

    def _next_use(self, expert: int, now: int) -> float:
        if expert < 0:
            return np.inf  # an empty slot is the best victim
        uses = self.uses[expert]
        i = np.searchsorted(uses, now, side="right")
        return uses[i] if i < len(uses) else np.inf

    def victims(self, n, protected, now, expert_in):
        key = np.array([self._next_use(int(e), now) for e in expert_in], dtype=float)
        key[protected] = -np.inf
        return np.argsort(-key, kind="stable")[:n]


def hot_experts(calls: List[np.ndarray], count: int) -> np.ndarray:
    """The experts most used in the first quarter of the trace (a
    profiling prefix, not an oracle)."""
    prefix = calls[: max(1, len(calls) // 4)]
    counts = np.bincount(np.concatenate(prefix))
    return np.argsort(-counts, kind="stable")[:count]


def replay(calls: List[np.ndarray], capacity: int) -> Dict[str, float]:
    """Hit rate of each policy; pinned-hot pins half the pool."""
    hot = hot_experts(calls, capacity // 2)
    pinned = Pinned(LRU(capacity), np.arange(len(hot)))
    return {
        "lru": simulate(calls, capacity, Live(LRU(capacity))),
        "lfu": simulate(calls, capacity, Live(LFU(capacity))),
        "pinned-hot+lru": simulate(calls, capacity, Live(pinned), preload=hot),
        "belady": simulate(calls, capacity, Belady(calls)),
    }


def run(args) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    stats = None
    if args.trace is None:
        if args.model is None:
            raise SystemExit("bench cache needs --model (to record) or --trace")
        stats = routing.measure(Path(args.model), args.out, tokens=args.tokens)
        trace = args.out / f"routing-trace-w{stats['top_k']}.jsonl"
    else:
        trace = args.trace
    calls = decode_calls(trace)
    num_experts = read_manifest(args.model).layers[0].num_experts if args.model else \
        max(int(np.concatenate(c).max()) for c in calls.values()) + 1
    rows = []
    for frac in [float(c) for c in args.capacities.split(",")]:
        capacity = max(max(len(c) for c in seq) for seq in calls.values())
        capacity = max(capacity, round(frac * num_experts))
        per_layer = [replay(seq, capacity) for seq in calls.values()]
        row = dict(capacity=capacity, fraction=capacity / num_experts)
        for policy in per_layer[0]:
            row[policy] = float(np.mean([r[policy] for r in per_layer]))
        row["lru_gap"] = row["belady"] - row["lru"]
        rows.append(row)
    columns = [("capacity", "slots", "d"), ("fraction", "pool", ".0%"), ("lru", "LRU", ".1%"),
               ("lfu", "LFU", ".1%"), ("pinned-hot+lru", "pinned+LRU", ".1%"),
               ("belady", "Belady", ".1%"), ("lru_gap", "MIN-LRU", ".1%")]
    title = "bench cache: hit rate of decode calls by policy and pool size"
    if stats:
        title += "\n" + routing.describe(stats)
    result = dict(rows=rows, routing=stats, trace=str(trace), tokens=args.tokens,
                  num_experts=num_experts)
    return finish(args.out, "cache", result, rows, columns, title, _plot)


def _plot(rows, path, title):
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r["fraction"] for r in rows]
    for policy, style in [("belady", "k-"), ("lru", "o-"), ("lfu", "s-"),
                          ("pinned-hot+lru", "^-")]:
        ax.plot(x, [r[policy] for r in rows], style, label=policy)
    ax.set_xlabel("pool size (fraction of a layer's experts)")
    ax.set_ylabel("hit rate")
    ax.set_title(title.splitlines()[0], fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
