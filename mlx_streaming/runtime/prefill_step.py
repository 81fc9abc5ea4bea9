"""How many prompt tokens go through the model at once: mlx-lm's prefill
step, or fewer where the headroom would not hold a step's activations
(docs/design.md, "runtime/prefill_step.py")."""

from typing import Callable, Optional

from ..format import Manifest

# mlx-lm's default prefill step (tokens of a prompt per model call).
PREFILL_STEP = 2048
# Fewer tokens at once would make prefill read the experts too often.
MIN_PREFILL_STEP = 64


def bytes_per_token(config: Optional[dict], manifest: Manifest) -> Callable[[int], int]:
    """``f(step)``: the estimated working bytes per prompt token while
    ``step`` tokens go through a layer; 0 when ``config`` lacks the sizes."""
    config = (config or {}).get("text_config", config) or {}
    hidden = config.get("hidden_size") or 0
    inner = config.get("moe_intermediate_size") or config.get("intermediate_size") or 0
    heads = config.get("num_attention_heads") or 0
    if not hidden:
        return lambda step: 0
    top_k = max(spec.top_k for spec in manifest.layers)
    experts = max(spec.num_experts for spec in manifest.layers)
    # Per (token, expert) pair: gate, up, product, input and output rows, twice.
    fixed = 2 * top_k * (3 * inner + 2 * hidden) + 8 * hidden + 2 * experts
    return lambda step: 4 * (fixed + heads * step)


def prefill_step(room: int, per_token: Callable[[int], int]) -> int:
    """The largest step, halving from mlx-lm's, whose working memory takes at
    most half of ``room``; at least ``MIN_PREFILL_STEP``."""
    step = PREFILL_STEP
    while step > MIN_PREFILL_STEP and step * per_token(step) > room // 2:
        step //= 2
    return step


def room_for(step: int, per_token: Callable[[int], int]) -> int:
    """The headroom a step of ``step`` tokens needs (``prefill_step``'s inverse)."""
    return 2 * step * per_token(step)


def step_of(model) -> int:
    """The prefill step of a streamed model's plan (mlx-lm's for any other model)."""
    plan = getattr(getattr(model, "streaming", None), "plan", None)
    return getattr(plan, "prefill_step", PREFILL_STEP)
