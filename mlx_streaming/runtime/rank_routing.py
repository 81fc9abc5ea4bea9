"""Approximate routing and low-bit copies on tensor-parallel ranks: every
rank must route each token to the same experts and compute each from the
same kind of weights (docs/design.md, "runtime/rank_routing.py")."""

from typing import List, Tuple

import mlx.core as mx
import numpy as np

from ..errors import ConfigError, RankError

# Checks of calls outside a runtime pass (nothing finishes them) folded into one.
MAX_PENDING = 256


class PoolResidency:
    """One machine (or a pipeline stage): the experts in the layer's pool."""

    def __init__(self, table: mx.array):
        self.table = table

    def __call__(self, x: mx.array) -> mx.array:
        return self.table >= 0


class AgreedResidency:
    """Tensor parallel: the experts resident on every rank of ``group``, agreed
    once a pass for every layer: the first layer's call all-reduces every
    layer's pool (a later layer's is as its call of the last pass left it;
    what prefetch loads during a pass counts from the next)."""

    def __init__(self, tables: List[mx.array], group):
        self.tables, self.group = tables, group
        self.ends = np.cumsum([t.size for t in tables]).tolist()
        self.agreed = None

    def layer(self, i: int):
        """The residency the router of the ``i``-th paged layer steers by."""
        start, end = ([0] + self.ends)[i], self.ends[i]

        def resident(x: mx.array) -> mx.array:
            if i == 0 or self.agreed is None:
                held = mx.concatenate([t >= 0 for t in self.tables]).astype(mx.int32)
                held = mx.depends(held, x)  # after x's collectives
                self.agreed = mx.distributed.all_sum(held, group=self.group) == \
                    self.group.size()
            return self.agreed[start:end]

        return resident


class NoRoutingCheck:
    """Routing not compared across ranks (one machine, or the check off)."""

    def __call__(self, layer: int, chosen: mx.array) -> mx.array:
        return chosen

    def finish(self, report: bool = True) -> None:
        pass


class RoutingCheck:
    """Each MoE call's choices gathered from every rank and compared with rank
    0's; ``finish``, at each pass's end, stops every rank at a difference."""

    def __init__(self, group):
        self.group = group
        self.pending: List[Tuple[int, mx.array]] = []

    def __call__(self, layer: int, chosen: mx.array) -> mx.array:
        """``chosen`` ([..., E] bool), made to depend on the comparison."""
        rows = mx.distributed.all_gather(chosen.reshape(1, -1).astype(mx.uint8),
                                         group=self.group)  # [ranks, tokens * E]
        differs = mx.any(rows != rows[:1], axis=-1)  # [ranks]
        self.pending.append((layer, differs))
        if len(self.pending) > MAX_PENDING:
            first = self.pending[0][0]
            self.pending = [(first, mx.any(mx.stack([d for _, d in self.pending]), axis=0))]
        return mx.depends(chosen, differs)

    def finish(self, report: bool = True) -> None:
        """Raise RankError on every rank where one chose other experts than rank
        0 in this pass (``report=False``: the pass failed already; drop them)."""
        pending, self.pending = self.pending, []
        if not report:
            return
        mx.eval([d for _, d in pending])
        for layer, differs in pending:
            ranks = [r for r, d in enumerate(differs.tolist()) if d]
            if ranks:
                raise RankError(
                    f"tensor-parallel rank(s) {', '.join(map(str, ranks))} routed a token of "
                    f"layer {layer} to other experts than rank 0: their summed outputs would "
                    "mix different experts; every rank stops (load every rank with the same "
                    "mlx_streaming, mlx and routing options, or use routing='exact')")


class OwnMisses:
    """One machine (or a pipeline stage): a call's misses are its pool's."""

    def __call__(self, missing: np.ndarray, fits: bool) -> Tuple[np.ndarray, bool]:
        return missing, fits


class AgreedMisses:
    """Tensor parallel: a call's experts missing on any rank, and whether every
    rank's pool holds them (one host all-reduce per call), so ranks choose alike."""

    def __init__(self, group, num_experts: int):
        self.group, self.num_experts = group, num_experts

    def __call__(self, missing: np.ndarray, fits: bool) -> Tuple[np.ndarray, bool]:
        row = np.zeros(self.num_experts + 1, np.int32)
        row[missing] = 1
        row[-1] = not fits
        total = np.array(mx.distributed.all_sum(mx.array(row), group=self.group))
        return np.nonzero(total[:-1])[0], not total[-1]


def misses_of(num_experts: int, tensor_group):
    """Whose misses a layer's low-bit copies are chosen from."""
    return OwnMisses() if tensor_group is None else AgreedMisses(tensor_group, num_experts)


def residencies(tables: List[mx.array], tensor_group) -> list:
    """What each layer's router steers by: its pool, or (tensor parallel) every rank's."""
    if tensor_group is None:
        return [PoolResidency(t) for t in tables]
    agreed = AgreedResidency(tables, tensor_group)
    return [agreed.layer(i) for i in range(len(tables))]


def routing_check(config, tensor_group):
    """The check ``config.routing_check`` asks for; ConfigError on a model not
    sharded tensor parallel."""
    if not config.routing_check:
        return NoRoutingCheck()
    if tensor_group is None:
        raise ConfigError("routing_check compares the routing of tensor-parallel ranks; this "
                          "model is not split tensor parallel: leave it off")
    return RoutingCheck(tensor_group)
