"""Speculative decoding through streamed models: token-identical to greedy
decoding for n-gram and draft-model drafts (hybrid recurrent models too),
and the sampling rule keeps the target's distribution."""

import itertools
import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import mlx_streaming
from mlx_streaming.decode.mtp import MtpDraft
from mlx_streaming.decode.verify_drafts import (
    ModelDraft,
    NgramDraft,
    SpecStats,
    accept_sampled,
    speculative_generate_step,
)
from mlx_streaming.errors import ConfigError
from mlx_streaming.runtime.stats import stats
from mlx_streaming.testing.helpers import PROMPT

STEPS = 24
FAMILIES = ["qwen3_moe", "deepseek_v3", "qwen3_next", "kimi_k3"]


def greedy_tokens(model, prompt=PROMPT, steps=STEPS):
    gen = generate_step(mx.array(prompt), model, max_tokens=steps,
                        sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(t) for t, _ in gen]


def speculative_tokens(model, draft, k=3, steps=STEPS, spec=None):
    return [t for t, *_ in speculative_generate_step(PROMPT, model, draft, num_draft_tokens=k,
                                                    max_tokens=steps, stats=spec)]


def test_ngram_draft_proposes_what_followed_the_latest_match():
    d = NgramDraft(max_n=2)
    d.start([1, 2, 3, 9, 1, 2, 4, 5, 1, 2])
    assert d.propose(2) == ([4, 5], None)  # "1 2" last seen before "4 5"
    d.commit([4, 5], 1, 7)  # text: ... 1 2 4 7
    assert d.tokens[-3:] == [2, 4, 7]
    assert d.propose(3) == ([], None)  # "4 7" and "7" never seen before
    assert NgramDraft().propose(3) == ([], None)


@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_and_draft_model_are_token_identical_to_greedy(models, family):
    src, stream = models.get(family, quantized=True)
    model, _ = mlx_streaming.load(stream, slots_per_layer=_partial(stream))
    reference, _ = mlx_lm.load(str(src))
    want = greedy_tokens(reference)
    assert greedy_tokens(model) == want
    spec = SpecStats()
    assert speculative_tokens(model, NgramDraft(), k=4, spec=spec) == want
    assert spec.drafted > 0 and spec.accepted < spec.drafted
    if family in ("qwen3_next", "kimi_k3"):
        assert spec.refeeds > 0  # recurrent state restored and fed again
    # A draft model of another family (same vocabulary): mostly rejected.
    other, _ = mlx_lm.load(str(models.get("qwen3_moe", quantized=False)[0]))
    assert speculative_tokens(model, ModelDraft(other), k=3) == want
    # The target itself resident as the draft: mostly accepted.
    spec = SpecStats()
    assert speculative_tokens(model, ModelDraft(reference), k=3, spec=spec) == want
    assert spec.accepted > 0.8 * spec.drafted


