"""Spine streaming (format version 2): a model whose dense layers do not
fit the budget streams them through a ring of layer buffers, bit-identical
to mlx-lm running the same weights in memory; one budget split between the
spine and the pools; version 1 directories still load."""

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_streaming
from mlx_streaming.config import StreamConfig
from mlx_streaming.errors import BudgetError, FormatError
from mlx_streaming.format import dense_path, read_manifest
from mlx_streaming.runtime import memory as budget
from mlx_streaming.runtime import spine
from mlx_streaming.runtime.model_spine import spine_bytes
from mlx_streaming.testing.families import FAMILIES
from mlx_streaming.testing.helpers import (
    PROMPT,
    assert_same_logits,
    check_matches_resident,
    downgrade_to_v1,
    logits_trace,
)

MIB = 1 << 20


@pytest.mark.parametrize("quantized", [True, False], ids=["q4", "f32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_streams_its_spine_exactly(models, family, quantized):
    """No spine layer pinned, two buffers, one token's experts per layer."""
    src, stream_dir = models.get(family, quantized)
    manifest = read_manifest(stream_dir)
    assert manifest.version == 2 and manifest.dense, "the converter wrote no dense records"
    top_k = max(spec.top_k for spec in manifest.layers)
    model = check_matches_resident(src, stream_dir, slots_per_layer=top_k, pinned_layers=0)
    report = mlx_streaming.stats(model)
    assert report["memory"]["pinned_layers"] == 0
    assert report["memory"]["streamed_layers"] == [d.layer for d in manifest.dense]


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "qwen3_next", "kimi_k3"])
@pytest.mark.parametrize("options", [
    dict(pinned_layers=1, spine_ring=1),
    dict(pinned_layers=0, spine_ring=3, prefetch="next-layer"),
    dict(pinned_layers=0, io="python", direct_io=False),
], ids=["one-buffer", "three-buffers-prefetch", "python-reader"])
def test_ring_variants_are_exact(models, family, options):
    """Shared experts (qwen2_moe, deepseek_v3, kimi_k3), dense first layers
    (deepseek_v3, kimi_k3), a hybrid with linear attention (qwen3_next)."""
    for quantized in (True, False):
        src, stream_dir = models.get(family, quantized)
        check_matches_resident(src, stream_dir, slots_per_layer=4, **options)


@pytest.mark.parametrize("quantized", [True, False], ids=["q4", "f32"])
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe", "qwen3_next"])
def test_a_spine_larger_than_the_budget_is_streamed(models, family, quantized):
    """The budget holds the resident part, one token's experts, the ring and
    a layer's worth of pins: the rest of the spine streams, output
    unchanged, and every pass reads each streamed layer once. DeepSeek-V3
    (dense first layer, shared experts), Qwen2-MoE (shared experts),
    Qwen3-Next (hybrid: linear attention and shared experts)."""
    src, stream_dir = models.get(family, quantized, num_hidden_layers=6)
    manifest = read_manifest(stream_dir)
    assert len(manifest.dense) == 6
    base = spine_bytes(stream_dir)
    per_slot = budget.bytes_per_slot(manifest)
    record = max(d.nbytes for d in manifest.dense)
    cache_gb = (base + 4 * per_slot + 3 * record) / 1e9
    model = check_matches_resident(src, stream_dir, cache_gb=cache_gb)
    report = mlx_streaming.stats(model)
    memory = report["memory"]
    assert memory["pinned_layers"] >= 1 and memory["ring_buffers"] == 2
    assert len(memory["streamed_layers"]) == 6 - memory["pinned_layers"] >= 3
    assert memory["total_gb"] <= cache_gb + 1e-12
    assert memory["slots_per_layer"] == 4

    model, _ = mlx_streaming.load(stream_dir, cache_gb=cache_gb)
    assert mlx_streaming.stats(model)["memory"] == memory  # the same split
    logits_trace(model, steps=4)
    ring = mlx_streaming.stats(model)["spine"]
    passes = 5  # prefill and four decode steps
    # Each pass reads every streamed layer (the last read may be the next
    # pass's first layer, started ahead).
    streamed = len(memory["streamed_layers"])
    assert passes * streamed <= ring["reads"] <= passes * streamed + 1
    assert ring["preloaded"] >= passes * streamed - passes


