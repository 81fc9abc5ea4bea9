"""Cache-aware routing: the mask picks only from the router's top window,
keeps its own top experts, prefers resident ones, is exact when it keeps
them all, and runs deterministically on every family whose router it can
steer (the others are refused at load, naming the router)."""

import json
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

import mlx_streaming
from mlx_streaming.errors import ConfigError
from mlx_streaming.models.discover import get_module
from mlx_streaming.runtime import cache_aware
from mlx_streaming.testing.families import FAMILIES
from mlx_streaming.testing.helpers import assert_same_logits, logits_trace


def _softmax_top_k(logits, top_k):
    """qwen3_moe's selection: softmax in the logits' dtype, then the top-k
    by ``argpartition`` (which breaks ties its own way)."""
    gates = mx.softmax(logits, axis=-1, precise=True)
    return np.asarray(mx.argpartition(gates, kth=-top_k, axis=-1)[..., -top_k:])


def _sets(picks):
    return [set(row.tolist()) for row in np.asarray(picks).reshape(-1, picks.shape[-1])]


@pytest.mark.parametrize("bonus", [None, 0.5])
def test_the_family_picks_what_was_chosen_within_the_window(bonus):
    """bf16 logits on a coarse grid (ties), softmax then argpartition."""
    rng = np.random.default_rng(0)
    experts, tokens = 32, 256
    for top_k, keep, window in [(4, 1, 8), (4, 2, 16), (8, 3, 12), (2, 1, 32)]:
        logits = mx.array(np.round(rng.normal(size=(tokens, experts)) * 2) / 2, mx.bfloat16)
        resident = mx.array(rng.random(experts) < 0.3)
        scores = logits.astype(mx.float32)
        chosen, changed, passed = cache_aware.choose(scores, resident, top_k, keep, window, bonus)
        penalty = cache_aware.logit_penalty(logits, scores, chosen, changed, resident,
                                        fill=False, mask_all=False)
        picks = _sets(_softmax_top_k(logits + penalty.astype(logits.dtype), top_k))
        ranked = -np.sort(-np.asarray(scores), axis=-1)
        own = _sets(_softmax_top_k(logits, top_k))
        for t, (row, want) in enumerate(zip(np.asarray(scores), np.asarray(chosen))):
            if np.asarray(changed)[t, 0]:
                assert picks[t] == set(np.nonzero(want)[0].tolist())
            else:  # untouched: the router's own pick, bit for bit
                assert picks[t] == own[t] and not np.asarray(penalty)[t].any()
            assert all(row[e] >= ranked[t, window - 1] for e in picks[t])
            assert set(np.nonzero(row > ranked[t, keep - 1])[0].tolist()) <= picks[t]
            if bonus is None:
                # Resident candidates of the window beyond the kept top are
                # chosen before missing ones.
                res, taken = np.asarray(resident), set(np.nonzero(want)[0].tolist())
                missing = [e for e in taken if not res[e] and row[e] < ranked[t, keep - 1]]
                better = [e for e in range(experts) if res[e] and e not in taken
                          and row[e] > ranked[t, window - 1] and row[e] < ranked[t, keep - 1]]
                assert not (missing and better)
        # Passed over: the router's top-k by rank (ties as argsort breaks
        # them) that the family did not pick.
        rank = np.asarray(mx.argsort(mx.argsort(-scores, axis=-1), axis=-1))
        by_rank = [set(np.nonzero(r < top_k)[0].tolist()) for r in rank]
        changed_rows = np.asarray(changed)[:, 0]
        assert int(passed.item()) == sum(len(o - p) for o, p, c in zip(by_rank, picks,
                                                                     changed_rows) if c) > 0


