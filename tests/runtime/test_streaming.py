"""Slot pools at work: eviction, chunking, the write-safety rule, budgets,
stats, and mlx-lm's generation APIs on a streaming model."""

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_streaming
from mlx_streaming.config import POLICY_CHOICES
from mlx_streaming.errors import BudgetError
from mlx_streaming.format import read_manifest
from mlx_streaming.io.native import load_extension
from mlx_streaming.runtime.model_spine import spine_bytes
from mlx_streaming.runtime.policy import LRU, make_policy
from mlx_streaming.testing.helpers import (
    PROMPT,
    check_matches_resident,
    count_splits,
    logits_trace,
    pool_bytes,
    record_bytes,
)


@pytest.mark.parametrize("name", POLICY_CHOICES)
def test_policies_never_evict_protected_slots(name):
    held = np.array([10, 11, 12, 13, 14, 15])
    policy = make_policy(name, 16).bind(held)
    for experts in ([10, 11, 12, 13, 14, 15], [10, 11], [12, 13], [10, 11]):
        experts = np.array(experts)
        policy.observe(experts, experts[None], np.full((1, 16), 1 / 16))
    victims = policy.victims(2, protected=np.array([2, 3]))
    assert len(set(victims.tolist())) == 2 and not {2, 3} & set(victims.tolist())
    assert 0 not in policy.victims(5, protected=np.array([0])).tolist()
    held[4] = -1  # an empty slot goes first
    assert 4 in policy.victims(1, protected=np.array([], dtype=np.int64)).tolist()


def test_lru_evicts_the_least_recent():
    held = np.arange(6)
    lru = LRU(6).bind(held)
    lru.observe(np.arange(6), np.arange(6)[None])
    lru.observe(np.array([0, 1]), np.array([[0, 1]]))
    assert sorted(lru.victims(2, protected=np.array([2, 3])).tolist()) == [4, 5]


def test_slots_hold_the_experts_bytes(qwen):
    src, stream_dir = qwen
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=6)
    mx.eval(model(mx.array([PROMPT[:5]])))
    store = model.streaming.stores[0]
    spec = store.spec
    for e in np.nonzero(store.pool.slot_of_expert >= 0)[0]:
        rec = record_bytes(stream_dir, spec, int(e))
        expected = b"".join(rec[s.offset : s.offset + s.nbytes] for s in spec.segments)
        assert pool_bytes(store, int(e)) == expected


def test_full_pool_is_resident_without_syncs(qwen):
    _, stream_dir = qwen
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=1000, prefetch="next-layer")
    logits_trace(model, steps=4)
    s = mlx_streaming.stats(model)
    assert s["residency"] == "resident"
    assert s["prefetch_decision"] == "off: every expert resident"
    assert s["total"]["syncs"] == 0
    assert s["total"]["misses"] == 0 and s["total"]["bytes_read"] == 0


@pytest.mark.parametrize("io", ["python", "native"])
def test_decode_syncs_at_most_once_per_moe_layer(qwen, io):
    # The Python path syncs once per MoE call; the native one (CPU backend)
    # runs decode calls inside the graph and syncs for none (without
    # overlap, which takes a layer whose reads are slow out of the graph).
    if io == "native" and load_extension()[0] is None:
        pytest.skip("the native extension is not built")
    _, stream_dir = qwen
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=4, io=io, overlap=False)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    mlx_streaming.reset_stats(model)
    token = mx.array([[5]])
    for _ in range(10):
        token = mx.argmax(model(token, cache=cache)[:, -1], axis=-1, keepdims=True)
    mx.eval(token)
    s = mlx_streaming.stats(model)
    in_graph = 10 * s["moe_layers"] if io == "native" else 0
    assert s["total"]["syncs"] == 10 * s["moe_layers"] - in_graph
    assert s["total"]["graph_calls"] == in_graph
    assert s["total"]["calls"] == 10 * s["moe_layers"]


def test_prefill_beyond_the_pool_runs_in_chunks(qwen, tmp_path):
    src, stream_dir = qwen
    spec = read_manifest(stream_dir).layers[0]
    trace = tmp_path / "trace.jsonl"
    reference, _ = mlx_lm.load(str(src))
    x = mx.array([PROMPT])
    with mlx_streaming.load(stream_dir, slots_per_layer=spec.top_k, trace=str(trace)) as (model, _):
        assert mx.array_equal(model(x), reference(x)).item()
    from mlx_streaming.runtime.trace import read_trace

    distinct = [len(np.unique(ids)) for _, ids in read_trace(str(trace))]
    assert max(distinct) > spec.top_k, "the prompt should need more experts than slots"
    t = mlx_streaming.stats(model)["total"]
    # Chunks are disjoint and resident experts go first: one read each.
    assert t["records_read"] == sum(distinct)
    assert t["bytes_read"] == t["records_read"] * spec.expert_nbytes


