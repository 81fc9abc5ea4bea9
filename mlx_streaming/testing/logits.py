"""The logits a model gives for a prompt and a few greedy steps after it:
what the exactness tests compare, bit for bit."""

import mlx.core as mx


def logits_trace(model, prompt, steps: int):
    """Prefill logits of ``prompt`` (token ids), then those of ``steps``
    greedy decode steps."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [model(mx.array([prompt]), cache=cache)[:, -1]]
    mx.eval(out[-1])
    for _ in range(steps):
        token = mx.argmax(out[-1], axis=-1, keepdims=True)
        out.append(model(token, cache=cache)[:, -1])
        mx.eval(out[-1])
    return out
