"""The loader's own memory plan (``runtime.memory``) run on a model's
shape and a machine's memory: whether a budget fits, the smallest one that
does, and the longest context whose KV cache fits beside it.
"""

from dataclasses import dataclass, replace
from typing import Optional

from ..config import StreamConfig
from ..errors import BudgetError
from ..runtime.memory import GB, MemoryPlan, plan_memory, reserved_plan
from .machines import Machine
from .shape import ModelShape, kv_cache_bytes

# Contexts are searched up to this many tokens.
MAX_CONTEXT = 1 << 21


@dataclass(frozen=True)
class Fit:
    """A budget's plan, or why it fails, with the numbers that would fit."""

    plan: Optional[MemoryPlan]
    refusal: Optional[str]
    least_budget_gb: Optional[float]  # None: no budget fits this machine
    max_context: int  # 0 when the plan does not fit
    kv_bytes: int

    @property
    def fits(self) -> bool:
        return self.plan is not None


def fit(shape: ModelShape, machine: Machine, budget_gb: float, context: int,
        config: Optional[StreamConfig] = None) -> Fit:
    """The plan the loader would make for ``budget_gb`` on ``machine``,
    with the KV cache of ``context`` tokens kept beside it."""
    config = config or StreamConfig()
    kv = kv_cache_bytes(shape.config, context)
    least = _least_budget(shape, machine, config)
    try:
        plan = _with_kv(shape, machine, budget_gb, kv, config)
    except BudgetError as e:
        return Fit(None, str(e), least, 0, kv)
    return Fit(plan, None, least, _max_context(shape, machine, budget_gb, config), kv)


def _plan(shape: ModelShape, machine: Machine, budget_gb: float,
          config: StreamConfig) -> MemoryPlan:
    return plan_memory(shape.manifest, replace(config, cache_gb=budget_gb), shape.base_bytes,
                       available=lambda: machine.usable_bytes, model_config=shape.config)


def _with_kv(shape, machine, budget_gb, kv: int, config) -> MemoryPlan:
    plan = _plan(shape, machine, budget_gb, config)
    return reserved_plan(plan, shape.manifest, kv, "the KV cache") if kv else plan


def _least_budget(shape, machine, config) -> Optional[float]:
    """The smallest budget (to 0.01 GB) the plan accepts, or None: the
    budgets that fit run from it to what the headroom leaves, so a scan
    down from the machine's memory finds one, then halving finds the edge."""
    usable = machine.usable_bytes / GB
    high = next((usable * i / 64 for i in range(64, 0, -1)
                 if _fits(shape, machine, usable * i / 64, config)), None)
    if high is None:
        return None
    low = 0.0
    while high - low > 0.01:
        mid = (low + high) / 2
        low, high = (low, mid) if _fits(shape, machine, mid, config) else (mid, high)
    return round(high + 0.005, 2)


def _fits(shape, machine, budget_gb, config) -> bool:
    try:
        _plan(shape, machine, budget_gb, config)
        return True
    except BudgetError:
        return False


def _max_context(shape, machine, budget_gb, config) -> int:
    """The longest context (to a power of two's precision, then halved
    steps) whose KV cache the plan keeps beside ``budget_gb``."""
    def ok(n: int) -> bool:
        try:
            _with_kv(shape, machine, budget_gb, kv_cache_bytes(shape.config, n), config)
            return True
        except BudgetError:
            return False

    if ok(MAX_CONTEXT):
        return MAX_CONTEXT
    low, high = 0, MAX_CONTEXT
    while high - low > 256:
        mid = (low + high) // 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


def whole_budget_fit(shape: ModelShape, machine: Machine, total_gb: float, context: int,
                     headroom_gb: float) -> Fit:
    """The plan of a runtime whose budget counts everything it wires (boyle's
    and oMLX's: the spine, the slots, the KV cache of ``context`` tokens and
    ``headroom_gb`` for activations): this runtime's budget is what that
    leaves for the model, the KV cache kept beside it."""
    kv = kv_cache_bytes(shape.config, context)
    return fit(shape, machine, total_gb - headroom_gb - kv / GB, context)


def largest_budget(shape: ModelShape, machine: Machine, context: int,
                   config: Optional[StreamConfig] = None) -> Optional[float]:
    """The largest budget (to 0.01 GB) the loader plans on ``machine`` with
    the KV cache of ``context`` tokens beside it; None where none does."""
    config = config or StreamConfig()
    kv = kv_cache_bytes(shape.config, context)

    def ok(budget_gb: float) -> bool:
        try:
            _with_kv(shape, machine, budget_gb, kv, config)
            return True
        except BudgetError:
            return False

    # Budgets fit from the least one up to a largest one (below the least
    # the spine does not fit, above the largest the machine's memory).
    least, high = _least_budget(shape, machine, config), machine.usable_bytes / GB
    if least is None or not ok(least):
        return None
    if ok(high):
        return round(high, 2)
    low = least
    while high - low > 0.005:
        mid = (low + high) / 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return round(low, 2) if ok(round(low, 2)) else low