def budget_case(models):
    """The tiny qwen3_moe's manifest, bytes per slot, largest dense record,
    and a made-up resident spine of 50 kB, for planning without loading."""
    manifest = read_manifest(models.get("qwen3_moe", True)[1])
    return (manifest, budget.bytes_per_slot(manifest),
            max(d.nbytes for d in manifest.dense), 50_000)


def test_the_budget_prefers_spine_layers_to_expert_slots(models):
    manifest, per_slot, record, base = budget_case(models)
    dense = sum(d.nbytes for d in manifest.dense)
    plenty = lambda: 10**12  # noqa: E731
    # Room for everything pinned and 6 slots.
    plan = budget.plan_memory(manifest, StreamConfig(cache_gb=(base + dense + 6 * per_slot) / 1e9),
                              base, plenty)
    assert plan.streamed == () and plan.slots == 6 and plan.ring == 0
    # One record short of the whole spine: a ring, pins, and the minimum pool.
    cache = base + dense - 1 + 4 * per_slot
    plan = budget.plan_memory(manifest, StreamConfig(cache_gb=cache / 1e9), base, plenty)
    assert plan.streamed and plan.slots == 4 and plan.total <= cache
    assert plan.ring == plan.ring_buffers * max(d.nbytes for d in manifest.dense)
    assert len(plan.pinned) + len(plan.streamed) == len(manifest.dense)
    # Pins are spread over the depth, not bunched at the front.
    if len(plan.pinned) >= 2:
        assert max(plan.pinned) > len(manifest.dense) // 2
    # Short of a ring of two, a ring of one (by default); below that,
    # refused, the minimum named.
    largest = max(d.nbytes for d in manifest.dense)
    least = base + 2 * largest + 4 * per_slot
    plan = budget.plan_memory(manifest, StreamConfig(cache_gb=least / 1e9), base, plenty)
    assert plan.pinned == () and plan.slots == 4 and plan.ring_buffers == 2
    plan = budget.plan_memory(manifest, StreamConfig(cache_gb=(least - 1) / 1e9), base, plenty)
    assert plan.ring_buffers == 1 and plan.slots == 4
    least_one = base + largest + 4 * per_slot
    with pytest.raises(BudgetError, match=r"use --cache-gb (\d+\.\d+) or more") as e:
        budget.plan_memory(manifest, StreamConfig(cache_gb=(least_one - 1) / 1e9), base,
                           plenty)
    assert float(e.value.args[0].rsplit("--cache-gb ", 1)[1].split()[0]) * 1e9 >= least_one - 1e6


def test_explicit_pools_leave_the_spine_what_is_available(models):
    manifest, per_slot, record, base = budget_case(models)
    available = lambda: base + 2 * record + 6 * per_slot + 100  # noqa: E731
    plan = budget.plan_memory(manifest, StreamConfig(slots_per_layer=6, reserve_gb=0), base,
                              available)
    assert plan.slots == 6 and plan.ring_buffers == 2 and plan.total <= available()
    with pytest.raises(BudgetError, match=r"use --slots-per-layer (\d+) ") as e:
        budget.plan_memory(manifest, StreamConfig(slots_per_layer=8), base, available)
    most = int(str(e.value).split("--slots-per-layer ")[1].split()[0])
    plan = budget.plan_memory(manifest, StreamConfig(slots_per_layer=most), base, available)
    assert plan.total <= available()