def test_pending_readers_are_finished_before_slots_are_overwritten(qwen):
    """The rule that makes in-place reads safe: a graph built on the pool
    but not yet evaluated still sees the experts it was built with."""
    src, stream_dir = qwen
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=4)
    reference, _ = mlx_lm.load(str(src))
    # One token: its experts fit the pool, so its last layer stays pending
    # (a call with more experts than slots is evaluated chunk by chunk).
    a, b = mx.array([PROMPT[:1]]), mx.array([PROMPT[20:26]])
    lazy_a = model(a)  # built, not evaluated
    out_b = model(b)  # evicts and overwrites slots that lazy_a reads
    mx.eval(out_b)
    assert mlx_streaming.stats(model)["total"]["records_read"] > 0
    assert mx.array_equal(lazy_a, reference(a)).item()
    assert mx.array_equal(out_b, reference(b)).item()


def test_in_place_writes_reach_unevaluated_graphs():
    """Why the rule exists: writing through the numpy view changes what a
    pending computation reads, and mx.array(...) copies (so it would not)."""
    pool = mx.zeros((2, 4), dtype=mx.float32)
    mx.eval(pool)
    view = np.array(pool, copy=False)
    pending = pool * 2
    copied = mx.array(np.array(pool))
    view[1] = 1.0
    assert pending[1].tolist() == [2.0] * 4
    assert copied[1].tolist() == [0.0] * 4


def test_budget_below_one_call_is_refused_with_the_minimum(qwen):
    _, stream_dir = qwen
    spec = read_manifest(stream_dir).layers[0]
    with pytest.raises(BudgetError, match=f"minimum of {spec.top_k}"):
        mlx_streaming.load(stream_dir, slots_per_layer=spec.top_k - 1)
    with pytest.raises(BudgetError, match=r"use --cache-gb \d"):
        mlx_streaming.load(stream_dir, cache_gb=1e-6)


def test_cache_gb_sizes_the_pools(qwen):
    """The budget covers the spine first (it fits here), the pools the rest."""
    _, stream_dir = qwen
    manifest = read_manifest(stream_dir)
    per_slot = sum(spec.expert_nbytes for spec in manifest.layers)
    spine = spine_bytes(stream_dir) + sum(d.nbytes for d in manifest.dense)
    model, _ = mlx_streaming.load(stream_dir, cache_gb=(spine + 7.5 * per_slot) / 1e9)
    s = mlx_streaming.stats(model)
    assert s["slots_per_layer"] == 7
    assert s["pool_bytes"] == 7 * per_slot
    assert s["memory"]["streamed_layers"] == [] and s["spine"] is None


def test_default_budget_comes_from_free_memory(qwen):
    _, stream_dir = qwen
    model, _ = mlx_streaming.load(stream_dir)
    # Free memory dwarfs this model: everything is resident.
    assert mlx_streaming.stats(model)["residency"] == "resident"


def test_stream_generate_and_batch_generate(qwen):
    src, stream_dir = qwen
    reference, tok = mlx_lm.load(str(src))
    model, stok = mlx_streaming.load(stream_dir, slots_per_layer=5)
    prompt = PROMPT[:10]
    ref_tokens = [r.token for r in mlx_lm.stream_generate(reference, tok, prompt, max_tokens=12)]
    got = [r.token for r in mlx_lm.stream_generate(model, stok, prompt, max_tokens=12)]
    assert got == ref_tokens
    prompts = [PROMPT[:6], PROMPT[10:19], PROMPT[3:5]]
    ref = mlx_lm.batch_generate(reference, tok, prompts, max_tokens=8).texts
    out = mlx_lm.batch_generate(model, stok, prompts, max_tokens=8).texts
    assert out == ref


