"""Cache-aware routing: the mask picks only from the router's top window,
keeps its own top experts, prefers resident ones, is exact when it keeps
them all, and runs deterministically on every family whose router it can
steer (the others are refused at load, naming the router)."""

import subprocess
import sys

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

import mlx_streaming
from mlx_streaming.errors import ConfigError
from mlx_streaming.runtime import routing
from mlx_streaming.testing.families import FAMILIES
from mlx_streaming.models.discover import get_module
from helpers import assert_same_logits, logits_trace


def _family_picks(scores, penalty, top_k):
    """The top-k of a softmax router given the masked scores."""
    masked = np.asarray(scores + penalty)
    return np.argsort(-masked, axis=-1, kind="stable")[..., :top_k]


@pytest.mark.parametrize("bonus", [None, 0.5])
def test_the_mask_picks_from_the_window_keeps_the_top_and_prefers_resident(bonus):
    rng = np.random.default_rng(0)
    experts, tokens = 32, 64
    for top_k, keep, window in [(4, 1, 8), (4, 2, 16), (8, 3, 12), (2, 1, 32)]:
        scores = mx.array(rng.normal(size=(tokens, experts)).astype(np.float32))
        resident_np = rng.random(experts) < 0.3
        penalty, passed = routing.choose(scores, mx.array(resident_np), top_k, keep, window,
                                         mask_all=False, bonus=bonus)
        picks = _family_picks(scores, penalty, top_k)
        rank = np.argsort(np.argsort(-np.asarray(scores), axis=-1), axis=-1)
        picked_rank = np.take_along_axis(rank, picks, axis=-1)
        assert (picked_rank < window).all()
        for t in range(tokens):
            assert set(np.nonzero(rank[t] < keep)[0]) <= set(picks[t].tolist())
            if bonus is None:
                # Every resident candidate of the window beyond the kept top
                # is taken before any missing one.
                candidates = [e for e in np.argsort(rank[t])[keep:window]]
                wanted = [e for e in candidates if resident_np[e]][: top_k - keep]
                assert set(wanted) <= set(picks[t].tolist())
        own = np.argsort(-np.asarray(scores), axis=-1)[:, :top_k]
        left_out = sum(len(set(o.tolist()) - set(p.tolist())) for o, p in zip(own, picks))
        assert int(passed.item()) == left_out
        # A token whose choice is the router's own gets no penalty at all.
        unchanged = np.array([set(o.tolist()) == set(p.tolist()) for o, p in zip(own, picks)])
        assert (np.asarray(penalty)[unchanged] == 0).all()


def test_nothing_resident_or_everything_resident_changes_nothing():
    scores = mx.array(np.random.default_rng(1).normal(size=(16, 32)).astype(np.float32))
    for resident in (np.zeros(32, bool), np.ones(32, bool)):
        penalty, passed = routing.choose(scores, mx.array(resident), 4, 1, 16, mask_all=False)
        assert int(passed.item()) == 0 and not np.asarray(penalty).any()


def _record_routing(model):
    """Per paged layer, the (scores, window, keep) and the ids each call got."""
    calls = {}
    runtime = model.streaming
    original = routing.choose

    def recording(scores, resident, top_k, keep, window, **kwargs):
        calls.setdefault("scores", []).append((scores, keep, window))
        return original(scores, resident, top_k, keep, window, **kwargs)

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


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_aware_routing_on_every_family(models, family, monkeypatch):
    src, stream_dir = models.get(family, True)
    spec = mlx_streaming.format.read_manifest(stream_dir).layers[0]
    options = dict(slots_per_layer=spec.num_experts // 2, routing="cache-aware",
                   routing_keep=1, routing_window=min(spec.num_experts, 3 * spec.top_k))
    try:
        model, tokenizer = mlx_streaming.load(stream_dir, **options)
    except ConfigError as e:
        assert "routing='cache-aware'" in str(e) and "router" in str(e)
        return
    calls, recording = _record_routing(model)
    monkeypatch.setattr(routing, "choose", recording)
    first = logits_trace(model, steps=12)
    model.streaming.close()
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
    again.streaming.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "kimi_k3", "olmoe"])
def test_keeping_every_expert_of_the_router_is_exact(models, family):
    src, stream_dir = models.get(family, True)
    spec = mlx_streaming.format.read_manifest(stream_dir).layers[0]
    reference, _ = mlx_lm.load(str(src))
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=spec.num_experts // 2,
                                  routing="cache-aware", routing_keep=spec.top_k)
    assert model.streaming.routers, "the routers were not wrapped"
    assert_same_logits(logits_trace(reference), logits_trace(model))
    assert mlx_streaming.stats(model)["routing"]["substituted"] == 0
    model.streaming.close()


def test_cache_aware_routing_reads_less_and_says_so(models, recwarn):
    src, stream_dir = models.get("qwen3_moe", True)
    spec = mlx_streaming.format.read_manifest(stream_dir).layers[0]
    totals = {}
    for mode in ("exact", "cache-aware"):
        model, _ = mlx_streaming.load(stream_dir, slots_per_layer=spec.top_k + 2, routing=mode)
        logits_trace(model, steps=24)
        totals[mode] = mlx_streaming.stats(model)
        model.streaming.close()
    exact, aware = totals["exact"], totals["cache-aware"]
    assert aware["routing"]["substituted"] > 0
    assert 0 < aware["routing"]["route_agreement"] < 1
    assert aware["total"]["misses"] < exact["total"]["misses"]
    assert exact["routing"] == {"mode": "exact"}
    said = [str(w.message) for w in recwarn if "approximate" in str(w.message)]
    assert len(said) == 1 and "routing='cache-aware'" in said[0]


def test_a_full_pool_is_exact_whatever_the_routing(models):
    src, stream_dir = models.get("qwen3_moe", True)
    reference, _ = mlx_lm.load(str(src))
    model, _ = mlx_streaming.load(stream_dir, routing="cache-aware")
    assert not model.streaming.routers
    assert_same_logits(logits_trace(reference), logits_trace(model))
    model.streaming.close()


def test_routing_options_are_checked():
    for bad in (dict(routing="fast"), dict(routing_keep=0), dict(routing_window=0),
                dict(routing_bonus=-1.0)):
        with pytest.raises(ConfigError):
            mlx_streaming.StreamConfig(**bad)


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
        model, tokenizer = mlx_streaming.load(stream_dir, slots_per_layer=6,
                                              routing="cache-aware", routing_keep=1)
        texts.append(mlx_streaming.batch_generate(model, tokenizer, prompts,
                                                  max_tokens=12).texts)
        assert mlx_streaming.stats(model)["routing"]["substituted"] > 0
        model.streaming.close()
    assert texts[0] == texts[1]
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_streaming.generate", "--model", str(stream_dir),
         "--prompt", "def f(x): return f(x) + f(x) + f(x)", "--max-tokens", "16",
         "--slots-per-layer", "6", "--routing", "cache-aware", "--draft", "ngram"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "routing: approximate" in proc.stderr
