"""bench cache: how close are cache policies to optimal?

Records a routing trace from the model reading real text (teacher-forced,
one token per call, as in decode), then replays each layer's decode calls
through every live policy (``mlx_streaming.runtime.policy``), a few variants, a
global allocation of slots across layers, a next-call oracle and Belady's
optimal MIN, at several pool sizes. Hits count (token, expert) pairs, as
``stats()`` does. Every policy starts empty.

The lookahead oracles know the next 1, 4 or 16 calls (which experts the
coming tokens need) and are decayed LFU otherwise: they bound what a
perfect short-range prediction could win, and show how much of Belady's
lead comes from knowing the far future, which no online policy has.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from ..flags import MAX_TOKENS, count, existing_file, fractions
from ..format import read_manifest
from ..runtime.policy import ARC, LFU, LRU, LRUK, Adaptive, DecayedLFU, Policy, Predicted, RouterEMA
from ..runtime.trace import read_trace_records
from . import routing
from .report import figure, finish


def add_arguments(p) -> None:
    p.add_argument("--model", help="stream directory whose routing is recorded")
    p.add_argument("--trace", type=existing_file, help="replay this trace instead of recording one")
    p.add_argument("--tokens", type=count(1, MAX_TOKENS), default=512, help="tokens of text to record")
    p.add_argument("--capacities", type=fractions, default="0.125,0.25,0.375,0.5,0.75",
                   help="pool sizes as fractions of each layer's experts")
    p.add_argument("--out", type=Path, default=Path("bench-results/cache"))


@dataclass
class Call:
    """One decode call of one layer, as the live block sees it."""

    experts: np.ndarray  # sorted distinct expert ids
    ids: np.ndarray  # [tokens, k]
    probs: Optional[np.ndarray] = None  # [tokens, num_experts]
    predicted: Optional[np.ndarray] = None  # the previous layer's prediction (distinct ids)
    # Prefetch's predictions as made: [tokens, width] ids best first and
    # their scores, from the layer before (1) and the one before that (2).
    ranked: Optional[np.ndarray] = None
    scores: Optional[np.ndarray] = None
    ranked2: Optional[np.ndarray] = None
    scores2: Optional[np.ndarray] = None
    # The layer's router is a sigmoid one: prefetch reads its predictions
    # without score bins, judging a partly covered record by its rank's
    # chance (loader._calibration).
    sigmoid_router: bool = False


def decode_records(trace: Path) -> Dict[int, List[Call]]:
    """Each layer's decode calls (one token each) of a routing trace."""
    calls: Dict[int, List[Call]] = {}
    for r in read_trace_records(str(trace)):
        if r["ids"].shape[0] != 1:
            continue
        predicted = r.get("predicted")
        calls.setdefault(r["layer"], []).append(Call(
            np.unique(r["ids"]), r["ids"], r.get("probs"),
            None if predicted is None else np.unique(predicted),
            predicted, r.get("predicted_scores"), r.get("predicted2"),
            r.get("predicted2_scores"), bool(r.get("sigmoid_router"))))
    return calls


def _as_calls(calls) -> List[Call]:
    return [c if isinstance(c, Call) else Call(np.unique(c), np.asarray(c)[None]) for c in calls]


def simulate(calls, capacity: int, policy: Policy, preload=()) -> float:
    """Hit rate of ``policy`` on one layer's calls with ``capacity`` slots,
    the experts of ``preload`` loaded into the first slots beforehand."""
    calls = _as_calls(calls)
    misses = replay_misses(calls, capacity, policy, preload)
    total = sum(c.ids.size for c in calls)
    missed = sum(int(np.isin(c.ids, m).sum()) for c, m in zip(calls, misses) if len(m))
    return (total - missed) / total if total else 0.0


