"""Cache-aware routing (opt-in, approximate): among the router's top
``window`` candidates, after its own top ``keep``, a token takes resident
experts first. The top-k-cut and skip-misses baselines use the same mask
(docs/design.md, "runtime/cache_aware.py")."""

from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError
from ..models.discover import (
    Routed,
    RoutingProbe,
    get_module,
    input_dims_of,
    is_router,
    parent_path,
    router_paths,
)
from .rank_routing import NoRoutingCheck, residencies

# Added to a masked logit: exp and sigmoid of it are 0 in float32; fits float16.
PENALTY = 1e4
# The selection bias of DeepSeek-V3-style routers, by the names families give it.
BIASES = ("e_score_correction_bias", "expert_bias")
# Beyond any selection score: the top ``keep`` first, the outside of the window last.
FAR = 1e30
MAX_PENDING_COUNTS = 256
# Logits this near the weakest chosen one are masked too (ties, rounding).
MARGIN = 1.0
# A baseline's filler, this far below the weakest chosen logit: weight e^-60.
FILLER = 60.0


# With fewer experts per token each substitution moves a larger share of a
# token's expert mass: there a softmax router steered by its logits keeps its
# top expert and prefers resident ones by a logit bonus (docs/routing.md).
FEW_EXPERTS = 8
DEFAULT_LOGIT_BONUS = 0.15


def default_keep(top_k: int, mode: str, logits: bool) -> int:
    """The router's own top experts always taken: half (skip-misses, and a
    few-expert softmax router's cache-aware routing: the top one)."""
    if mode == "skip-misses" or (mode == "cache-aware" and logits and top_k < FEW_EXPERTS):
        return 1
    return max(1, top_k // 2)


def default_bonus(top_k: int, mode: str, logits: bool) -> Optional[float]:
    """A few-expert softmax router's logit bonus for resident experts, else
    None (resident experts first)."""
    if mode == "cache-aware" and logits and top_k < FEW_EXPERTS:
        return DEFAULT_LOGIT_BONUS
    return None


def check_keep(specs, config) -> None:
    """Refuse a baseline that keeps every routed expert: exact, yet called approximate."""
    if config.routing not in ("top-k-cut", "skip-misses"):
        return
    for spec in specs:
        keep = config.routing_keep or default_keep(spec.top_k, config.routing, False)
        if keep < spec.top_k:
            continue
        if spec.top_k == 1:
            raise ConfigError(f"routing={config.routing!r}: the model routes each token to "
                              "one expert, always kept, so nothing changes; use routing='exact'")
        raise ConfigError(f"routing_keep={keep} keeps all {spec.top_k} experts the model routes "
                          f"a token to, so routing={config.routing!r} changes nothing: use a "
                          f"routing_keep below {spec.top_k}, or routing='exact'")


def default_window(top_k: int) -> int:
    return 2 * top_k


def group_limited(scores: mx.array, n_group: int, topk_group: int) -> mx.array:
    """``scores`` [..., E] with the groups the router drops at -inf (DeepSeek-V3's
    group-limited selection: a group scores the sum of its two best)."""
    if n_group <= 1:
        return scores
    grouped = mx.unflatten(scores, axis=-1, shape=(n_group, -1))
    group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1, keepdims=True)
    dropped = n_group - topk_group
    idx = mx.argpartition(group_scores, kth=dropped - 1, axis=-2)[..., :dropped, :]
    grouped = mx.put_along_axis(grouped, idx, mx.array(-mx.inf, grouped.dtype), axis=-2)
    return mx.flatten(grouped, -2, -1)


def choose(scores: mx.array, resident: mx.array, top_k: int, keep: int, window: int,
           bonus: Optional[float] = None,
           mode: str = "cache-aware") -> Tuple[mx.array, mx.array, mx.array]:
    """``(chosen, changed, passed)``: the experts each token takes ([..., E]
    bool), whether that differs from the router's top-k ([..., 1]), and the
    router's own (token, expert) pairs passed over. ``scores`` [..., E] in the
    family's order (-inf: not pickable); ``resident`` [E] bool."""
    rank = ranks(scores)
    # Experts of the groups a group-limited router drops are never candidates.
    window = mx.minimum(window, (scores > -mx.inf).sum(axis=-1, keepdims=True))
    own = rank < top_k
    if mode == "top-k-cut":
        chosen = rank < keep
    elif mode == "skip-misses":
        chosen = (rank < keep) | (own & resident)
    else:
        chosen = _preferred(scores, rank, resident, top_k, keep, window, bonus)
    left_out = own & ~chosen
    return chosen, mx.any(left_out, axis=-1, keepdims=True), left_out.sum()


