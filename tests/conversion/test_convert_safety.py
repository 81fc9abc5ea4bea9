"""Conversion never destroys data: the source and other models are kept, disk
errors and damaged sources are one line, an interrupted conversion resumes,
and the manifest comes last."""

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_streaming.conversion.local import convert
from mlx_streaming.errors import (
    ConversionError,
)
from mlx_streaming.format import manifest_path, read_manifest
from mlx_streaming.testing.helpers import assert_one_line_error, check_matches_resident, run


def tree_digest(path: Path) -> dict:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


@pytest.fixture
def src_copy(tmp_path, qwen):
    dst = tmp_path / "src"
    shutil.copytree(qwen[0], dst)
    return dst


def test_convert_in_place_is_refused_and_keeps_the_source(src_copy):
    before = tree_digest(src_copy)
    with pytest.raises(ConversionError, match="source model itself"):
        convert(src_copy, src_copy, progress=False)
    with pytest.raises(ConversionError, match="source model itself"):
        convert(src_copy, src_copy / ".." / src_copy.name, force=True, progress=False)
    assert tree_digest(src_copy) == before


def test_out_over_an_mlx_lm_model_needs_force(tmp_path, models, src_copy):
    other = tmp_path / "other"
    shutil.copytree(models.get("mixtral", quantized=True)[0], other)
    before = tree_digest(other)
    with pytest.raises(ConversionError, match="already holds an mlx-lm model.*--force"):
        convert(src_copy, other, progress=False)
    assert tree_digest(other) == before
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    for force in (False, True):  # never written into, even with --force
        with pytest.raises(ConversionError, match="holds files that are not a model"):
            convert(src_copy, tmp_path / "notes", force=force, progress=False)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    convert(src_copy, other, force=True, progress=False)
    check_matches_resident(src_copy, other, slots_per_layer=4)


def test_force_over_a_stream_dir_leaves_nothing_stale(tmp_path, models, tokenizer_dir):
    big = tmp_path / "big"
    shutil.copytree(models.get("qwen3_moe", quantized=True, num_hidden_layers=4)[0], big)
    (big / "chat_template.jinja").write_text("{{ 'OLD TEMPLATE' }}")
    dst = convert(big, tmp_path / "stream", progress=False)
    assert (dst / "experts" / "layer003.blob").exists()
    assert (dst / "chat_template.jinja").exists()
    small = models.get("mixtral", quantized=True)[0]
    convert(small, dst, force=True, progress=False)
    blobs = sorted(p.name for p in (dst / "experts").iterdir() if p.suffix == ".blob")
    assert blobs == [spec.file for spec in read_manifest(dst).layers]
    assert not (dst / "chat_template.jinja").exists()
    check_matches_resident(small, dst, slots_per_layer=2)


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs mounted by the test (root only, as in CI)."""
    mounts = []

    def mount(size: str, readonly: bool = False) -> Path:
        point = tmp_path / f"mnt{len(mounts)}"
        point.mkdir()
        opts = f"size={size}" + (",ro" if readonly else "")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)],
                              capture_output=True, text=True)
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}): needs root")
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def test_disk_full_during_convert_is_one_line(qwen, tmpfs):
    full = tmpfs("64k")
    proc = run("mlx_streaming.convert", "--model", str(qwen[0]), "--out", str(full / "s"),
               "--no-progress", check_ok=False)
    assert_one_line_error(proc, "disk holding .* is full.*run the same command again")
    assert not manifest_path(full / "s").exists()


def test_read_only_output_is_one_line(qwen, tmpfs):
    ro = tmpfs("1m", readonly=True)
    proc = run("mlx_streaming.convert", "--model", str(qwen[0]), "--out", str(ro / "s"),
               "--no-progress", check_ok=False)
    assert_one_line_error(proc, "Read-only file system.*writable --out")


def test_missing_source_shard_is_one_line(tmp_path, qwen):
    src = tmp_path / "sharded"
    shutil.copytree(qwen[0], src)
    weights = mx.load(str(src / "model.safetensors"))
    names = sorted(weights)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        mx.save_safetensors(str(src / shard), {k: weights[k] for k in keys})
    (src / "model.safetensors").unlink()
    index = {"weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "model-00002-of-00002.safetensors").unlink()
    proc = run("mlx_streaming.convert", "--model", str(src), "--out", str(tmp_path / "s"),
               check_ok=False)
    assert_one_line_error(proc, "lacks 1 weight shard.*model-00002-of-00002")


def test_force_never_clears_before_the_source_is_accepted(tmp_path, qwen, models):
    dst = convert(qwen[0], tmp_path / "s", progress=False)
    before = tree_digest(dst)
    with pytest.raises(ConversionError, match="already quantized"):
        convert(qwen[0], dst, quantize=True, force=True, progress=False)
    f32_src = models.get("qwen3_moe", quantized=False)[0]
    with pytest.raises(ConversionError, match="--q-group-size must be one of 32 for mxfp4"):
        convert(f32_src, dst, quantize=True, q_mode="mxfp4", force=True, progress=False)
    assert tree_digest(dst) == before


def test_interrupted_before_the_first_layer_resumes(tmp_path, qwen, monkeypatch):
    import mlx_streaming.conversion.local as converter

    def crash(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(converter, "convert_layer", crash)
    with pytest.raises(KeyboardInterrupt):
        convert(qwen[0], tmp_path / "s", progress=False)
    monkeypatch.undo()
    convert(qwen[0], tmp_path / "s", progress=False)  # not refused as a foreign directory
    check_matches_resident(qwen[0], tmp_path / "s", slots_per_layer=4)


def test_fsync_before_the_manifest(tmp_path, qwen, monkeypatch):
    import mlx_streaming.conversion.local as converter
    import mlx_streaming.conversion.resume as resume

    synced, order = set(), []
    real_fsync_file, real_write = resume.fsync_path, converter.write_manifest
    monkeypatch.setattr(resume, "fsync_path",
                        lambda p: (synced.add(Path(p).name), real_fsync_file(p)))
    monkeypatch.setattr(converter, "write_manifest",
                        lambda *a: (order.append(set(synced)), real_write(*a)))
    dst = convert(qwen[0], tmp_path / "s", progress=False)
    before_manifest = order[0]
    for f in dst.iterdir():
        if f.is_file():
            assert f.name in before_manifest, f"{f.name} not fsynced before the manifest"
