"""How much memory one sequence's caches take at a given length, measured on
the model itself and scaled by cache kind (docs/design.md, "runtime/kv.py")."""

import mlx.core as mx
from mlx_lm.models.cache import CacheList, make_prompt_cache

# mlx-lm's default prefill step: tokens of a prompt per model call.
PREFILL_CHUNK = 2048


def sequence_bytes(model, tokens: int) -> int:
    """Bytes of one sequence's caches once it holds ``tokens`` tokens."""
    caches = make_prompt_cache(model)
    out = model(mx.array([[0]]), cache=caches)
    mx.eval(out, [c.state for c in caches if not c.empty()])
    return sum(_bytes_at(c, tokens) for c in caches)


def _bytes_at(cache, tokens: int) -> int:
    if isinstance(cache, CacheList):
        return sum(_bytes_at(c, tokens) for c in cache.caches)
    keys = getattr(cache, "keys", None)
    if keys is None or not hasattr(keys, "shape"):
        return cache.nbytes  # a recurrent state: the same at any length
    allocated = keys.shape[-2]  # tokens the first step allocated room for
    window = getattr(cache, "max_size", None)
    # A window holds its size and, while a prompt chunk goes through, that chunk.
    held = tokens if window is None else min(tokens, window + PREFILL_CHUNK)
    step = getattr(cache, "step", 1)  # room grows a step of tokens at a time
    held = -(-held // step) * step
    return int(cache.nbytes / allocated * held)
