"""Approximate routing and low-bit miss reads on tensor-parallel ranks.
Each rank holds a slice of every expert and the ranks' outputs are summed,
so every rank must route each token to the same experts, and compute each
from the same kind of weights. A router steers by the experts resident on
every rank (``AgreedResidency``: an all-reduce of the layer's resident set
per call, in the graph), the same input on each rank; ``RoutingCheck``
compares the choices themselves (``StreamConfig.routing_check``). Low-bit
copies are taken by the misses of any rank (``AgreedMisses``).

Every collective here depends on the router's input and the layer's
output on it, so all ranks run them in one order, whatever each rank
evaluates early (a rank that syncs on the host, another that does not).
"""

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
    """Tensor parallel: the experts resident on every rank of ``group``.
    Only they cost no rank a read, and every rank computes the same set
    whatever its own pool holds (its budget, prefetch and policy may differ)."""

    def __init__(self, table: mx.array, group):
        self.table, self.group = table, group

    def __call__(self, x: mx.array) -> mx.array:
        held = mx.depends((self.table >= 0).astype(mx.int32), x)  # after x's collectives
        return mx.distributed.all_sum(held, group=self.group) == self.group.size()


class NoRoutingCheck:
    """Routing not compared across ranks (one machine, or the check off)."""

    def __call__(self, layer: int, chosen: mx.array) -> mx.array:
        return chosen

    def finish(self, report: bool = True) -> None:
        pass


class RoutingCheck:
    """Every MoE call's choices gathered from every rank of ``group`` and
    compared with rank 0's (a collective per layer per pass); ``finish``,
    at the end of each pass, stops every rank at the first difference."""

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
        """Raises RankError (on every rank alike) where a rank chose other
        experts than rank 0 in a call of this pass (``report=False``: the
        pass failed already; its checks are dropped)."""
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
    """Tensor parallel: a call's experts missing on any rank, and whether
    every rank's pool holds the call's experts (one host-side all-reduce
    per call, after the call's ids were synced on every rank). Every rank
    then chooses the same experts to compute from their low-bit copies."""

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


def residency_of(table: mx.array, tensor_group):
    """What a router steers by: its pool alone, or tensor parallel, what
    every rank holds."""
    return PoolResidency(table) if tensor_group is None else AgreedResidency(table, tensor_group)


def routing_check(config, tensor_group):
    """The check ``config.routing_check`` asks for.

    Raises:
        ConfigError: the check asked of a model not split tensor parallel.
    """
    if not config.routing_check:
        return NoRoutingCheck()
    if tensor_group is None:
        raise ConfigError("routing_check compares the routing of tensor-parallel ranks; this "
                          "model is not split tensor parallel: leave it off")
    return RoutingCheck(tensor_group)