def replay_misses(calls, capacity: int, policy: Policy, preload=(),
                  resident: Optional[list] = None) -> List[np.ndarray]:
    """The experts each call missed under ``policy`` with ``capacity``
    slots. The steps are the live store's: hint, observe, evict, fill.
    ``resident``, a list, gets the set of experts resident before each
    call."""
    calls = _as_calls(calls)
    num_experts = 1 + max(int(c.experts.max()) for c in calls)
    num_experts = max(num_experts, getattr(policy, "num_experts", 0))
    expert_of_slot = np.full(capacity, -1, dtype=np.int64)
    expert_of_slot[: len(preload)] = preload
    slot_of = np.full(num_experts, -1, dtype=np.int64)
    slot_of[np.asarray(preload, dtype=np.int64)] = np.arange(len(preload))
    policy.bind(expert_of_slot)
    out = []
    for call in calls:
        if resident is not None:
            resident.append(set(expert_of_slot[expert_of_slot >= 0].tolist()))
        if call.predicted is not None:
            policy.hint(call.predicted)
        policy.observe(call.experts, call.ids, call.probs)
        held = slot_of[call.experts]
        missing = call.experts[held < 0]
        out.append(missing)
        if len(missing):
            victims = policy.victims(len(missing), held[held >= 0])
            old = expert_of_slot[victims]
            slot_of[old[old >= 0]] = -1
            expert_of_slot[victims] = missing
            slot_of[missing] = victims
            policy.filled(missing)
    return out


class Belady(Policy):
    """Optimal offline (MIN): evict the expert needed again farthest ahead."""

    name = "belady"

    def __init__(self, calls, num_experts: int):
        super().__init__(num_experts)
        self.uses: Dict[int, List[int]] = {}
        for t, call in enumerate(_as_calls(calls)):
            for e in call.experts.tolist():
                self.uses.setdefault(e, []).append(t)

    def _next_use(self, expert: int) -> float:
        now = self.clock - 1  # observe() already counted the current call
        uses = self.uses.get(expert, [])
        i = np.searchsorted(uses, now, side="right")
        return uses[i] if i < len(uses) else np.inf

    def keep_score(self):
        return -np.array([self._next_use(e) for e in range(self.num_experts)] + [np.inf])


class Lookahead(DecayedLFU):
    """Decayed LFU that also knows the next ``window`` calls: experts needed
    within them are kept, the soonest-needed first. ``window`` 1 is a
    perfect next-token prediction; an unbounded window is Belady."""

    def __init__(self, calls, num_experts: int, window: int, half_life: float = 32):
        super().__init__(num_experts, half_life)
        self.window = window
        self.belady = Belady(calls, num_experts)
        self.name = f"lookahead{window}"

    def observe(self, experts, ids, probs=None):
        super().observe(experts, ids, probs)
        self.belady.observe(experts, ids, probs)

    def keep_score(self):
        base = super().keep_score()
        soon = -self.belady.keep_score() - (self.clock - 1)  # calls until next use
        near = soon <= self.window
        # Needed within the window: above every other, nearest highest.
        return np.where(near, base[:-1].max() + 1 + self.window - soon, base)


# Oracles that know the next 1, 4 or 16 calls: how much of Belady's lead a
# perfect short-range prediction would win.
LOOKAHEADS = (1, 4, 16)
ORACLES = tuple(f"lookahead{w}" for w in LOOKAHEADS) + ("belady",)


def online_policies(num_experts: int) -> Dict[str, Callable[[], Policy]]:
    """The candidates, each a factory of a fresh policy."""
    candidates = {
        "adaptive": lambda: Adaptive(num_experts),
        "lru": lambda: LRU(num_experts),
        "lfu": lambda: LFU(num_experts),
        "lru-2": lambda: LRUK(num_experts),
        "arc": lambda: ARC(num_experts),
        "predicted+lru": lambda: Predicted(LRU(num_experts)),
    }
    for h in (8, 32, 128):
        candidates[f"lfu-decay{h}"] = lambda h=h: DecayedLFU(num_experts, h)
    for h in (4, 16, 64):
        candidates[f"router-ema{h}"] = lambda h=h: RouterEMA(num_experts, h)
        candidates[f"gate-ema{h}"] = lambda h=h: RouterEMA(num_experts, h, chosen_only=True)
    return candidates


def allocate(curves: List[np.ndarray], total: int, floor: List[int]) -> List[int]:
    """Slots per layer from one budget of ``total``: start each layer at its
    ``floor``, then repeatedly grow the layer whose hit count gains most per
    added slot, looking past flat stretches (LRU's curve is not concave: a
    cycle of n experts gains nothing until n slots). ``curves[l][c]`` is
    layer l's hits with c slots."""
    alloc = list(floor)
    left = total - sum(alloc)
    while left > 0:
        best = None  # (gain per slot, layer, slots to add)
        for layer, c in enumerate(alloc):
            for add in range(1, min(left, len(curves[layer]) - 1 - c) + 1):
                rate = (curves[layer][c + add] - curves[layer][c]) / add
                if best is None or rate > best[0]:
                    best = (rate, layer, add)
        if best is None or best[0] <= 0:
            break
        alloc[best[1]] += best[2]
        left -= best[2]
    return alloc