def ranks(scores: mx.array) -> mx.array:
    """Each expert's rank in the family's selection order (0: its first)."""
    return mx.argsort(mx.argsort(-scores, axis=-1), axis=-1).astype(mx.int32)


def batch_free(resident: mx.array, scores: mx.array, keep: int) -> mx.array:
    """``resident`` [E], and in a batched decode call (scores [sequences, 1, E])
    the experts any sequence keeps: the call reads them once for all."""
    if scores.ndim != 3 or scores.shape[0] < 2 or scores.shape[1] != 1:
        return resident
    return resident | mx.any(ranks(scores) < keep, axis=0, keepdims=True)


def bias_boost(chosen: mx.array, changed: mx.array) -> mx.array:
    """Added to a selection bias: the chosen experts far above the rest."""
    return mx.where(chosen & changed, PENALTY, 0.0)


def logit_penalty(logits: mx.array, scores: mx.array, chosen: mx.array, changed: mx.array,
                  resident: mx.array, fill: bool, mask_all: bool) -> mx.array:
    """Added to a router's logits so that its top-k takes the chosen experts
    (masking and ``fill``: docs/design.md, "runtime/cache_aware.py")."""
    logits = logits.astype(mx.float32)
    big = mx.array(PENALTY)
    if fill:
        weakest = mx.min(mx.where(chosen, logits, mx.inf), axis=-1, keepdims=True)
        penalty = mx.where(chosen, 0.0,
                           mx.where(resident, weakest - FILLER - logits, -big))
    else:
        lowest = mx.min(mx.where(chosen, scores, mx.inf), axis=-1, keepdims=True)
        near = mx.ones_like(chosen) if mask_all else scores >= lowest - MARGIN
        penalty = mx.where(~chosen & near, -big, 0.0)
    return mx.where(changed, penalty, 0.0)


def _preferred(scores, rank, resident, top_k, keep, window, bonus):
    """Cache-aware routing's ``top_k`` experts of each token."""
    if bonus is None:
        passed = (rank >= keep) & ~resident
        # Ranked below the window: never chosen. Missing: after every resident one.
        priority = mx.where(rank < window, rank + mx.where(passed, window, 0),
                            2 * window + rank).astype(mx.float32)
    else:
        adjusted = -(scores + mx.where(resident, bonus, 0.0))
        priority = mx.where(rank < keep, -FAR, mx.where(rank < window, adjusted, FAR))
    # Exactly top_k, ties broken by position.
    idx = mx.argpartition(priority, kth=top_k - 1, axis=-1)[..., :top_k]
    return mx.put_along_axis(mx.zeros(priority.shape, mx.bool_), idx, mx.array(True), axis=-1)


def _groups(*modules) -> Tuple[int, int]:
    """``(n_group, topk_group)`` of a router (DeepSeek's or Kimi's names), or (1, 1)."""
    for m in modules:
        if getattr(m, "n_group", None) is not None:
            return int(m.n_group), int(getattr(m, "topk_group", 1))
        args = getattr(m, "args", None)
        if getattr(args, "num_expert_group", None) is not None:
            return int(args.num_expert_group), int(getattr(args, "topk_group", 1))
    return 1, 1


def _activation(owner, *modules) -> str:
    """The router's score function: the family's setting, else sigmoid with a bias."""
    for m in modules:
        for holder, name in ((m, "score_function"), (m, "score_func"),
                             (getattr(m, "args", None), "moe_router_activation_func")):
            value = getattr(holder, name, None)
            if isinstance(value, str):
                return value
    return "sigmoid" if owner is not None else "softmax"