@pytest.mark.parametrize("mode", ["top-k-cut", "skip-misses"])
def test_the_baselines_fill_with_resident_experts_of_negligible_weight(mode):
    rng = np.random.default_rng(1)
    experts, tokens, top_k = 32, 256, 4
    logits = mx.array(np.round(rng.normal(size=(tokens, experts)) * 2) / 2, mx.bfloat16)
    res = rng.random(experts) < 0.4
    resident = mx.array(res)
    scores = logits.astype(mx.float32)
    chosen, changed, _ = cache_aware.choose(scores, resident, top_k, 2 if mode == "top-k-cut" else 1,
                                        top_k, mode=mode)
    penalty = cache_aware.logit_penalty(logits, scores, chosen, changed, resident, fill=True,
                                    mask_all=False)
    steered = logits + penalty.astype(logits.dtype)
    picks = _softmax_top_k(steered, top_k)
    gates = np.asarray(mx.softmax(steered.astype(mx.float32), axis=-1))
    for t in range(tokens):
        if not np.asarray(changed)[t, 0]:
            assert not np.asarray(penalty)[t].any()
            continue
        want = set(np.nonzero(np.asarray(chosen)[t])[0].tolist())
        assert want <= set(picks[t].tolist())
        for e in set(picks[t].tolist()) - want:
            assert res[e], "a filler was a missing expert: it would be read"
            assert gates[t, e] < 1e-20 * gates[t, list(want)].min()


def test_a_boosted_bias_makes_a_grouped_router_pick_what_was_chosen():
    """DeepSeek-V3's own selection (groups, sigmoid, correction bias, dropped
    groups at 0) with negative biases: the chosen experts are picked and
    weighed by the gate's own scores."""
    from mlx_lm.models.deepseek_v3 import group_expert_select

    rng = np.random.default_rng(2)
    experts, tokens, top_k, n_group, topk_group = 16, 128, 4, 4, 2
    logits = mx.array(rng.normal(size=(tokens, experts)).astype(np.float32))
    bias = mx.array(rng.normal(size=experts).astype(np.float32) - 1.0)
    resident = mx.array(rng.random(experts) < 0.5)
    scores = cache_aware.group_limited(mx.sigmoid(logits) + bias, n_group, topk_group)
    chosen, changed, _ = cache_aware.choose(scores, resident, top_k, 1, 8)
    boosted = bias + cache_aware.bias_boost(chosen, changed)
    inds, weights = group_expert_select(logits, boosted, top_k, n_group, topk_group, 1.0, True)
    own, _ = group_expert_select(logits, bias, top_k, n_group, topk_group, 1.0, True)
    assert np.asarray(changed).any()
    for t in range(tokens):
        want = set(np.nonzero(np.asarray(chosen)[t])[0].tolist())
        if np.asarray(changed)[t, 0]:
            assert set(np.asarray(inds[t]).tolist()) == want
        else:  # left alone: the family's own choice, bit for bit
            assert np.array_equal(np.asarray(inds[t]), np.asarray(own[t]))
    sig = np.asarray(mx.sigmoid(logits))
    picked = np.take_along_axis(sig, np.asarray(inds).astype(np.int64), axis=-1)
    assert np.allclose(np.asarray(weights), picked / picked.sum(-1, keepdims=True), atol=1e-6)


def test_nothing_resident_or_everything_resident_changes_nothing():
    scores = mx.array(np.random.default_rng(1).normal(size=(16, 32)).astype(np.float32))
    for resident in (np.zeros(32, bool), np.ones(32, bool)):
        chosen, changed, passed = cache_aware.choose(scores, mx.array(resident), 4, 1, 16)
        assert int(passed.item()) == 0 and not np.asarray(changed).any()


def test_a_batched_call_counts_what_another_sequence_keeps_as_resident():
    """Decode of 3 sequences ``[3, 1, E]``: each takes, among its missing
    candidates, the ones another sequence keeps (read once for all) before
    the rest. One sequence alone, a prefill ``[1, L, E]`` and a family's
    flattened tokens ``[N, E]`` route against the pool alone."""
    experts, top_k, keep, window = 16, 4, 1, 5
    # Sequence 0 keeps expert 5; sequence 1 ranks it 5th, sequence 2 not at all.
    rows = -5.0 - np.arange(3 * experts, dtype=np.float32).reshape(3, experts) / 100
    rows[0, [5, 1, 2, 3]] = [9, 3, 2, 1]
    rows[1, [9, 10, 11, 12, 5, 13]] = [9, 8, 7, 6.5, 6, 5]
    rows[2, [4, 6, 7, 8]] = [9, 8, 7, 6]
    resident = mx.array(np.arange(experts) == 15)
    batch = mx.array(rows[:, None, :])
    free = cache_aware.batch_free(resident, batch, keep)
    assert np.asarray(free).shape == (1, 1, experts)
    assert set(np.nonzero(np.asarray(free)[0, 0])[0].tolist()) == {5, 9, 4, 15}
    # Sequence 1 takes its 5th, free, before its missing 4th.
    chosen, changed, _ = cache_aware.choose(batch, free, top_k, keep, window)
    assert set(np.nonzero(np.asarray(chosen)[1, 0])[0].tolist()) == {9, 10, 11, 5}
    assert np.asarray(changed)[:, 0, 0].tolist() == [False, True, False]
    own, _, _ = cache_aware.choose(batch, resident, top_k, keep, window)
    assert set(np.nonzero(np.asarray(own)[1, 0])[0].tolist()) == {9, 10, 11, 12}
    for alone in (batch[1:2], mx.array(rows[None]), mx.array(rows)):
        assert cache_aware.batch_free(resident, alone, keep) is resident


