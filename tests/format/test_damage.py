"""Damaged stream directories and the checks that catch them: a malformed
manifest, a record or spine file that changed, is truncated or fails its
checksum is an error, never wrong output."""

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_streaming
from mlx_streaming.errors import (
    CorruptExpertError,
    FormatError,
)
from mlx_streaming.format import manifest_path, read_manifest
from mlx_streaming.testing.helpers import (
    PROMPT,
    assert_one_line_error,
    check_matches_resident,
    logits_trace,
    run,
)


def edit_manifest(stream_dir: Path, edit) -> None:
    d = json.loads(manifest_path(stream_dir).read_text())
    edit(d)
    manifest_path(stream_dir).write_text(json.dumps(d))


@pytest.mark.parametrize("prefetch", ["off", "next-layer"])
def test_segment_beyond_the_record_is_refused(stream_copy, prefetch):
    edit_manifest(stream_copy, lambda d: d["layers"][0]["segments"][0].update(offset=10**12))
    with pytest.raises(FormatError, match="beyond the stride"):
        mlx_streaming.load(stream_copy, slots_per_layer=4, prefetch=prefetch)


def test_stride_smaller_than_an_expert_is_refused(stream_copy):
    spec = read_manifest(stream_copy).layers[1]
    assert spec.expert_nbytes > 8192
    edit_manifest(stream_copy, lambda d: d["layers"][1].update(stride=8192))
    with pytest.raises(FormatError, match="stride 8192 is not a multiple"):
        mlx_streaming.load(stream_copy, slots_per_layer=4, prefetch="next-layer")
    # Aligned but too small: the segments end beyond it.
    edit_manifest(stream_copy, lambda d: [s.update(offset=s["offset"] + 16384)
                                          for s in d["layers"][1]["segments"]])
    edit_manifest(stream_copy, lambda d: d["layers"][1].update(stride=16384))
    with pytest.raises(FormatError, match="beyond the stride 16384"):
        mlx_streaming.load(stream_copy, slots_per_layer=4, prefetch="next-layer")


def test_native_reader_refuses_segments_outside_the_record(tmp_path):
    from mlx_streaming.errors import ExpertReadError
    from mlx_streaming.io.native import NativeReader, load_extension

    ext, why = load_extension()
    assert ext is not None, why
    blob = tmp_path / "b.blob"
    blob.write_bytes(bytes(2 * 16384))
    reader = NativeReader(ext, 2, False)
    f = reader.open(str(blob))
    dst = np.zeros(64, np.uint8)
    row = np.array([[dst.ctypes.data]], np.int64)
    for seg in ([10**12, 64], [16384 - 8, 64], [-1, 8]):
        with pytest.raises(ExpertReadError, match="outside"):
            reader.read(f, np.array([0], np.int64), np.array([seg], np.int64), row,
                        np.array([True]), 16384)
    staging = reader.staging(2, 16384)
    staging.stage(0, f, np.array([0], np.int64), np.array([0], np.int64))
    with pytest.raises(Exception, match="outside"):
        staging.take(0, 0, np.array([[10**12, 64]], np.int64), row[0], False)
    reader.close()


def test_fewer_experts_in_the_manifest_than_the_model_is_refused(stream_copy):
    def shrink(d):
        layer = d["layers"][0]
        layer["num_experts"] = 8
        layer["checksums"] = layer["checksums"][:8]

    edit_manifest(stream_copy, shrink)
    with pytest.raises(FormatError, match="records 8 experts but the model has 16"):
        mlx_streaming.load(stream_copy)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["layers"][0].update(stride="big"), "stride is str"),
    (lambda d: d["layers"][0].update(top_k=None), "top_k is NoneType"),
    (lambda d: d["layers"][0]["segments"][0].update(shape="64"), "shape is str"),
    (lambda d: d["layers"][0]["segments"][0].update(nbytes=7), "do not hold"),
    (lambda d: d["layers"][0].update(checksums=[1, 2]), "checksums must be 16"),
    (lambda d: d["layers"].append(d["layers"][0]), "two layers share"),
    (lambda d: d["layers"][0].update(file="../../etc/passwd"), "plain file name"),
    (lambda d: d.update(layers={}), "layers is dict"),
    (lambda d: d["layers"][0].update(quantization=[]), "quantization is not an object"),
])
def test_malformed_manifest_fields_are_format_errors(stream_copy, edit, message):
    edit_manifest(stream_copy, edit)
    with pytest.raises(FormatError, match=message):
        mlx_streaming.load(stream_copy)


