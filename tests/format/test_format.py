"""The stream directory format: layout, manifest, and damage detection."""

import json

import mlx.core as mx
import numpy as np
import pytest

import mlx_streaming
from mlx_streaming.errors import CorruptExpertError, FormatError
from mlx_streaming.format import (
    RECORD_ALIGNMENT,
    SEGMENT_ALIGNMENT,
    damaged_records,
    layout_record,
    manifest_path,
    read_manifest,
    record_checksum,
)
from mlx_streaming.testing.helpers import PROMPT, record_bytes


def test_layout_aligns_segments_and_stride():
    segments, stride = layout_record(
        [("a.weight", "uint32", (64, 16), 4096), ("a.scales", "float32", (64, 1), 256),
         ("b.weight", "uint32", (3,), 12), ("b.bias", "float32", (5,), 20)]
    )
    assert all(s.offset % SEGMENT_ALIGNMENT == 0 for s in segments)
    assert stride % RECORD_ALIGNMENT == 0
    ends = [s.offset + s.nbytes for s in segments]
    assert all(e <= n.offset for e, n in zip(ends, segments[1:]))
    assert ends[-1] <= stride


def test_manifest_records_everything(qwen):
    src, stream_dir = qwen
    manifest = read_manifest(stream_dir)
    assert manifest.version == 2
    spec = manifest.layers[0]
    assert spec.module == "model.layers.0.mlp.switch_mlp"
    assert spec.file == "layer000.blob"
    assert spec.quantization["gate_proj"] == {"bits": 4, "group_size": 64, "mode": "affine"}
    names = {s.name for s in spec.segments}
    assert names == {f"{p}.{t}" for p in ("gate_proj", "up_proj", "down_proj")
                     for t in ("weight", "scales", "biases")}
    assert len(spec.checksums) == spec.num_experts
    # Each record's checksum matches its bytes.
    rec = record_bytes(stream_dir, spec, 3)
    assert record_checksum(rec[s.offset : s.offset + s.nbytes] for s in spec.segments) == spec.checksums[3]


def test_record_bytes_equal_source_weights(qwen):
    src, stream_dir = qwen
    weights = mx.load(str(src / "model.safetensors"))
    spec = read_manifest(stream_dir).layers[1]
    rec = record_bytes(stream_dir, spec, 5)
    for s in spec.segments:
        full = weights[f"{spec.module}.{s.name}"]
        expected = np.array(full[5].reshape(-1).view(mx.uint8)).tobytes()
        assert rec[s.offset : s.offset + s.nbytes] == expected


def test_dense_record_bytes_equal_source_weights(qwen):
    """Version 2: each layer's attention is in its dense record, byte for
    byte, and nowhere in the spine safetensors; norms and routers stay."""
    from mlx_streaming.format import dense_path

    src, stream_dir = qwen
    weights = mx.load(str(src / "model.safetensors"))
    spine = mx.load(str(stream_dir / "model.safetensors"))
    for spec in read_manifest(stream_dir).dense:
        record = dense_path(stream_dir, spec).read_bytes()
        assert len(record) == spec.nbytes
        names = {s.name for s in spec.segments}
        assert "self_attn.q_proj.weight" in names and "mlp.gate.weight" not in names
        for s in spec.segments:
            full = f"{spec.prefix}.{s.name}"
            expected = np.array(weights[full].reshape(-1).view(mx.uint8)).tobytes()
            assert record[s.offset : s.offset + s.nbytes] == expected
            assert full not in spine
        assert f"{spec.prefix}.input_layernorm.weight" in spine
        assert f"{spec.prefix}.mlp.gate.weight" in spine


def test_unknown_version_is_refused(stream_copy):
    d = json.loads(manifest_path(stream_copy).read_text())
    d["version"] = 99
    manifest_path(stream_copy).write_text(json.dumps(d))
    with pytest.raises(FormatError, match="format version 99.*reads versions 1, 2"):
        mlx_streaming.load(stream_copy)


def test_unconverted_directory_says_convert(qwen):
    src, _ = qwen
    with pytest.raises(FormatError, match="mlx_streaming convert"):
        mlx_streaming.load(src)


def test_truncated_blob_names_layer_and_expert(stream_copy):
    spec = read_manifest(stream_copy).layers[2]
    blob = stream_copy / "experts" / spec.file
    with open(blob, "r+b") as f:
        f.truncate(spec.stride * 11 + 100)
    with pytest.raises(CorruptExpertError, match=f"layer {spec.layer}, expert 11: blob .* truncated"):
        mlx_streaming.load(stream_copy)


def _flip_byte(stream_dir, spec, expert):
    blob = stream_dir / "experts" / spec.file
    with open(blob, "r+b") as f:
        f.seek(expert * spec.stride + spec.segments[-1].offset + 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("io", ["python", "native"])
def test_corrupt_record_is_caught_on_first_read(stream_copy, io):
    spec = read_manifest(stream_copy).layers[1]
    for e in range(spec.num_experts):
        _flip_byte(stream_copy, spec, e)
    model, _ = mlx_streaming.load(stream_copy, slots_per_layer=spec.top_k, io=io)
    with pytest.raises(CorruptExpertError, match=f"layer {spec.layer}, expert \\d+: checksum mismatch"):
        mx.eval(model(mx.array([PROMPT[:4]])))
    # The damaged slots were not published: the table maps nothing there.
    store = model.streaming.stores[1]
    assert (store.pool.slot_of_expert < 0).all()
    assert damaged_records(stream_copy) == [(spec.layer, e) for e in range(spec.num_experts)]


def test_checksums_off_skips_checksums(stream_copy):
    """With checks off, damaged records are read and used (the logits
    change) without an error; with them on, the same read is refused."""
    spec = read_manifest(stream_copy).layers[1]
    tokens = mx.array([PROMPT[:4]])
    with mlx_streaming.load(stream_copy, slots_per_layer=spec.top_k, checksums="off") as (model, _):
        clean = model(tokens)
        mx.eval(clean)
    for e in range(spec.num_experts):
        _flip_byte(stream_copy, spec, e)
    with mlx_streaming.load(stream_copy, slots_per_layer=spec.top_k, checksums="off") as (model, _):
        damaged = model(tokens)
        mx.eval(damaged)
        assert mlx_streaming.stats(model)["layers"][spec.layer]["records_read"] > 0
        assert not mx.array_equal(clean, damaged).item()
    model, _ = mlx_streaming.load(stream_copy, slots_per_layer=spec.top_k)
    with pytest.raises(CorruptExpertError):
        mx.eval(model(tokens))


def test_check_accepts_a_clean_directory(qwen):
    assert damaged_records(qwen[1]) == []