def test_batched_decode_takes_experts_other_sequences_read(models, monkeypatch):
    """In batch_generate's decode calls some token takes, in place of one
    of its own missing top-k, an expert that is not resident but that
    another sequence keeps."""
    _, stream_dir = models.get("qwen3_moe", True)
    calls, originals = [], (cache_aware.batch_free, cache_aware.choose)

    def batch_free(resident, scores, keep):
        calls.append(dict(resident=np.asarray(resident), scores=np.asarray(scores), keep=keep))
        return originals[0](resident, scores, keep)

    def choose(scores, resident, top_k, *args, **kwargs):
        out = originals[1](scores, resident, top_k, *args, **kwargs)
        calls[-1].update(chosen=np.asarray(out[0]), top_k=top_k)
        return out

    monkeypatch.setattr(cache_aware, "batch_free", batch_free)
    monkeypatch.setattr(cache_aware, "choose", choose)
    prompts = [[1, 7, 42, 300, 5], [18, 99, 260], [3, 77, 150, 11, 480, 23]]
    with mlx_streaming.load(stream_dir, slots_per_layer=4,
                            routing="cache-aware", routing_keep=1) as (model, tokenizer):
        mlx_streaming.batch_generate(model, tokenizer, prompts, max_tokens=8)
    shared = 0
    for c in calls:
        scores = c["scores"].reshape(-1, c["scores"].shape[-1])
        if scores.shape[0] < 2 or c["scores"].ndim < 3 or c["scores"].shape[1] != 1:
            continue  # not a batched decode call
        rank = np.argsort(np.argsort(-scores, axis=-1), axis=-1)
        kept = rank < c["keep"]
        for t, chosen in enumerate(c["chosen"].reshape(scores.shape)):
            others = kept[np.arange(len(kept)) != t].any(axis=0)
            taken = chosen & ~(rank[t] < c["top_k"]) & ~c["resident"] & others
            shared += int(taken.sum())
    assert shared > 0


def _record_routing(model):
    """Per paged layer, the (scores, window, keep) and the ids each call got."""
    calls = {}
    runtime = model.streaming
    original = cache_aware.choose

    def recording(scores, resident, top_k, keep, window, *args, **kwargs):
        calls.setdefault("scores", []).append((scores, keep, window))
        return original(scores, resident, top_k, keep, window, *args, **kwargs)

    class Recorder:
        def __init__(self, residency):
            self.residency = residency

        def __call__(self, inner, x, indices):
            calls.setdefault("ids", []).append(indices)
            return self.residency(inner, x, indices)

    for store in runtime.stores:
        block = get_module(model, store.spec.module)
        block.residency = Recorder(block.residency)
    return calls, recording