def test_garbage_or_directory_manifest_is_one_line(stream_copy):
    manifest_path(stream_copy).write_bytes(os.urandom(4096))
    proc = run("mlx_streaming.generate", "--model", str(stream_copy), check_ok=False)
    assert_one_line_error(proc, "not valid JSON|not an mlx_streaming manifest")
    manifest_path(stream_copy).unlink()
    manifest_path(stream_copy).mkdir()
    proc = run("mlx_streaming.generate", "--model", str(stream_copy), check_ok=False)
    assert_one_line_error(proc, "is a directory")


def test_corrupt_and_truncated_spine_is_one_line(stream_copy):
    spine = stream_copy / "model.safetensors"
    data = bytearray(spine.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    garbled = bytearray(data)
    garbled[8:header] = os.urandom(header - 8)
    spine.write_bytes(garbled)
    proc = run("mlx_streaming.generate", "--model", str(stream_copy), check_ok=False)
    assert_one_line_error(proc, "spine")
    spine.write_bytes(data[: len(data) // 2])
    proc = run("mlx_streaming.generate", "--model", str(stream_copy), check_ok=False)
    assert_one_line_error(proc, "spine file .*model.safetensors")


def spine_tensor_offset(spine: Path, name: str) -> int:
    data = spine.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    return 8 + n + header[name]["data_offsets"][0]


def test_check_catches_an_altered_router(stream_copy):
    spine = stream_copy / "model.safetensors"
    offset = spine_tensor_offset(spine, "model.layers.1.mlp.gate.weight")
    with open(spine, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    proc = run("mlx_streaming.check", str(stream_copy), check_ok=False)
    assert_one_line_error(proc, "damaged or missing spine files \\(model.safetensors\\)")
    with pytest.raises(FormatError, match="fails its checksum"):
        mlx_streaming.load(stream_copy, checksums="always")


def test_manifest_without_spine_checksums_still_loads(stream_copy, qwen):
    edit_manifest(stream_copy, lambda d: d.pop("spine"))
    assert read_manifest(stream_copy).spine == ()
    proc = run("mlx_streaming.check", str(stream_copy))
    assert "predates spine checksums" in proc.stdout
    check_matches_resident(qwen[0], stream_copy, slots_per_layer=4)


@pytest.mark.parametrize("checksums", ["first-read", "always"])
@pytest.mark.parametrize("prefetch", ["off", "next-layer"])  # next-layer: overlapped reads
def test_blob_rewritten_mid_run_is_an_error_not_wrong_tokens(stream_copy, qwen, checksums,
                                                             prefetch, monkeypatch):
    import mlx_lm

    from mlx_streaming.runtime import block

    monkeypatch.setattr(block, "OVERLAP_MIN_READ_S", 0.0)  # the worker raises it

    reference = logits_trace(mlx_lm.load(str(qwen[0]))[0], steps=12)
    model, _ = mlx_streaming.load(stream_copy, slots_per_layer=4, checksums=checksums,
                                  prefetch=prefetch)
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = model(mx.array([PROMPT]), cache=cache)[:, -1]
    assert mx.array_equal(out, reference[0]).item()
    for spec in read_manifest(stream_copy).layers:
        blob = stream_copy / "experts" / spec.file
        before = blob.stat()
        with open(blob, "r+b") as f:  # rewritten in place: same inode
            for e in range(spec.num_experts):
                f.seek(e * spec.stride + 3)
                f.write(b"\x5a\xa5")
        # Its mtime put back (as a copy tool may): only the ctime changed.
        os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(CorruptExpertError, match="checksum mismatch"):
        for step in range(1, 13):
            token = mx.argmax(out, axis=-1, keepdims=True)
            out = model(token, cache=cache)[:, -1]
            assert mx.array_equal(out, reference[step]).item(), f"wrong logits at {step}"
