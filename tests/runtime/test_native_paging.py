"""The native step of a paged call (native/paged.cpp via store.NativeStore
and block.NativePaged) against its reference, the Python ExpertStore and
Paged: the same distinct experts, hits, policy state, victims, reads and
tables after every call, and the same logits."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_streaming
from mlx_streaming.errors import CorruptExpertError
from mlx_streaming.format import read_manifest
from mlx_streaming.runtime import residency
from mlx_streaming.runtime.block import NativePaged, Paged
from mlx_streaming.runtime.store import NativeStore
from mlx_streaming.testing.helpers import PROMPT, check_matches_resident, count_splits


def _residencies(model):
    return model.streaming.residencies


def _load_reference(monkeypatch, stream_dir, **kwargs):
    with monkeypatch.context() as m:
        m.setattr(residency, "choose_path",
                  lambda runtime: residency.HotPath("python", "the reference, by the test"))
        return mlx_streaming.load(stream_dir, **kwargs)


def _state(model):
    """Everything a call's bookkeeping changes, per layer."""
    out = []
    for store in model.streaming.stores:
        policy = store.policy
        out.append((
            store.pool.expert_of_slot.copy(),
            store.pool.slot_of_expert.copy(),
            policy.last_use.copy(),
            getattr(policy, "score", np.zeros(1)).copy(),
            policy.clock,
            store.unchecked.copy(),
            getattr(policy, "shadow", np.zeros(1)).copy(),
            getattr(policy, "misses", np.zeros(1)).copy(),
        ))
    return out


def _counters(model):
    return {layer: (c.calls, c.hits, c.misses, c.records_read, c.bytes_read, c.distinct_experts)
            for layer, c in model.streaming.stats.counters.items()}


def _assert_same_state(a, b, step, layers=None):
    for layer, (x, y) in enumerate(zip(_state(a)[:layers], _state(b)[:layers])):
        for name, u, v in zip(("slots", "table", "last_use", "score", "clock", "unchecked",
                               "shadow", "misses"), x, y):
            assert np.array_equal(u, v), f"step {step}, layer {layer}: {name} differ"


def test_native_step_is_chosen_where_it_can_run(qwen, tmp_path):
    _, stream_dir = qwen
    with mlx_streaming.load(stream_dir, slots_per_layer=4) as (model, _):
        assert all(type(r) is NativePaged for r in _residencies(model))
        assert all(type(s) is NativeStore for s in model.streaming.stores)
    for kwargs in ({"io": "python"}, {"prefetch": "next-layer"}, {"policy": "arc"},
                   {"trace": str(tmp_path / "t.jsonl")}):
        with mlx_streaming.load(stream_dir, slots_per_layer=4, **kwargs) as (model, _):
            assert all(type(r) is Paged for r in _residencies(model)), kwargs


@pytest.mark.parametrize("policy", ["lru", "lfu-decay", "adaptive"])
@pytest.mark.parametrize("checksums", ["first-read", "always", "off"])
def test_native_step_agrees_with_the_reference_call_for_call(models, monkeypatch, policy,
                                                             checksums):
    # Four slots of eight: the 48-token prefill has more distinct experts
    # than slots (the chunked path) and every decode step evicts.
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    # Without overlap: a slow read on a busy machine could move a layer's
    # calls out of the graph (NativePaged._overlap_pays), which is checked apart.
    kwargs = dict(slots_per_layer=4, policy=policy, checksums=checksums, overlap=False)
    with (mlx_streaming.load(stream_dir, **kwargs) as (native, _),
          _load_reference(monkeypatch, stream_dir, **kwargs) as (reference, _)):
        assert type(_residencies(reference)[0]) is Paged
        caches = [make_prompt_cache(m) for m in (native, reference)]
        tokens = mx.array([PROMPT])
        evictions = 0
        for step in range(24):
            before = _state(native)
            out = [m(tokens, cache=c)[:, -1] for m, c in zip((native, reference), caches)]
            mx.eval(out)
            assert mx.array_equal(out[0], out[1]).item(), f"logits differ at step {step}"
            _assert_same_state(native, reference, step)
            assert _counters(native) == _counters(reference), f"counters differ at step {step}"
            evictions += sum(not np.array_equal(b[0], a[0]) for b, a in zip(before, _state(native)))
            tokens = mx.argmax(out[0], axis=-1, keepdims=True)
        assert evictions > 24, "the pools hardly changed: nothing was compared"
        # Decode calls ran inside the graph (no sync), the prefill synced.
        totals = [c for c in native.streaming.stats.counters.values()]
        assert all(c.graph_calls == 23 and c.syncs == 1 for c in totals)