class CacheAwareRouter(nn.Module):
    """Stands in for a MoE layer's router: its output, passed-over ones masked."""

    def __init__(self, gate: nn.Module, owner: Optional[nn.Module], residency,
                 top_k: int, keep: int, window: int, groups: Tuple[int, int],
                 bonus: Optional[float] = None, mode: str = "cache-aware",
                 sigmoid: bool = False, layer: int = 0):
        super().__init__()
        self.gate = gate
        # Plain attributes, not module members (parameters, state).
        state = dict(
            # Holds the selection bias (a name of BIASES), or None.
            owner=owner, sigmoid=sigmoid, layer=layer,
            # The resident set it steers by; the ranks' check of its choices.
            residency=residency, check=NoRoutingCheck(),
            bias_name=next((b for b in BIASES if owner is not None and b in owner), None),
            shape=(top_k, keep, window, groups), bonus=bonus, mode=mode,
            counts=[],  # per call, summed by the runtime after each pass
            passed_over=0, routed=0,
            bias=None,  # the owner's own bias while a masked one stands in
        )
        for key, value in state.items():
            object.__setattr__(self, key, value)

    @property
    def linear(self) -> bool:
        return isinstance(self.gate, (nn.Linear, nn.QuantizedLinear))

    def scores(self, logits: mx.array) -> mx.array:
        """The router's selection scores, in the order its top-k takes them."""
        scores = logits.astype(mx.float32)
        if self.owner is None and self.shape[3][0] <= 1:
            return scores  # softmax and sigmoid keep the logits' order
        scores = mx.sigmoid(scores) if self.sigmoid else mx.softmax(scores, axis=-1)
        if self.owner is not None:
            scores = scores + self.owner[self.bias_name]
        return group_limited(scores, *self.shape[3])

    def __call__(self, x: mx.array) -> mx.array:
        top_k, keep, window, groups = self.shape
        self.restore()
        logits = self.gate(x) if self.linear else x @ self.gate["weight"].T
        scores = self.scores(logits)  # [..., E]
        resident = batch_free(self.residency(x), scores, keep)
        chosen, changed, passed = choose(scores, resident, top_k, keep, window,
                                         bonus=self.bonus, mode=self.mode)
        chosen = self.check(self.layer, chosen)
        self._count(passed)
        self.routed += scores.size // scores.shape[-1] * top_k
        if self.owner is None:
            penalty = logit_penalty(logits, scores, chosen, changed, resident,
                                    fill=self.mode != "cache-aware", mask_all=groups[0] > 1)
            return logits + penalty.astype(logits.dtype)
        # The bias steers the choice, the weights stay the gate's; ``restore`` undoes it.
        object.__setattr__(self, "bias", self.owner[self.bias_name])
        self.owner[self.bias_name] = self.bias + bias_boost(chosen, changed)
        if self.linear:
            return logits
        out = self.gate(x)
        self.restore()
        return out

    @property
    def exact(self) -> bool:
        """Whether every token keeps the router's own top-k."""
        top_k, keep, window, _ = self.shape
        return self.mode == "cache-aware" and (keep >= top_k or window <= top_k)

    def describe(self) -> str:
        top_k, keep, window, _ = self.shape
        if self.mode == "top-k-cut":
            return f"the router's top {keep} of {top_k} only"
        if self.mode == "skip-misses":
            return f"the router's top {top_k} less the missing ones, its top {keep} always"
        taken = "resident experts first" if self.bonus is None else \
            f"resident experts' scores + {self.bonus:g}"
        return f"the router's top {keep} of {top_k} kept, then its top {window} by {taken}"

    def restore(self) -> None:
        """Give the owner its own selection bias back."""
        if self.bias is not None:
            self.owner[self.bias_name] = self.bias
            object.__setattr__(self, "bias", None)

    def _count(self, passed: mx.array) -> None:
        self.counts.append(passed)
        if len(self.counts) > MAX_PENDING_COUNTS:
            # Calls outside a runtime pass (nobody takes the counts): one lazy sum.
            object.__setattr__(self, "counts", [mx.sum(mx.stack(self.counts))])

    def take_counts(self) -> List[mx.array]:
        counts = self.counts
        object.__setattr__(self, "counts", [])
        return counts