def test_budget_advice_is_followable(models):
    """Every number an error advises loads; where nothing can, it says so."""
    manifest, per_slot, record, base = budget_case(models)
    least = base + record + 4 * per_slot  # with a ring of one
    for avail in (least - 1, least, least + 7, int(least * 1.1), int(least * 1.5), least * 4,
                  least * 8):
        available = lambda: avail  # noqa: E731
        for config in (StreamConfig(cache_gb=1.0), StreamConfig(slots_per_layer=16),
                       StreamConfig(reserve_gb=0.5)):
            try:
                plan = budget.plan_memory(manifest, config, base, available)
            except BudgetError as e:
                text = str(e)
                if "--cache-gb " in text:
                    value = float(text.split("--cache-gb ")[1].split()[0])
                    retry = StreamConfig(cache_gb=value)
                elif "--slots-per-layer " in text:
                    retry = StreamConfig(slots_per_layer=int(
                        text.split("--slots-per-layer ")[1].split()[0]))
                else:
                    # Nothing fits beside the headroom the rest of the process needs.
                    headroom = min(config.reserve_gb * 1e9, avail // 4)
                    assert "free memory" in text and avail - headroom < least, text
                    continue
                plan = budget.plan_memory(manifest, retry, base, available)
            assert plan.total <= avail


def test_version_1_directories_still_load(models, tmp_path):
    src, stream_dir = models.get("qwen3_moe", True)
    v1 = downgrade_to_v1(stream_dir, tmp_path / "v1")
    manifest = read_manifest(v1)
    assert manifest.version == 1 and manifest.dense == ()
    check_matches_resident(src, v1, slots_per_layer=4)
    with pytest.warns(RuntimeWarning, match="pinned_layers and spine_ring have no effect"):
        loaded = mlx_streaming.load(v1, pinned_layers=0, slots_per_layer=4)
    with loaded as (model, _):
        assert mlx_streaming.stats(model)["spine"] is None
    # A version 1 spine cannot stream: too small a budget says to re-convert.
    with pytest.raises(BudgetError, match="format version 2"):
        mlx_streaming.load(v1, cache_gb=1e-4)


@pytest.mark.parametrize("pinned", [None, 0], ids=["pinned", "streamed"])
def test_a_damaged_dense_record_is_an_error(models, tmp_path, pinned):
    _, stream_dir = models.get("qwen3_moe", True)
    copy = tmp_path / "damaged"
    shutil.copytree(stream_dir, copy)
    spec = read_manifest(copy).dense[1]
    with open(dense_path(copy, spec), "r+b") as f:
        f.seek(spec.segments[0].offset + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    if pinned is None:
        with pytest.raises(FormatError, match="layer 1 .* fails its checksum"):
            mlx_streaming.load(copy)
    else:
        with mlx_streaming.load(copy, pinned_layers=0, slots_per_layer=4) as (model, _):
            with pytest.raises(FormatError, match="layer 1 .* fails its checksum"):
                model(mx.array([PROMPT]))
    proc = subprocess.run([sys.executable, "-m", "mlx_streaming.check", str(copy)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "spine/layer001.blob" in proc.stdout + proc.stderr


def test_a_truncated_dense_record_is_refused_at_load(models, tmp_path):
    _, stream_dir = models.get("qwen3_moe", True)
    copy = tmp_path / "short"
    shutil.copytree(stream_dir, copy)
    spec = read_manifest(copy).dense[0]
    with open(dense_path(copy, spec), "r+b") as f:
        f.truncate(spec.nbytes - 1)
    with pytest.raises(FormatError, match="layer 0: dense record .* truncated"):
        mlx_streaming.load(copy)


def test_a_pass_broken_by_an_error_leaves_the_ring_exact(models):
    """A call that fails mid-pass breaks the ring's order; the next calls
    still compute with the right layers' weights."""
    src, stream_dir = models.get("qwen3_moe", True)
    reference, _ = mlx_lm_load(src)
    model, _ = mlx_streaming.load(stream_dir, pinned_layers=0, slots_per_layer=4)
    layers = model.model.layers
    original = type(layers[2]).__mro__[1].__call__
    boom = {"on": True}

    def failing(self, *args, **kwargs):
        if boom["on"] and self is layers[2]:
            raise RuntimeError("boom")
        return original(self, *args, **kwargs)

    type(layers[2]).__mro__[1].__call__ = failing
    try:
        with pytest.raises(RuntimeError, match="boom"):
            model(mx.array([PROMPT]))
    finally:
        type(layers[2]).__mro__[1].__call__ = original
    assert_same_logits(logits_trace(reference), logits_trace(model))


def mlx_lm_load(src):
    import mlx_lm

    return mlx_lm.load(str(src))


def test_the_ring_rule_is_what_keeps_it_exact(models, monkeypatch):
    """Overwriting a buffer without first evaluating what reads it changes
    the output: the parity tests above can see a broken ring. (Every expert
    resident, so no layer syncs on its own; the layers are not started
    early either, so the breakage is certain, not a race.)"""
    src, stream_dir = models.get("qwen3_moe", False)
    reference, _ = mlx_lm_load(src)
    experts = read_manifest(stream_dir).layers[0].num_experts

    def careless(self, b):
        if self.future[b] is not None:
            self.future[b].result()
        self.future[b] = self.held[b] = None
        self.pending[b] = []

    model, _ = mlx_streaming.load(stream_dir, pinned_layers=0, spine_ring=1,
                                  slots_per_layer=experts)
    want = logits_trace(reference, steps=2)
    assert_same_logits(want, logits_trace(model, steps=2))
    monkeypatch.setattr(spine.SpineRing, "_release", careless)
    monkeypatch.setattr(spine.mx, "async_eval", lambda *arrays: None)
    got = logits_trace(model, steps=2)
    assert not all(mx.array_equal(a, b).item() for a, b in zip(want, got))


def test_typed_views_share_the_buffer():
    """Writes into a ring buffer's bytes are what its typed views hold."""
    from mlx_streaming.format import DenseSpec, layout_record

    segments, nbytes = layout_record([("a.weight", "float32", (4, 8), 128),
                                      ("b.weight", "bfloat16", (2, 16), 64)])
    spec = DenseSpec(0, "x", "f", nbytes, segments, {}, 0)
    raw = mx.zeros((nbytes,), dtype=mx.uint8)
    mx.eval(raw)
    views = spine.typed_views(raw, spec)
    host = np.array(raw, copy=False)
    values = np.arange(32, dtype=np.float32).reshape(4, 8)
    host[segments[0].offset:segments[0].offset + 128] = values.view(np.uint8).ravel()
    assert np.array_equal(np.array(views["a.weight"]), values)
    assert views["b.weight"].dtype == mx.bfloat16 and views["b.weight"].shape == (2, 16)


def test_cache_writes_that_skip_the_output_are_waited_for(models):
    """DeepSeek-V3.2's indexer caches its keys on every call but uses them
    only once the context is longer than ``index_topk``: until then the
    cached keys are not part of the layer's output, yet they read the
    layer's buffer. A ring that waited for the output alone would overwrite
    the buffer first, and the tokens after the context passes 56 would
    differ."""
    src, stream_dir = models.get("deepseek_v32", True, index_topk=56)
    # Three streamed layers in two buffers: a layer's buffer changes from
    # pass to pass, so stale reads would see another layer's weights.
    check_matches_resident(src, stream_dir, slots_per_layer=4, pinned_layers=1)


def test_a_dense_record_rewritten_mid_run_is_checked_again(models, tmp_path):
    """After its first read a streamed record is trusted, until its file
    changes on disk: then every read of it is checked."""
    _, stream_dir = models.get("qwen3_moe", True)
    copy = tmp_path / "rewritten"
    shutil.copytree(stream_dir, copy)
    model, _ = mlx_streaming.load(copy, pinned_layers=0, slots_per_layer=4)
    mx.eval(model(mx.array([PROMPT])))
    spec = read_manifest(copy).dense[1]
    with open(dense_path(copy, spec), "r+b") as f:  # rewritten in place
        f.seek(spec.segments[0].offset + 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(FormatError, match="layer 1 .* fails its checksum"):
        for _ in range(3):
            mx.eval(model(mx.array([PROMPT[:3]])))
    # Still damaged: the next call fails again rather than using the bytes.
    with pytest.raises(FormatError, match="layer 1 .* fails its checksum"):
        mx.eval(model(mx.array([PROMPT[:3]])))


def test_a_rewrite_that_puts_the_mtime_back_is_noticed(models, tmp_path):
    """Same size, same inode, the modification time restored: the change of
    its ctime (which no one can set) still tells (once, the text changed
    silently)."""
    import os

    _, stream_dir = models.get("qwen3_moe", True)
    copy = tmp_path / "rewritten"
    shutil.copytree(stream_dir, copy)
    model, _ = mlx_streaming.load(copy, pinned_layers=0, slots_per_layer=4)
    mx.eval(model(mx.array([PROMPT])))
    spec = read_manifest(copy).dense[1]
    path = dense_path(copy, spec)
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(spec.segments[0].offset + 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == before.st_mtime_ns
    with pytest.raises(FormatError, match="layer 1 .* fails its checksum"):
        for _ in range(3):
            mx.eval(model(mx.array([PROMPT[:3]])))


def test_the_returned_config_is_the_models_own(models):
    """The per-module quantization handed to mlx-lm for the dense records
    does not leak into the config ``load`` returns."""
    _, stream_dir = models.get("qwen3_moe", True)
    on_disk = json.loads((stream_dir / "config.json").read_text())
    model, _, config = mlx_streaming.load(stream_dir, return_config=True, pinned_layers=0,
                                          slots_per_layer=4)
    assert config["quantization"] == on_disk["quantization"]