# Families whose router cache-aware routing cannot steer, and why.
REFUSED = {
    "gemma4_text": "was not found", "gemma4": "was not found",
    "longcat_flash": "was not found", "longcat_flash_ngram": "was not found",
    "nemotron_h_latent": "was not found",
    "deepseek": "selects its experts inside", "deepseek_v2": "selects its experts inside",
    "Klear": "reshapes its router's selection bias",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_aware_routing_on_every_family(models, family, monkeypatch):
    src, stream_dir = models.get(family, True)
    spec = mlx_streaming.format.read_manifest(stream_dir).layers[0]
    options = dict(slots_per_layer=spec.num_experts // 2, routing="cache-aware",
                   routing_keep=1, routing_window=min(spec.num_experts, 3 * spec.top_k))
    if family in REFUSED:
        with pytest.raises(ConfigError, match=REFUSED[family]):
            mlx_streaming.load(stream_dir, **options)
        return
    with mlx_streaming.load(stream_dir, **options) as (model, _):
        calls, recording = _record_routing(model)
        monkeypatch.setattr(cache_aware, "choose", recording)
        first = logits_trace(model, steps=12)
    # Every expert the family picked was in its router's top window, and
    # the router's own top expert was always kept (scores compared, for
    # routers whose scores tie).
    assert len(calls["scores"]) == len(calls["ids"])
    for (scores, keep, window), ids in zip(calls["scores"], calls["ids"]):
        scores = np.asarray(scores).reshape(-1, scores.shape[-1])
        ids = np.asarray(ids).reshape(-1, ids.shape[-1])
        ranked = -np.sort(-scores, axis=-1)
        picked = np.take_along_axis(scores, ids.astype(np.int64), axis=-1)
        assert (picked >= ranked[:, window - 1:window]).all()
        assert np.isfinite(picked).all()  # never from a group the router dropped
        for row, chosen, best in zip(scores, ids, ranked[:, keep - 1]):
            assert set(np.nonzero(row > best)[0]) <= set(chosen.tolist())
            assert any(row[e] == best for e in chosen)
    report = mlx_streaming.stats(model)["routing"]
    assert report["mode"] == "cache-aware" and report["routed"] > 0
    # The same text twice gives the same logits: deterministic.
    again, _ = mlx_streaming.load(stream_dir, **options)
    assert_same_logits(first, logits_trace(again, steps=12))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "kimi_k3", "olmoe"])
def test_keeping_every_expert_of_the_router_is_exact(models, family, recwarn):
    src, stream_dir = models.get(family, True)
    spec = mlx_streaming.format.read_manifest(stream_dir).layers[0]
    reference, _ = mlx_lm.load(str(src))
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=spec.num_experts // 2,
                                  routing="cache-aware", routing_keep=spec.top_k)
    assert not [w for w in recwarn if "approximate" in str(w.message)]
    assert model.streaming.routers, "the routers were not wrapped"
    assert_same_logits(logits_trace(reference), logits_trace(model))
    assert mlx_streaming.stats(model)["routing"]["substituted"] == 0


def test_cache_aware_routing_reads_less_and_says_so(models, recwarn):
    src, stream_dir = models.get("qwen3_moe", True)
    spec = mlx_streaming.format.read_manifest(stream_dir).layers[0]
    totals = {}
    # Resident experts first (a bonus beyond any logit gap): on this random
    # model's routing the default small bonus seldom turns a miss into a hit.
    for mode, bonus in (("exact", None), ("cache-aware", 100.0)):
        with mlx_streaming.load(stream_dir, slots_per_layer=spec.top_k + 2,
                                routing=mode, routing_bonus=bonus) as (model, _):
            logits_trace(model, steps=24)
            totals[mode] = mlx_streaming.stats(model)
    exact, aware = totals["exact"], totals["cache-aware"]
    assert aware["routing"]["substituted"] > 0
    assert 0 < aware["routing"]["route_agreement"] < 1
    assert aware["total"]["misses"] < exact["total"]["misses"]
    assert exact["routing"] == {"mode": "exact"}
    said = [str(w.message) for w in recwarn if "approximate" in str(w.message)]
    assert len(said) == 1 and "routing='cache-aware'" in said[0]


@pytest.mark.parametrize("mode", ["top-k-cut", "skip-misses"])
def test_the_baselines_read_no_more_than_exact(models, mode):
    """Their fillers are resident: what they read is what they chose."""
    src, stream_dir = models.get("qwen3_moe", True)
    misses = {}
    for routing_mode in ("exact", mode):
        with mlx_streaming.load(stream_dir, slots_per_layer=6, routing=routing_mode) as (model, _):
            logits_trace(model, steps=24)
            report = mlx_streaming.stats(model)
            misses[routing_mode] = report["total"]["misses"]
    assert report["routing"]["substituted"] > 0
    assert misses[mode] < misses["exact"]


