"""Several sequences decoded together (mlx-lm's continuous batching) through
a streamed model: token for token and log-probability for log-probability
what mlx-lm's own batching gives on the resident model, at every pool size,
for a plain MoE, an MLA one and a hybrid recurrent one."""

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import BatchGenerator

import mlx_streaming
from mlx_streaming.testing.helpers import pool_sizes

PROMPTS = [[1, 7, 42, 300, 5], [18, 99, 260, 3, 77, 150, 11], [480, 23],
           [64, 9, 1, 7, 42, 300, 5, 18]]


def batched(model, max_tokens=10):
    """Each prompt's ``[(token, logprobs)]``, decoded as one batch."""
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=4, prefill_batch_size=4)
    uids = gen.insert(PROMPTS, [max_tokens] * len(PROMPTS))
    out = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append((r.token, r.logprobs))
    gen.close()
    return [out[u] for u in uids]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "qwen3_next"])
def test_a_batch_is_mlx_lms_batch_bit_for_bit(models, family):
    src, stream = models.get(family, quantized=True)
    reference = batched(mlx_lm.load(str(src))[0])
    for slots in pool_sizes(stream):
        with mlx_streaming.load(stream, slots_per_layer=slots) as (model, _):
            got = batched(model)
            for want, have in zip(reference, got):
                assert [t for t, _ in want] == [t for t, _ in have], slots
                assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(want, have))
            # One call per MoE layer per step for the whole batch.
            total = mlx_streaming.stats(model)["total"]
            assert total["tokens"] > total["calls"]


def test_batch_generate_takes_text_and_matches_mlx_lm(qwen):
    src, stream = qwen
    reference, tokenizer = mlx_lm.load(str(src))
    texts = ["def f(x):", "import os", "class A:\n    pass"]
    ids = [tokenizer.encode(t) for t in texts]
    want = mlx_lm.batch_generate(reference, tokenizer, ids, max_tokens=8).texts
    model, tok = mlx_streaming.load(stream, slots_per_layer=4)
    assert mlx_streaming.batch_generate(model, tok, texts, max_tokens=8).texts == want
    steps = list(mlx_streaming.stream_generate(model, tok, texts, max_tokens=8))
    assert {i for i, _ in steps} == {0, 1, 2}
    for i, text in enumerate(want):
        tokens = [r.token for j, r in steps if j == i and r.finish_reason != "stop"]
        assert tokenizer.decode(tokens) == text
    # One prompt: mlx-lm's stream_generate, unchanged.
    one = "".join(r.text for r in mlx_streaming.stream_generate(model, tok, texts[0],
                                                               max_tokens=8))
    assert one == mlx_lm.generate(reference, tokenizer, texts[0], max_tokens=8)
    with pytest.raises(mlx_streaming.ConfigError, match="prompts must be a non-empty list"):
        mlx_streaming.batch_generate(model, tok, [])


@pytest.mark.parametrize("prompts, kwargs, message", [
    (["a", None], {}, "a prompt is NoneType"),
    (["a", [1, "x"]], {}, "a prompt is list"),
    (["a"], dict(max_tokens=0), "max_tokens must be an integer of 1 or more"),
    (["a", "b"], dict(max_tokens=[4]), "a list of one per prompt"),
    (["a"], dict(max_tokens=True), "max_tokens must be"),
])
def test_bad_batch_arguments_are_config_errors(qwen, prompts, kwargs, message):
    """As every other bad option of the package: a ConfigError before any
    decoding, not mlx-lm's ValueError or a bare TypeError."""
    with mlx_streaming.load(qwen[1], slots_per_layer=4) as (model, tok):
        with pytest.raises(mlx_streaming.ConfigError, match=message):
            mlx_streaming.batch_generate(model, tok, prompts, **kwargs)
        with pytest.raises(mlx_streaming.ConfigError, match=message):
            list(mlx_streaming.stream_generate(model, tok, prompts, **kwargs))