def global_allocation(calls: Dict[int, List[Call]], capacity: int, num_experts: int,
                      factory: Callable[[], Policy]) -> float:
    """Hit rate when the layers share ``capacity`` x layers slots, split by
    the marginal gains measured on the first quarter of the trace (a
    profiling prefix) with the policy ``factory`` makes."""
    layers = list(calls)
    floor = [max(len(c.experts) for c in calls[layer]) for layer in layers]
    curves = []
    for layer in layers:
        prefix = calls[layer][: max(1, len(calls[layer]) // 4)]
        lookups = sum(c.ids.size for c in prefix)
        curves.append(np.array([0.0] + [
            simulate(prefix, c, factory()) * lookups if c >= floor[len(curves)] else 0.0
            for c in range(1, num_experts + 1)]))
    alloc = allocate(curves, capacity * len(layers), floor)
    hits = total = 0
    for layer, slots in zip(layers, alloc):
        lookups = sum(c.ids.size for c in calls[layer])
        hits += simulate(calls[layer], slots, factory()) * lookups
        total += lookups
    return hits / total


def replay(calls, capacity: int, num_experts: Optional[int] = None) -> Dict[str, float]:
    """Hit rate of each policy on one layer's calls."""
    calls = _as_calls(calls)
    num_experts = num_experts or 1 + max(int(c.experts.max()) for c in calls)
    rates = {name: simulate(calls, capacity, make())
             for name, make in online_policies(num_experts).items()}
    for window in LOOKAHEADS:
        rates[f"lookahead{window}"] = simulate(calls, capacity,
                                               Lookahead(calls, num_experts, window))
    rates["belady"] = simulate(calls, capacity, Belady(calls, num_experts))
    return rates


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
    calls = decode_records(trace)
    num_experts = read_manifest(args.model).layers[0].num_experts if args.model else \
        1 + max(int(c.experts.max()) for seq in calls.values() for c in seq)
    rows = []
    for frac in args.capacities:
        capacity = max(max(len(c.experts) for c in seq) for seq in calls.values())
        capacity = max(capacity, round(frac * num_experts))
        per_layer = [replay(seq, capacity, num_experts) for seq in calls.values()]
        row = dict(capacity=capacity, fraction=capacity / num_experts)
        for policy in per_layer[0]:
            row[policy] = float(np.mean([r[policy] for r in per_layer]))
        online = [p for p in per_layer[0] if p not in ORACLES]
        best = max(online, key=lambda p: row[p])
        row["best"] = best
        row[f"global+{best}"] = global_allocation(
            calls, capacity, num_experts, online_policies(num_experts)[best])
        row["gap_lru"] = row["belady"] - row["lru"]
        row["gap_best"] = row["belady"] - max(row[best], row[f"global+{best}"])
        rows.append(row)
    policies = [k for k in rows[0] if k not in ("capacity", "fraction", "best")
                and not k.startswith(("gap", "global"))]
    columns = [("capacity", "slots", "d"), ("fraction", "pool", ".0%")]
    columns += [(p, p, ".1%") for p in policies]
    columns += [("best", "best online", "s"), ("gap_best", "MIN-best", ".1%"),
                ("gap_lru", "MIN-LRU", ".1%")]
    for row in rows:
        row["global_best"] = row.pop(f"global+{row['best']}")
    columns.insert(-2, ("global_best", "global+best", ".1%"))
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
    for policy, style in [("belady", "k-"), ("lookahead1", "k:"), ("lru", "o-"),
                          ("lfu", "s-"), ("arc", "v-"), ("global_best", "^-")]:
        ax.plot(x, [r[policy] for r in rows], style, label=policy)
    ax.set_xlabel("pool size (fraction of a layer's experts)")
    ax.set_ylabel("hit rate")
    ax.set_title(title.splitlines()[0], fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
