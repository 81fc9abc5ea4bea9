"""Several prompts decoded together: mlx-lm's continuous batching on a streamed
model, bit for bit mlx-lm's output (docs/design.md, "decode/batch.py")."""

from typing import Generator, List, Sequence, Tuple, Union

import mlx_lm
from mlx_lm.generate import BatchGenerator, BatchResponse

from ..errors import ConfigError
from ..runtime.prefill_step import step_of

Prompt = Union[str, Sequence[int]]


def encode(tokenizer, prompt: Prompt) -> List[int]:
    """A prompt's token ids; text as mlx-lm encodes it (no second BOS when
    the text already starts with one)."""
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        ids = list(tokenizer.encode(prompt, add_special_tokens=bos is None
                                    or not prompt.startswith(bos)))
    else:
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise ConfigError(f"a prompt is {type(prompt).__name__} {prompt!r:.40}: give a "
                              "text or a list of token ids") from None
    if not ids:
        raise ConfigError("a prompt encodes to no tokens: give it some text or token ids")
    return ids


def _prompts(tokenizer, prompts) -> List[List[int]]:
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise ConfigError("prompts must be a non-empty list of texts or of token id lists")
    return [encode(tokenizer, p) for p in prompts]


def _max_tokens(max_tokens, n: int) -> List[int]:
    """``max_tokens`` (one for all, or one per prompt) as a list of ``n``."""
    def ok(m):
        return isinstance(m, int) and not isinstance(m, bool) and m > 0

    if ok(max_tokens):
        return [max_tokens] * n
    if isinstance(max_tokens, Sequence) and len(max_tokens) == n and all(map(ok, max_tokens)):
        return list(max_tokens)
    raise ConfigError(f"max_tokens must be an integer of 1 or more, or a list of one per "
                      f"prompt ({n}); got {max_tokens!r}")


def batch_generate(model, tokenizer, prompts: Sequence[Prompt], *,
                   max_tokens: Union[int, Sequence[int]] = 128, **kwargs) -> BatchResponse:
    """``mlx_lm.batch_generate`` that also takes prompts as text; every
    other argument is mlx-lm's (``max_tokens``, ``sampler``,
    ``completion_batch_size``, ``return_logprobs`` ...)."""
    ids = _prompts(tokenizer, prompts)
    kwargs.setdefault("prefill_step_size", step_of(model))
    return mlx_lm.batch_generate(model, tokenizer, ids,
                                 max_tokens=_max_tokens(max_tokens, len(ids)), **kwargs)


def batch_stream_generate(model, tokenizer, prompts: Sequence[Prompt], *,
                          max_tokens: Union[int, Sequence[int]] = 128, **kwargs
                          ) -> Generator[Tuple[int, object], None, None]:
    """Decode ``prompts`` together and yield ``(index, response)`` as each
    sequence's tokens come: ``response`` is mlx-lm's ``BatchGenerator``
    response (``token``, ``logprobs``, ``finish_reason``) and ``index`` the
    prompt's place in ``prompts``. ``kwargs`` are ``BatchGenerator``'s
    (``sampler``, ``completion_batch_size``, ``prefill_batch_size`` ...)."""
    ids = _prompts(tokenizer, prompts)
    max_tokens = _max_tokens(max_tokens, len(ids))
    kwargs.setdefault("prefill_step_size", step_of(model))
    gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids], **kwargs)
    try:
        index = {uid: i for i, uid in enumerate(gen.insert(ids, list(max_tokens)))}
        while responses := gen.next_generated():
            for r in responses:
                yield index[r.uid], r
    finally:
        gen.close()


def stream_generate(model, tokenizer, prompt, **kwargs):
    """``mlx_lm.stream_generate`` for one prompt (text or token ids); for a
    list of prompts (texts, or lists of token ids), ``batch_stream_generate``."""
    single = isinstance(prompt, str) or (isinstance(prompt, Sequence) and prompt
                                         and isinstance(prompt[0], int))
    if single or not isinstance(prompt, Sequence):
        kwargs.setdefault("prefill_step_size", step_of(model))
        return mlx_lm.stream_generate(model, tokenizer, prompt, **kwargs)
    return batch_stream_generate(model, tokenizer, prompt, **kwargs)