def _partial(stream_dir):
    spec = mlx_streaming.format.read_manifest(stream_dir).layers[0]
    return max(spec.top_k, spec.num_experts // 4)


def test_stats_report_drafted_and_accepted(qwen):
    model, _ = mlx_streaming.load(qwen[1], slots_per_layer=8)
    speculative_tokens(model, NgramDraft(), k=3)
    s = stats(model)["speculative"]
    assert s["drafted"] > 0 and s["acceptance_rate"] == s["accepted"] / s["drafted"]
    mlx_streaming.reset_stats(model)
    assert stats(model)["speculative"]["drafted"] == 0
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        speculative_tokens(model, NgramDraft(), k=0)


def _first_token_frequencies(p, q_rows, k, trials, rule, seed=0):
    """How often each token comes first out of a verify call whose drafts
    are sampled from ``q_rows`` (one-hot ngram drafts when None)."""
    rng = np.random.default_rng(seed)
    vocab = p.shape[1]
    counts = np.zeros(vocab)
    fixed = [2, 0, 4][:k]
    for _ in range(trials):
        if q_rows is None:
            drafts, q = fixed, None
        else:
            drafts = [int(rng.choice(vocab, p=q_rows[i])) for i in range(k)]
            q = q_rows
        n, nxt = rule(p, drafts, q, rng)
        counts[drafts[0] if n > 0 else nxt] += 1
    return counts / trials


def _within(freq, p, trials, sigmas=5.0):
    """Each frequency within ``sigmas`` binomial standard deviations of p."""
    bound = sigmas * np.sqrt(p * (1 - p) / trials) + 1e-12
    return bool(np.all(np.abs(freq - p) <= bound))


def _always_accept(p, drafts, q, rng):
    return len(drafts), int(rng.choice(p.shape[1], p=p[-1]))


@pytest.mark.parametrize("draft_kind", ["ngram", "model"])
def test_speculative_sampling_keeps_the_target_distribution(draft_kind):
    rng = np.random.default_rng(1)
    vocab, k, trials = 6, 3, 20_000
    p = rng.dirichlet(np.ones(vocab), size=k + 1)
    q = None if draft_kind == "ngram" else rng.dirichlet(np.ones(vocab), size=k)
    freq = _first_token_frequencies(p, q, k, trials, accept_sampled)
    assert _within(freq, p[0], trials)
    # The check has power: keeping every draft does not pass it.
    wrong = _first_token_frequencies(p, q, k, trials, _always_accept)
    assert not _within(wrong, p[0], trials)


def test_sampled_speculation_runs_on_a_streamed_model(qwen):
    model, _ = mlx_streaming.load(qwen[1], slots_per_layer=8)
    mx.random.seed(0)
    spec = SpecStats()
    out = [t for t, *_ in speculative_generate_step(PROMPT, model, NgramDraft(), temp=0.7,
                                                    max_tokens=16, stats=spec)]
    assert len(out) == 16 and spec.drafted > 0


def test_verify_calls_prefetch_and_chunk_when_the_union_exceeds_the_pool(models):
    src, stream = models.get("qwen3_moe", quantized=True)
    top_k = mlx_streaming.format.read_manifest(stream).layers[0].top_k
    # A pool of one token's experts: a verify call's union never fits at once.
    model, _ = mlx_streaming.load(stream, slots_per_layer=top_k, prefetch="next-layer",
                                  prefetch_records=8)
    reference, _ = mlx_lm.load(str(src))
    want = greedy_tokens(reference)
    spec = SpecStats()
    assert speculative_tokens(model, ModelDraft(reference), k=4, spec=spec) == want
    total = stats(model)["total"]
    assert total["prefetch_issued"] > 0 and spec.accepted > 0
    assert max(layer["experts_per_call"] or 0 for layer in stats(model)["layers"].values()) > top_k


class OracleMtp(MtpDraft):
    """The real MTP layer runs (its cache is kept as for real drafts), but
    the drafts are replaced by greedy decoding's own tokens, every
    ``miss``-th one wrong: acceptance and rejection both happen."""

    def __init__(self, model, truth, miss):
        super().__init__(model)
        self.truth, self.miss, self.text = truth, miss, []
        self.calls = 0

    def start(self, prompt, hidden):
        super().start(prompt, hidden)
        self.text = list(prompt)

    def propose(self, k):
        drafts, q = super().propose(k)
        at = len(self.text) - len(PROMPT)
        right = self.truth[at:at + len(drafts)]
        self.calls += 1
        if self.miss and self.calls % self.miss == 0 and right:
            right[-1] = (right[-1] + 1) % 512
        return right, q

    def commit(self, drafts, n, nxt, hidden):
        super().commit(drafts, n, nxt, hidden)
        self.text += [*drafts[:n], nxt]
        # Every pair of the text is in the MTP cache or pending, none twice.
        assert self.cache.offset + len(self.pairs[0]) == len(self.text) - 1


def test_mtp_drafts_are_token_identical_and_stream_their_experts(models):
    src, stream = models.get("deepseek_v3", quantized=True, num_nextn_predict_layers=1)
    manifest = mlx_streaming.format.read_manifest(stream)
    assert manifest.mtp is not None and len(manifest.mtp.layers) == 1
    mtp_layer = manifest.mtp.layers[0].layer
    reference, _ = mlx_lm.load(str(src))
    want = greedy_tokens(reference)
    model, _ = mlx_streaming.load(stream, slots_per_layer=_partial(stream), mtp=True)
    assert greedy_tokens(model) == want  # the MTP layer changes nothing of the model
    spec = SpecStats()
    assert speculative_tokens(model, MtpDraft(model), k=3, spec=spec) == want
    assert spec.drafted > 0
    assert stats(model)["layers"][mtp_layer]["calls"] > 0  # its experts stream
    for miss in (0, 2):
        spec = SpecStats()
        assert speculative_tokens(model, OracleMtp(model, want, miss), k=3, spec=spec) == want
        assert spec.accepted > 0 and (spec.accepted < spec.drafted) == bool(miss)


def test_models_without_mtp_layers_say_so(models, qwen, capsys):
    from mlx_streaming import generate

    with pytest.raises(ConfigError, match="has no MTP layers"):
        mlx_streaming.load(qwen[1], mtp=True)
    with mlx_streaming.load(qwen[1]) as (model, _):
        with pytest.raises(ConfigError, match="no MTP layers loaded"):
            MtpDraft(model)
    assert generate.main(["--model", str(qwen[1]), "--draft", "mtp", "--max-tokens", "2"]) != 0
    assert "has no MTP layers" in capsys.readouterr().err


def test_generate_drafts_from_the_command_line(models, capsys):
    from mlx_streaming import generate

    _, stream = models.get("deepseek_v3", quantized=True, num_nextn_predict_layers=1)
    for flags in (["--draft", "mtp"], ["--draft", "ngram"]):
        assert generate.main(["--model", str(stream), "--max-tokens", "8",
                              "--num-draft-tokens", "2", *flags]) == 0
        assert "drafts accepted" in capsys.readouterr().err


def test_check_covers_the_mtp_blob_and_spine(models, tmp_path):
    import shutil

    from mlx_streaming.format import damaged_records, damaged_spine

    _, stream = models.get("deepseek_v3", quantized=True, num_nextn_predict_layers=1)
    copy = tmp_path / "s"
    shutil.copytree(stream, copy)
    manifest = mlx_streaming.format.read_manifest(copy)
    spec = manifest.mtp.layers[0]
    assert damaged_records(copy) == [] and damaged_spine(copy, manifest) == []
    blob = copy / "experts" / spec.file
    data = bytearray(blob.read_bytes())
    data[2 * spec.stride + spec.segments[0].offset] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert damaged_records(copy) == [(spec.layer, 2)]
    (copy / "mtp.safetensors").write_bytes(b"x")
    assert damaged_spine(copy, manifest) == ["mtp.safetensors"]



def test_sliding_window_caches_that_fill_during_a_call_stay_exact(models):
    """gpt_oss's sliding-window cache stops being trimmable once full: a
    verify call that fills it is undone from a copy, not a no-op trim."""
    src, stream = models.get("gpt_oss", quantized=True)
    reference, _ = mlx_lm.load(str(src))
    model, _ = mlx_streaming.load(stream, slots_per_layer=_partial(stream))
    for prompt in ([7, 7], PROMPT):
        want = greedy_tokens(reference, prompt=prompt, steps=40)
        for draft in (NgramDraft(), ModelDraft(reference)):
            got = [t for t, *_ in speculative_generate_step(prompt, model, draft,
                                                             num_draft_tokens=3, max_tokens=40)]
            assert got == want


def test_draft_models_are_reusable_and_may_have_a_larger_vocabulary(models):
    src, stream = models.get("qwen3_moe", quantized=True)
    reference, _ = mlx_lm.load(str(src))
    model, _ = mlx_streaming.load(stream, slots_per_layer=8)
    want = greedy_tokens(reference)
    draft = ModelDraft(reference)
    for _ in range(2):  # the same draft object, a second generation
        spec = SpecStats()
        assert speculative_tokens(model, draft, k=3, spec=spec) == want
        assert spec.accepted > 0.8 * spec.drafted
    from mlx_streaming.testing import tiny

    wide = tiny.build_model(tiny.tiny_config("qwen3_moe", 576))  # a vocabulary padded wider
    assert speculative_tokens(model, ModelDraft(wide), k=3) == want
    mx.random.seed(0)
    out = [t for t, *_ in speculative_generate_step(PROMPT, model, ModelDraft(wide, temp=0.8),
                                                     temp=0.8, max_tokens=12)]
    assert len(out) == 12 and max(out) < 512


def test_mtp_layer_takes_a_long_prompt_in_chunks(models):
    from mlx_streaming.decode import verify_drafts
    from mlx_streaming.models import mtp_layers as mtp

    _, stream = models.get("deepseek_v3", quantized=True, num_nextn_predict_layers=1)
    model, _ = mlx_streaming.load(stream, slots_per_layer=8, mtp=True)
    seen = []
    call = mtp.MTPLayer.__call__
    original = mtp.MTPLayer.__call__

    def spy(self, embeds, hidden, cache):
        seen.append(embeds.shape[1])
        return original(self, embeds, hidden, cache)

    mtp.MTPLayer.__call__ = spy
    try:
        prompt = (PROMPT * 30)[:1100]
        steps = speculative_generate_step(prompt, model, MtpDraft(model), max_tokens=4)
        assert len(list(steps)) == 4
    finally:
        mtp.MTPLayer.__call__ = call
    assert max(seen) <= verify_drafts.PREFILL_STEP and sum(seen) >= 1099


def test_families_without_deepseek_style_mtp_convert_without_it(tmp_path, tokenizer_dir):
    from mlx_streaming.conversion.local import convert
    from mlx_streaming.testing import tiny

    config = tiny.tiny_config("kimi_vl", 512)
    config["text_config"] = dict(config["text_config"], num_nextn_predict_layers=1)
    src = tiny.save_mlx_model(tiny.build_model(config), config, tmp_path / "src",
                              tokenizer_dir, quantize=True)
    stream = convert(src, tmp_path / "stream", progress=False)
    assert mlx_streaming.format.read_manifest(stream).mtp is None


def test_a_draft_model_that_does_not_load_is_a_one_line_error(qwen, tmp_path, capsys):
    from mlx_streaming import generate

    rc = generate.main(["--model", str(qwen[1]), "--draft-model", str(tmp_path / "nope"),
                        "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert rc != 0 and "cannot be loaded by mlx-lm" in err and "Traceback" not in err


def _with_bos_tokenizer(stream_dir, out):
    """A copy of ``stream_dir`` whose tokenizer adds a BOS token when it
    encodes, and whose chat template writes the BOS text too (as many real
    models' do)."""
    import shutil

    shutil.copytree(stream_dir, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    bos = "<|endoftext|>"
    bos_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == bos)
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
    (out / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                               "{% endfor %}")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_drafts_from_the_command_line_keep_one_bos(qwen, tmp_path, capsys):
    """With a tokenizer that adds BOS, a prompt whose text already starts
    with it gets no second one, with drafts as without (mlx-lm's rule); the
    drafted text is plain greedy's, prompt by prompt (with a second BOS, 4
    of 5 prompts gave other text)."""
    from mlx_streaming import generate

    stream = _with_bos_tokenizer(qwen[1], tmp_path / "bos")
    for prompt in ("def f(x):", "import os", "class A:", "for i in", "return"):
        for text, template in ((prompt, []), ("<|endoftext|>" + prompt,
                                                ["--ignore-chat-template"])):
            outputs = []
            for flags in ([], ["--draft", "ngram"]):
                assert generate.main(["--model", str(stream), "--prompt", text, "--max-tokens",
                                      "12", "--slots-per-layer", "4", *template, *flags]) == 0
                outputs.append(capsys.readouterr().out)
            assert outputs[0] == outputs[1], text


def test_a_draft_model_with_another_tokenizer_is_warned_about(qwen, tmp_path, capsys):
    """Its drafts would rarely be accepted (the output stays the model's)."""
    from mlx_streaming import generate

    other = _with_bos_tokenizer(qwen[0], tmp_path / "other")
    for draft, warned in ((qwen[0], False), (other, True)):
        assert generate.main(["--model", str(qwen[1]), "--max-tokens", "6", "--slots-per-layer",
                              "4", "--draft-model", str(draft)]) == 0
        assert ("another tokenizer" in capsys.readouterr().err) == warned


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_a_settled_cache_holds_the_prompt_and_the_tokens_yielded(models, family):
    """``settle=True`` (the server keeps caches keyed by prompt + output):
    however many tokens the caller takes, even inside a run of accepted
    drafts, the cache then holds exactly those tokens, as mlx-lm leaves it:
    the next call on it gives mlx-lm's logits."""
    from mlx_lm.models.cache import make_prompt_cache

    src, stream = models.get(family, quantized=True)
    model, _ = mlx_streaming.load(stream, slots_per_layer=_partial(stream))
    reference, _ = mlx_lm.load(str(src))  # the same weights: its drafts are accepted
    prompt = PROMPT
    spec = SpecStats()
    for taken in range(1, 12):
        ours = make_prompt_cache(model)
        steps = speculative_generate_step(prompt, model, ModelDraft(reference), num_draft_tokens=4,
                                          max_tokens=20, prompt_cache=ours, settle=True,
                                          stats=spec)
        out = [t for t, *_ in itertools.islice(steps, taken)]
        steps.close()
        theirs = make_prompt_cache(model)
        gen = generate_step(mx.array(prompt), model, max_tokens=taken, prompt_cache=theirs,
                            sampler=lambda x: mx.argmax(x, axis=-1))
        assert [int(t) for t, _ in gen] == out
        nxt = mx.array([[out[-1]]])
        want, got = model(nxt, cache=theirs)[0, -1], model(nxt, cache=ours)[0, -1]
        assert int(mx.argmax(got)) == int(mx.argmax(want))
        assert np.allclose(np.array(got), np.array(want), atol=1e-3), taken
    assert spec.accepted > spec.calls