def test_trace_writes_one_line_per_call(qwen, tmp_path):
    _, stream_dir = qwen
    trace = tmp_path / "trace.jsonl"
    with mlx_streaming.load(stream_dir, slots_per_layer=1000, trace=str(trace)) as (model, _):
        logits_trace(model, steps=3)
    from mlx_streaming.runtime.trace import read_trace

    lines = list(read_trace(str(trace)))
    layers = len(model.streaming.stores)
    assert len(lines) == 4 * layers
    assert lines[0][1].shape == (len(PROMPT), 4)
    assert lines[-1][1].shape == (1, 4)


def test_memory_cgroup_limits_are_read(tmp_path):
    from mlx_streaming.system import _cgroup_memory

    proc = tmp_path / "cgroup"
    v1 = tmp_path / "fs" / "memory" / "box"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("2000000000\n")
    (v1 / "memory.usage_in_bytes").write_text("500000000\n")
    proc.write_text("5:devices:/\n4:memory:/box\n0::/\n")
    assert _cgroup_memory(str(proc), str(tmp_path / "fs")) == (2_000_000_000, 500_000_000)
    v2 = tmp_path / "fs2" / "job"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text("1\n")
    proc.write_text("0::/job\n")
    assert _cgroup_memory(str(proc), str(tmp_path / "fs2")) is None
    (v2 / "memory.max").write_text("3000000000\n")
    assert _cgroup_memory(str(proc), str(tmp_path / "fs2")) == (3_000_000_000, 1)


@pytest.mark.parametrize("policy", POLICY_CHOICES)
def test_every_policy_is_exact(qwen, policy):
    # Policies choose slots, never numbers: outputs equal mlx-lm's at a
    # pool small enough that every call evicts.
    src, stream_dir = qwen
    check_matches_resident(src, stream_dir, slots_per_layer=4, policy=policy)


def _synced(io, monkeypatch) -> dict:
    """Load options for a synced call path: ``python`` and ``native`` run
    prefetch's path (the Python store, a sync per call); ``native-synced``
    the native store with its calls synced, as on a GPU (its ensure then
    runs on the overlap's worker)."""
    if io != "python" and load_extension()[0] is None:
        pytest.skip("the native extension is not built")
    if io == "native-synced":
        monkeypatch.setattr("mlx_streaming.runtime.residency.calls_in_graph", lambda: False)
        return dict(io="native", prefetch="off")
    return dict(io=io, prefetch="next-layer")


@pytest.mark.parametrize("io", ["python", "native", "native-synced"])
def test_overlap_computes_resident_experts_while_misses_are_read(qwen, io, monkeypatch):
    # Decode steps with some experts resident and some missing split in
    # two: the resident columns, then (after the worker's reads) the rest.
    # Both paths give mlx-lm's bits; only the overlapped one splits. This
    # model's reads take microseconds, under the bar where overlap pays:
    # it splits only with the bar at 0.
    from mlx_streaming.runtime import block

    src, stream_dir = qwen
    options = _synced(io, monkeypatch)
    split = count_splits(monkeypatch)
    for overlap, bar in [(True, 0.0), (False, 0.0), (True, block.OVERLAP_MIN_READ_S)]:
        monkeypatch.setattr(block, "OVERLAP_MIN_READ_S", bar)
        split.clear()
        model = check_matches_resident(src, stream_dir, slots_per_layer=4, overlap=overlap,
                                       **options)
        if io == "native-synced":
            assert type(model.streaming.stores[0]).__name__ == "NativeStore"
        if bar == 0:  # at the real bar, a read slowed by a busy machine may split a call
            assert bool(split) == overlap
        assert model.streaming._overlap is None or model.streaming._overlap._shutdown