@pytest.mark.parametrize("mode", ["cache-aware", "skip-misses"])
def test_a_full_pool_is_exact_with_routing_by_residency(models, mode):
    src, stream_dir = models.get("qwen3_moe", True)
    reference, _ = mlx_lm.load(str(src))
    model, _ = mlx_streaming.load(stream_dir, routing=mode)
    assert not model.streaming.routers
    assert_same_logits(logits_trace(reference), logits_trace(model))


def test_top_k_cut_cuts_a_full_pool_too(models):
    """A static cut takes the router's top routing_keep at any pool size
    (as llama.cpp's --moe-n-expert): with every expert resident it still
    cuts, says so and counts it, as on a paged pool."""
    src, stream_dir = models.get("qwen3_moe", True)
    spec = mlx_streaming.format.read_manifest(stream_dir).layers[0]
    reference, _ = mlx_lm.load(str(src))
    want = logits_trace(reference, steps=4)
    got = {}
    for slots in (spec.num_experts, spec.num_experts // 2):
        with pytest.warns(UserWarning, match="routing='top-k-cut' .* approximate"):
            loaded = mlx_streaming.load(stream_dir, slots_per_layer=slots, routing="top-k-cut")
        with loaded as (model, _):
            assert model.streaming.routers, slots
            got[slots] = logits_trace(model, steps=4)
            report = mlx_streaming.stats(model)["routing"]
        # Every token passes over all but its top routing_keep.
        assert report["approximate"] and report["routed"] > 0, slots
        assert report["route_agreement"] == (spec.top_k // 2) / spec.top_k, slots
    full = got[spec.num_experts]
    assert not mx.allclose(want[0], full[0], atol=1e-3).item()
    # The same experts weigh as on a paged pool: only the fillers differ.
    for a, b in zip(full, got[spec.num_experts // 2]):
        assert mx.allclose(a, b, atol=1e-3).item()


def test_routing_options_are_checked():
    for bad in (dict(routing="fast"), dict(routing_keep=0), dict(routing_window=0),
                dict(routing_bonus=-1.0)):
        with pytest.raises(ConfigError):
            mlx_streaming.StreamConfig(**bad)
    # A setting the routing does not use is refused, not ignored.
    for name, value in (("routing_keep", 2), ("routing_window", 8), ("routing_bonus", 0.5)):
        for routing_mode in (None, "exact"):
            options = {name: value} if routing_mode is None else \
                {name: value, "routing": routing_mode}
            with pytest.raises(ConfigError, match=f"{name} is a setting of approximate "
                                                  "routing: set routing"):
                mlx_streaming.StreamConfig(**options)
    for name, value in (("routing_window", 8), ("routing_bonus", 0.5)):
        for routing_mode in ("top-k-cut", "skip-misses"):
            with pytest.raises(ConfigError, match=f"{name} is a setting of cache-aware"):
                mlx_streaming.StreamConfig(routing=routing_mode, **{name: value})
    mlx_streaming.StreamConfig(routing="top-k-cut", routing_keep=1)
    mlx_streaming.StreamConfig(routing="cache-aware", routing_keep=1, routing_window=8,
                               routing_bonus=0.5)


@pytest.mark.parametrize("mode", ["top-k-cut", "skip-misses"])
def test_a_baseline_that_keeps_every_routed_expert_is_refused(models, mode):
    """Keeping the router's whole top-k is exact: refused at load, naming
    the model's top-k, rather than run and reported approximate."""
    _, stream_dir = models.get("qwen3_moe", True)
    top_k = mlx_streaming.format.read_manifest(stream_dir).layers[0].top_k
    for keep in (top_k, top_k + 1):
        for slots in (top_k + 2, None):
            with pytest.raises(ConfigError, match=rf"routing_keep={keep} keeps all {top_k} "
                                                  rf".* use a routing_keep below {top_k}"):
                mlx_streaming.load(stream_dir, slots_per_layer=slots, routing=mode,
                                   routing_keep=keep)


def test_generate_says_the_output_is_approximate(models):
    _, stream_dir = models.get("qwen3_moe", True)
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_streaming.generate", "--model", str(stream_dir),
         "--prompt", "def f(x):", "--max-tokens", "8", "--slots-per-layer", "5",
         "--routing", "cache-aware", "--routing-keep", "1"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "the output is approximate" in proc.stderr
    assert "routing: approximate" in proc.stderr and "of the router's choices kept" in proc.stderr


def test_batches_and_drafts_run_with_cache_aware_routing(models):
    """Batched and verify calls route several tokens against one resident
    set: they run, deterministically, and count their substitutions."""
    src, stream_dir = models.get("qwen3_moe", True)
    prompts = [[1, 7, 42, 300, 5], [18, 99, 260], [3, 77, 150, 11, 480, 23]]
    texts = []
    for _ in range(2):
        with mlx_streaming.load(stream_dir, slots_per_layer=6,
                                routing="cache-aware", routing_keep=1) as (model, tokenizer):
            texts.append(mlx_streaming.batch_generate(model, tokenizer, prompts,
                                                      max_tokens=12).texts)
            assert mlx_streaming.stats(model)["routing"]["substituted"] > 0
    assert texts[0] == texts[1]
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_streaming.generate", "--model", str(stream_dir),
         "--prompt", "def f(x): return f(x) + f(x) + f(x)", "--max-tokens", "16",
         "--slots-per-layer", "6", "--routing", "cache-aware", "--draft", "ngram"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "routing: approximate" in proc.stderr


def test_generate_and_the_server_refuse_routing_settings_that_change_nothing(models):
    """Both build their config from the same flags and load the same way:
    a routing setting without its routing, and a cut that keeps the whole
    top-k, are one-line errors before anything runs."""
    from mlx_streaming.testing.helpers import assert_one_line_error, free_port

    _, stream_dir = models.get("qwen3_moe", True)
    top_k = mlx_streaming.format.read_manifest(stream_dir).layers[0].top_k
    cases = [(["--routing-keep", "2"], "routing_keep is a setting of approximate routing"),
             (["--routing", "exact", "--routing-keep", "2"], "routing_keep is a setting of"),
             (["--routing", "top-k-cut", "--routing-window", "8"],
              "routing_window is a setting of cache-aware routing"),
             (["--routing", "top-k-cut", "--routing-keep", str(top_k)],
              f"use a routing_keep below {top_k}")]
    for flags, message in cases:
        for command in (["mlx_streaming.generate", "--prompt", "x", "--max-tokens", "2"],
                        ["mlx_streaming.server", "--port", str(free_port())]):
            proc = subprocess.run([sys.executable, "-m", *command, "--model", str(stream_dir),
                                   *flags], capture_output=True, text=True, timeout=300)
            assert_one_line_error(proc, message)


def test_a_quality_budget_chooses_the_settings_and_caches_them(models, tmp_path):
    from mlx_streaming.config import StreamConfig, percent

    _, stream_dir = models.get("qwen3_moe", True)
    options = dict(slots_per_layer=6, routing_max_ppl=0.05, disk_cache_dir=str(tmp_path))
    said = []
    for _ in range(2):
        with pytest.warns(UserWarning) as caught:
            loaded = mlx_streaming.load(stream_dir, **options)
        said.append(next(str(w.message) for w in caught if "routing_max_ppl" in str(w.message)))
        with loaded as (model, _):
            top_k, keep, window, _ = model.streaming.routers[0].shape
            assert model.streaming.config.routing == "cache-aware"
            assert f"routing_keep={keep}, routing_window={window}" in said[-1]
    assert "measured on 256 tokens" in said[0] and "cached in" in said[1], said
    (cached,) = (tmp_path / "routing-budget").glob("*-s6-p0.05-v*.json")
    choice = json.loads(cached.read_text())
    assert choice["ppl_change"] <= 0.05 and (choice["keep"] < top_k or choice["ppl_change"] == 0)
    assert percent("1%") == 0.01 and percent("0.02") == 0.02
    for bad in (dict(routing_keep=2), dict(routing_bonus=0.5), dict(routing="top-k-cut")):
        with pytest.raises(ConfigError, match="routing_max_ppl"):
            StreamConfig(routing_max_ppl=0.01, **bad)