def test_native_step_follows_the_adaptive_policys_arms_as_the_reference(qwen, monkeypatch):
    """Synthetic routing that favours recency, then frequency, then recency:
    both paths switch arms on the same call and fill the same slots."""
    from mlx_streaming.testing.helpers import frequency_calls, recency_calls

    _, stream_dir = qwen
    kwargs = dict(slots_per_layer=4, policy="adaptive", checksums="off")
    with (mlx_streaming.load(stream_dir, **kwargs) as (native, _),
          _load_reference(monkeypatch, stream_dir, **kwargs) as (reference, _)):
        experts = native.streaming.stores[0].spec.num_experts
        calls = [c[c < experts][:4] for c in recency_calls(90) + frequency_calls(90)
                 + recency_calls(90, seed=1)]
        ours, theirs = native.streaming.stores[0], reference.streaming.stores[0]
        arms = []
        for step, ids in enumerate(calls):
            ours.ensure(ours.route(ids.astype(np.uint32))[1])
            distinct = np.unique(ids)
            theirs.policy.observe(distinct, ids[None])
            theirs.ensure(distinct)
            arms.append(theirs.policy.follows_lru)
            _assert_same_state(native, reference, step, layers=1)
        assert True in arms and False in arms, "the policy never switched arms: nothing compared"


@pytest.mark.parametrize("family,quantized", [("deepseek_v3", False), ("qwen3_next", True)])
def test_native_step_is_exact_on_other_families(models, family, quantized):
    src, stream_dir = models.get(family, quantized=quantized)
    model = check_matches_resident(src, stream_dir, slots_per_layer=4)
    assert type(_residencies(model)[0]) is NativePaged


@pytest.mark.parametrize("policy,checksums", [("lfu-decay", "first-read"), ("lru", "always"),
                                             ("adaptive", "off")])
def test_native_step_rebinds_after_a_resize(qwen, monkeypatch, policy, checksums):
    # A pool resized between calls (memory pressure) reallocates the tables
    # the native step writes: it must follow them.
    _, stream_dir = qwen
    kwargs = dict(slots_per_layer=6, policy=policy, checksums=checksums)
    native, _ = mlx_streaming.load(stream_dir, **kwargs)
    reference, _ = _load_reference(monkeypatch, stream_dir, **kwargs)
    caches = [make_prompt_cache(m) for m in (native, reference)]
    tokens = mx.array([PROMPT[:8]])
    for step, slots in enumerate([6, 3, 3, 8, 5, 8]):
        for m in (native, reference):
            for store in m.streaming.stores:
                store.resize(slots)
        out = [m(tokens, cache=c)[:, -1] for m, c in zip((native, reference), caches)]
        mx.eval(out)
        assert mx.array_equal(out[0], out[1]).item(), f"logits differ at step {step}"
        _assert_same_state(native, reference, step)
        assert _counters(native) == _counters(reference), f"counters differ at step {step}"
        tokens = mx.argmax(out[0], axis=-1, keepdims=True)


def _damage(stream_dir, layer_index, experts):
    spec = read_manifest(stream_dir).layers[layer_index]
    with open(stream_dir / "experts" / spec.file, "r+b") as f:
        for e in experts:
            f.seek(e * spec.stride + spec.segments[-1].offset + 3)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    return spec


def _decode_until_error(model, steps=24):
    """(step, layer, expert) of the first checksum error in a decode."""
    cache = make_prompt_cache(model)
    tokens = mx.array([PROMPT[:1]])  # one token a call: every call fits the pool
    for step in range(steps):
        try:
            out = model(tokens, cache=cache)[:, -1]
            mx.eval(out)
        except CorruptExpertError as e:
            return step, e.layer, e.expert
        tokens = mx.argmax(out, axis=-1, keepdims=True)
    return None


def test_a_damaged_record_fails_alike_on_both_paths(stream_copy, monkeypatch):
    # Half the experts of one layer damaged: inside the graph the failure is
    # raised when the forward pass ends, at the same call and for the same
    # expert as the reference, and leaves the same tables up to that layer.
    # (The layers after it routed that pass's wrong hidden states: their
    # pools may hold other experts, every one checked.)
    spec = _damage(stream_copy, 1, range(0, 8, 2))
    native, _ = mlx_streaming.load(stream_copy, slots_per_layer=4, overlap=False)  # in the graph
    reference, _ = _load_reference(monkeypatch, stream_copy, slots_per_layer=4)
    failed = _decode_until_error(native)
    assert failed is not None and failed[1] == spec.layer and failed[2] % 2 == 0
    assert all(c.syncs == 0 for c in native.streaming.stats.counters.values())
    assert _decode_until_error(reference) == failed
    _assert_same_state(native, reference, failed[0], layers=2)


def test_bind_refuses_arrays_it_would_have_to_copy(qwen):
    # A converted temporary would be freed when bind returns, leaving the
    # native step writing freed memory: refused instead.
    _, stream_dir = qwen
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=4)
    store = model.streaming.stores[0]
    pool, policy = store.pool, store.policy
    with pytest.raises(TypeError):
        store.index.bind(pool.slot_of_expert, pool.expert_of_slot, pool.addresses,
                         policy.last_use.astype(np.float32), policy.score, store.crcs,
                         store.unchecked)
    with pytest.raises(TypeError):
        store.index.bind(pool.slot_of_expert.astype(np.int64), pool.expert_of_slot,
                         pool.addresses, policy.last_use, policy.score, store.crcs,
                         store.unchecked)