def _calls_of_several_tokens(model, width=2, batch=2, steps=6):
    """Logits of calls of ``width`` tokens (as a verify call's) after the
    prompt, then one-token steps of a batch of ``batch`` sequences (as
    ``batch_generate``'s): every call's tokens need the union of their
    experts."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([PROMPT]), cache=cache)]
    for step in range(steps):
        token = mx.argmax(out[-1][:, -1], axis=-1)
        tokens = mx.concatenate([token, (token + 7 * step + 1) % 256])[None, :width]
        out.append(model(tokens, cache=cache))
        mx.eval(out[-1])
    cache = make_prompt_cache(model)
    prompts = mx.array([PROMPT, PROMPT[::-1]][:batch])
    out.append(model(prompts, cache=cache)[:, -1])
    for _ in range(steps):
        out.append(model(mx.argmax(out[-1], axis=-1, keepdims=True), cache=cache)[:, -1])
        mx.eval(out[-1])
    return out


@pytest.mark.parametrize("io", ["python", "native-synced"])
def test_overlap_splits_calls_of_several_tokens_exactly(qwen, monkeypatch, io):
    # A verify call's or a batch's tokens: the resident (token, expert)
    # pairs compute as rows while the misses are read, then the rest, put
    # back in order: mlx-lm's bits, and only with overlap do calls split.
    from mlx_streaming.runtime import block

    options = _synced(io, monkeypatch)
    src, stream_dir = qwen
    reference = _calls_of_several_tokens(mlx_lm.load(str(src))[0])
    monkeypatch.setattr(block, "OVERLAP_MIN_READ_S", 0.0)
    split = count_splits(monkeypatch)
    for overlap in (True, False):
        split.clear()
        with mlx_streaming.load(stream_dir, slots_per_layer=8, overlap=overlap,
                                **options) as (model, _):
            streamed = _calls_of_several_tokens(model)
            for i, (r, s) in enumerate(zip(reference, streamed)):
                assert mx.array_equal(r, s).item(), f"logits differ at call {i}"
            assert (2 in split) == overlap, split  # calls of two tokens (or sequences) split
            if io == "native-synced":
                assert type(model.streaming.stores[0]).__name__ == "NativeStore"


def test_an_interrupted_overlapped_call_waits_for_its_reads(qwen, monkeypatch):
    # Ctrl-C while the worker reads: the call waits for the reads to end
    # before the interrupt leaves it (they write slots that the next call
    # could hand out again), and later calls stay exact.
    import signal
    import threading
    import time

    from mlx_streaming.runtime import block
    from mlx_streaming.runtime.store import ExpertStore

    monkeypatch.setattr(block, "OVERLAP_MIN_READ_S", 0.0)
    src, stream_dir = qwen
    reference = logits_trace(mlx_lm.load(str(src))[0], steps=8)
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=4, io="python",
                                  prefetch="next-layer")
    finished, armed = threading.Event(), [True]
    ensure = ExpertStore.ensure

    def slow(self, experts, last=True):
        if threading.current_thread() is threading.main_thread() or not armed[0]:
            return ensure(self, experts, last)
        armed[0] = False
        time.sleep(0.2)  # the call's resident experts are computed: it waits for this
        # A real SIGINT to the main thread (interrupt_main would only be
        # seen once the wait ended).
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.3)
        try:
            return ensure(self, experts, last)
        finally:
            finished.set()

    monkeypatch.setattr(ExpertStore, "ensure", slow)
    cache = make_prompt_cache(model)
    out = model(mx.array([PROMPT]), cache=cache)[:, -1]
    assert mx.array_equal(out, reference[0]).item()
    with pytest.raises(KeyboardInterrupt):
        for _ in range(8):
            out = model(mx.argmax(out, axis=-1, keepdims=True), cache=cache)[:, -1]
            mx.eval(out)
    assert finished.is_set()  # the reads ended before the interrupt left the call
    # The interrupted token's cache entries are gone with it: start again.
    cache = make_prompt_cache(model)
    out = model(mx.array([PROMPT]), cache=cache)[:, -1]
    for step in range(1, 9):
        assert mx.array_equal(out, reference[step - 1]).item(), f"logits differ at {step - 1}"
        out = model(mx.argmax(out, axis=-1, keepdims=True), cache=cache)[:, -1]


def test_a_closed_model_with_overlap_is_a_clear_error(qwen, monkeypatch):
    from mlx_streaming.errors import ExpertReadError
    from mlx_streaming.runtime import block

    monkeypatch.setattr(block, "OVERLAP_MIN_READ_S", 0.0)
    _, stream_dir = qwen
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=4, io="python",
                                  prefetch="next-layer")
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    model.streaming.close()
    with pytest.raises(ExpertReadError, match="this model was closed"):
        mx.eval(model(mx.array([[PROMPT[3]]]), cache=cache))


def test_a_with_block_closes_the_model(qwen):
    from mlx_streaming.runtime.runtime import OPEN

    with mlx_streaming.load(qwen[1], slots_per_layer=4) as (model, tokenizer):
        assert tokenizer is not None and model.streaming in OPEN
    assert model.streaming.closed and model.streaming not in OPEN
    model, _, config = loaded = mlx_streaming.load(qwen[1], return_config=True)
    assert len(loaded) == 3 and isinstance(config, dict)