def _find_gate(model, spec, inner):
    """``(module holding the router, its name, the router)``: a child of
    the MoE module scoring its experts on its input, or a child of one of
    its children (a gate module around a ``Linear``)."""
    parent = get_module(model, parent_path(spec.module))
    dims = input_dims_of(inner)
    paths = router_paths(model, spec.module, spec.num_experts, dims)
    if len(paths) == 1:
        name = paths[0].rsplit(".", 1)[-1]
        return parent, name, parent[name]
    if paths:
        return None
    for name, child in parent.children().items():
        if not isinstance(child, nn.Module) or child is inner:
            continue
        for inner_name, g in child.children().items():
            if isinstance(g, (nn.Linear, nn.QuantizedLinear)) and \
                    is_router(g, spec.num_experts, dims):
                return child, inner_name, g
    return None


def install_routers(model: nn.Module, stores, blocks: dict, config, tensor_group=None,
                    check=NoRoutingCheck()) -> list:
    """Wrap the router of every paged layer for ``config.routing``; returns the
    wrappers (tensor parallel: steered by what every rank holds)."""
    routers = []
    for store, residency in zip(stores, residencies([s.pool.table for s in stores],
                                                     tensor_group)):
        spec = store.spec
        parent = get_module(model, parent_path(spec.module))
        found = _find_gate(model, spec, blocks[spec.module])
        if found is None:
            raise ConfigError(
                f"routing={config.routing!r}: the router of {spec.module} was not found "
                f"({type(parent).__name__} has no module that scores its experts on its "
                "input, alone); use routing='exact'")
        holder, name, gate = found
        owner = next((m for m in (gate, holder, parent)
                      if any(m.get(b) is not None for b in BIASES)), None)
        linear = isinstance(gate, (nn.Linear, nn.QuantizedLinear))
        if not linear and owner is not gate:
            raise ConfigError(
                f"routing={config.routing!r}: {type(parent).__name__}'s router "
                f"{type(gate).__name__} selects its experts inside, with no logits or "
                "selection bias to steer; use routing='exact'")
        if owner is not None and config.routing != "cache-aware":
            # Its weights are the gate's sigmoid, which a bias cannot zero.
            raise ConfigError(
                f"routing={config.routing!r} needs a softmax router; "
                f"{type(parent).__name__}'s selects with a bias (use cache-aware)")
        top_k = spec.top_k
        groups = _groups(gate, holder, parent)
        activation = _activation(owner, gate, holder, parent)
        if activation not in ("sigmoid", "softmax") and (owner is not None or groups[0] > 1):
            raise ConfigError(
                f"routing={config.routing!r}: {type(parent).__name__}'s router scores with "
                f"{activation!r}, which cache-aware routing does not rank; use routing='exact'")
        # Steered by its logits: a softmax router with no selection bias or groups.
        logits = owner is None and activation == "softmax" and groups[0] == 1
        keep = min(config.routing_keep or default_keep(top_k, config.routing, logits), top_k)
        window = max(config.routing_window or default_window(top_k), top_k)
        bonus = config.routing_bonus
        if bonus is None:
            bonus = default_bonus(top_k, config.routing, logits)
        router = CacheAwareRouter(gate, owner, residency,
                                  top_k, keep, min(window, spec.num_experts), groups,
                                  bonus, config.routing,
                                  activation == "sigmoid", spec.layer)
        setattr(holder, name, router)
        if owner is not None and not _takes_token_biases(parent, spec, router):
            setattr(holder, name, gate)
            raise ConfigError(
                f"routing={config.routing!r}: {type(parent).__name__} reshapes its router's selection "
                "bias, which cache-aware routing steers per token; use routing='exact'")
        object.__setattr__(router, "check", check)  # after the probe: it compares passes only
        routers.append(router)
    return routers


def _takes_token_biases(parent, spec, router) -> bool:
    """Whether the MoE module takes the router's per-token selection bias (a
    family may reshape it to [E]); probed on zeros, True when it cannot tell."""
    name = spec.module.rsplit(".", 1)[-1]
    block = parent[name]
    setattr(parent, name, RoutingProbe())
    dims = input_dims_of(block.inner if hasattr(block, "inner") else block)
    try:
        results = []
        for tokens in (1, 2):
            try:
                parent(mx.zeros((1, tokens, dims)))
                results.append(None)
            except Routed:
                results.append(True)
            except Exception:
                results.append(False)
            router.restore()
    finally:
        setattr(parent, name, block)
        router.take_counts()
        router.routed = 0
    return not (results[0] is True and results[1] is False)