def test_a_closed_model_is_a_clear_error_on_both_kinds_of_call(qwen):
    from mlx_streaming.errors import ExpertReadError

    _, stream_dir = qwen
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=4)
    mx.eval(model(mx.array([PROMPT[:8]])))
    model.streaming.close()
    for tokens in (PROMPT[:8], PROMPT[:1]):  # a synced call, a call inside the graph
        with pytest.raises(ExpertReadError, match="this model was closed"):
            mx.eval(model(mx.array([tokens])))


class _FailAt(nn.Module):
    """Wraps a module; raises on its ``at``-th call (after the layers before
    it were built into the graph)."""

    def __init__(self, inner, at):
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def __call__(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.inner(x)


def test_a_pass_that_raises_leaves_later_calls_exact(qwen, monkeypatch):
    # The pass raises after its calls inside the graph were built (in the
    # final norm): they are finished before the lock is released, and the
    # later passes match the reference, which failed the same way.
    _, stream_dir = qwen
    native, _ = mlx_streaming.load(stream_dir, slots_per_layer=4)
    reference, _ = _load_reference(monkeypatch, stream_dir, slots_per_layer=4)
    for m in (native, reference):
        m.model.norm = _FailAt(m.model.norm, at=3)
    caches = [make_prompt_cache(m) for m in (native, reference)]
    tokens = mx.array([PROMPT[:1]])
    failed = 0
    for step in range(10):
        out = []
        for m, c in zip((native, reference), caches):
            try:
                out.append(m(tokens, cache=c)[:, -1])
            except KeyboardInterrupt:
                failed += 1
        if len(out) == 2:
            mx.eval(out)
            assert mx.array_equal(out[0], out[1]).item(), f"logits differ at step {step}"
            _assert_same_state(native, reference, step)
            tokens = mx.argmax(out[0], axis=-1, keepdims=True)
    assert failed == 2


@pytest.mark.parametrize("overlap", [True, False])
def test_a_layer_whose_reads_are_slow_syncs_to_overlap_them(qwen, monkeypatch, overlap):
    # Decode calls start inside the graph. Once a layer's misses are
    # measured to take at least the overlap's bar per call (forced here to
    # a nanosecond), its calls sync instead, computing their resident
    # experts while the misses are read; without overlap they never leave
    # the graph. Logits are mlx-lm's either way.
    from mlx_streaming.runtime import block

    src, stream_dir = qwen
    monkeypatch.setattr(block, "OVERLAP_MIN_READ_S", 1e-9)
    split = count_splits(monkeypatch)
    model = check_matches_resident(src, stream_dir, slots_per_layer=4, overlap=overlap)
    assert all(type(r) is NativePaged for r in _residencies(model))
    counters = list(model.streaming.stats.counters.values())
    graph = [c.graph_calls for c in counters]
    synced = [c.syncs for c in counters]
    if overlap:
        # Each layer's first decode call ran in the graph, most later ones synced.
        assert all(g >= 1 for g in graph) and all(s > 2 * g for s, g in zip(synced, graph))
        assert split, "no synced call overlapped its reads"
    else:
        assert all(s <= 2 for s in synced) and not split  # the two prompts' calls only
    if overlap:
        # Reads below the bar again: the layers go back into the graph.
        with mlx_streaming.load(stream_dir, slots_per_layer=4) as (model, _):
            cache = make_prompt_cache(model)
            token = mx.argmax(model(mx.array([PROMPT]), cache=cache)[:, -1], axis=-1,
                              keepdims=True)
            for bar in (1e-9, 1e9):
                monkeypatch.setattr(block, "OVERLAP_MIN_READ_S", bar)
                mlx_streaming.reset_stats(model)
                for _ in range(6):
                    token = mx.argmax(model(token, cache=cache)[:, -1], axis=-1, keepdims=True)
                mx.eval(token)
                graph_calls = mlx_streaming.stats(model)["total"]["graph_calls"]
                assert (graph_calls < 6 * len(counters)) if bar < 1 else graph_calls == 6 * len(
                    counters)


class _GraphReads:
    """A store that hands over one graph call's read of ``seconds``."""

    layer = 0

    def __init__(self):
        self.seconds = 0.0

    def take_graph_reads(self):
        return 1, 1, self.seconds


def test_a_layer_changes_paths_only_past_the_bars(monkeypatch):
    # Out of the graph at the bar; back in only below OVERLAP_RETURN_SHARE
    # of it, so reads that hover at the bar do not flip the path per call.
    from mlx_streaming.runtime import block

    monkeypatch.setattr(block, "OVERLAP_SMOOTHING", 1.0)  # the mean is the last call
    store = _GraphReads()
    layer = NativePaged(store, events=None, overlap=object(), in_graph=True)
    bar, share = block.OVERLAP_MIN_READ_S, block.OVERLAP_RETURN_SHARE
    paths = []
    for seconds in (0.9 * bar, 1.1 * bar, 0.9 * bar, (share + 0.01) * bar,
                    (share - 0.01) * bar, 0.9 * bar, 1.1 * bar):
        store.seconds = seconds
        paths.append(layer._overlap_pays())
    assert paths == [False, True, True, True, False, False, True]
    assert not NativePaged(store, events=None, overlap=None, in_graph=True)._overlap_pays()
