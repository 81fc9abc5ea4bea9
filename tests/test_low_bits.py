"""Low-bit miss reads: the copies convert writes, how a run uses them, and
what it says."""

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

import mlx_streaming
from mlx_streaming.conversion.low_bits import add_low_bits, full_weight
from mlx_streaming.errors import ConfigError, ConversionError, CorruptExpertError
from mlx_streaming.format import blob_path, damaged_records, read_manifest
from mlx_streaming.testing.families import FAMILIES
from helpers import assert_same_logits, logits_trace


def _with_copies(stream_dir, tmp_path, bits=(2,)):
    """A private copy of ``stream_dir`` holding low-bit copies."""
    out = tmp_path / "stream"
    shutil.copytree(stream_dir, out)
    for b in bits:
        add_low_bits(out, b)
    return out


def _records(path, spec, expert):
    """The tensors of one record of ``spec``'s blob, by segment name."""
    with open(blob_path(path, spec), "rb") as f:
        f.seek(spec.record_offset(expert))
        raw = np.frombuffer(f.read(spec.stride), np.uint8)
    out = {}
    for s in spec.segments:
        seg = mx.array(raw[s.offset: s.offset + s.nbytes])
        out[s.name] = seg.view(mlx_streaming.format.dtype_from_name(s.dtype)).reshape(
            1, *s.shape)
    return out


@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("bits", [2, 3])
def test_copies_are_mlx_quantize_of_each_expert(models, tmp_path, quantized, bits):
    _, stream_dir = models.get("qwen3_moe", quantized)
    out = _with_copies(stream_dir, tmp_path, (bits,))
    manifest = read_manifest(out)
    copies = manifest.low_copies(bits)
    assert copies.bits == bits and len(copies.layers) == len(manifest.layers)
    for spec, low in zip(manifest.layers, copies.layers):
        assert low.file != spec.file and low.expert_nbytes < spec.expert_nbytes
        for expert in (0, spec.num_experts - 1):
            full, small = _records(out, spec, expert), _records(out, low, expert)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                tensors = {k.split(".")[1]: v for k, v in full.items()
                           if k.startswith(proj + ".")}
                q = low.quantization[proj]
                want = mx.quantize(full_weight(spec, proj, tensors), group_size=q["group_size"],
                                   bits=bits)
                for key, w in zip(("weight", "scales", "biases"), want):
                    got = small[f"{proj}.{key}"]
                    assert got.dtype == w.dtype and got.shape == w.shape
                    assert bytes(np.array(got.view(mx.uint8))) == \
                        bytes(np.array(w.view(mx.uint8))), f"{proj}.{key} of expert {expert}"


def test_a_damaged_copy_is_a_checksum_error(models, tmp_path):
    _, stream_dir = models.get("qwen3_moe", True)
    out = _with_copies(stream_dir, tmp_path)
    low = read_manifest(out).low_copies(2).layers[0]
    with open(blob_path(out, low), "r+b") as f:
        for e in range(low.num_experts):  # whichever is read first
            f.seek(low.record_offset(e) + low.segments[0].offset)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    assert (low.layer, 0) in damaged_records(out)
    model, _ = mlx_streaming.load(out, slots_per_layer=low.top_k, miss_bits=2)
    with pytest.raises(CorruptExpertError, match="checksum"):
        logits_trace(model, steps=8)
    model.streaming.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_miss_bits_on_every_family(models, tmp_path, family):
    """Every family runs with low-bit miss reads, deterministically."""
    _, stream_dir = models.get(family, True)
    spec = read_manifest(stream_dir).layers[0]
    out = _with_copies(stream_dir, tmp_path)
    traces = []
    for _ in range(2):
        model, _ = mlx_streaming.load(out, slots_per_layer=max(spec.top_k, spec.num_experts // 2),
                                      miss_bits=2)
        traces.append(logits_trace(model, steps=10))
        report = mlx_streaming.stats(model)
        model.streaming.close()
        assert report["miss_bits"]["bits"] == 2
        # Each token's top expert is read in full: with one expert per
        # token (llama4), nothing takes a copy.
        assert (report["miss_bits"]["substituted"] > 0) == (spec.top_k > 1)
        assert report["miss_bits"]["substituted"] <= report["total"]["misses"]
    assert_same_logits(*traces)


def test_a_weight_no_miss_stays_under_is_exact(models, tmp_path):
    src, stream_dir = models.get("qwen3_moe", True)
    out = _with_copies(stream_dir, tmp_path)
    reference, _ = mlx_lm.load(str(src))
    model, _ = mlx_streaming.load(out, slots_per_layer=6, miss_bits=2, miss_bits_weight=0.0)
    assert_same_logits(logits_trace(reference), logits_trace(model))
    assert mlx_streaming.stats(model)["miss_bits"]["substituted"] == 0
    model.streaming.close()


def test_a_weight_limits_which_misses_take_copies(models, tmp_path):
    """Misses below the weight take copies, the rest are read in full."""
    _, stream_dir = models.get("qwen3_moe", True)
    out = _with_copies(stream_dir, tmp_path)
    share = {}
    for weight in (1.0, 0.1):
        model, _ = mlx_streaming.load(out, slots_per_layer=6, miss_bits=2,
                                      miss_bits_weight=weight)
        logits_trace(model, steps=24)
        share[weight] = mlx_streaming.stats(model)["miss_bits"]["share_of_misses"]
        model.streaming.close()
    assert 0 < share[0.1] < share[1.0]


def test_miss_bits_reads_fewer_bytes_and_says_so(models, tmp_path, recwarn):
    _, stream_dir = models.get("qwen3_moe", True)
    out = _with_copies(stream_dir, tmp_path)
    read = {}
    for bits in (None, 2):
        model, _ = mlx_streaming.load(out, slots_per_layer=6, miss_bits=bits)
        logits_trace(model, steps=24)
        read[bits] = mlx_streaming.stats(model)["total"]["bytes_read"]
        model.streaming.close()
    assert read[2] < read[None]
    said = [str(w.message) for w in recwarn if "approximate" in str(w.message)]
    assert len(said) == 1 and "miss_bits=2" in said[0]
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_streaming.generate", "--model", str(out), "--prompt",
         "def f(x):", "--max-tokens", "8", "--slots-per-layer", "5", "--miss-bits", "2"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "the output is approximate" in proc.stderr and "miss reads: approximate" in proc.stderr


def test_batches_and_drafts_run_with_miss_bits(models, tmp_path):
    _, stream_dir = models.get("qwen3_moe", True)
    out = _with_copies(stream_dir, tmp_path)
    prompts = [[1, 7, 42, 300, 5], [18, 99, 260], [3, 77, 150, 11, 480, 23]]
    texts = []
    for _ in range(2):
        model, tokenizer = mlx_streaming.load(out, slots_per_layer=8, miss_bits=2)
        texts.append(mlx_streaming.batch_generate(model, tokenizer, prompts,
                                                  max_tokens=12).texts)
        assert mlx_streaming.stats(model)["miss_bits"]["substituted"] > 0
        model.streaming.close()
    assert texts[0] == texts[1]
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_streaming.generate", "--model", str(out),
         "--prompt", "def f(x): return f(x) + f(x) + f(x)", "--max-tokens", "16",
         "--slots-per-layer", "6", "--miss-bits", "2", "--draft", "ngram"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "miss reads: approximate" in proc.stderr


def test_miss_bits_refusals(models, tmp_path):
    _, stream_dir = models.get("qwen3_moe", True)
    with pytest.raises(ConfigError, match="--miss-bits 2"):
        mlx_streaming.load(stream_dir, slots_per_layer=6, miss_bits=2)
    with pytest.raises(ConfigError, match="set miss_bits too"):
        mlx_streaming.StreamConfig(miss_bits_weight=0.1)
    for bad in (dict(miss_bits=7), dict(miss_bits=1), dict(miss_bits=2, miss_bits_weight=2.0)):
        with pytest.raises(ConfigError):
            mlx_streaming.StreamConfig(**bad)
    out = tmp_path / "copy"
    shutil.copytree(stream_dir, out)
    with pytest.raises(ConversionError, match="already 4-bit"):
        add_low_bits(out, 4)
    assert read_manifest(out).low_bits == ()


def test_convert_adds_copies_to_a_converted_directory(models, tmp_path):
    src, stream_dir = models.get("qwen3_moe", True)
    out = tmp_path / "stream"
    shutil.copytree(stream_dir, out)
    before = json.loads((out / "experts" / "manifest.json").read_text())
    cmd = [sys.executable, "-m", "mlx_streaming.convert", "--model", str(src), "--out",
           str(out), "--miss-bits", "2,3", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    after = json.loads((out / "experts" / "manifest.json").read_text())
    assert [c["bits"] for c in after["low_bits"]] == [2, 3]
    assert after["layers"] == before["layers"]  # the records are untouched
    proc = subprocess.run(cmd[:-3] + ["--miss-bits", "2", "--tensor-parallel", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "--tensor-parallel" in proc.stderr


def test_which_misses_take_copies():
    from types import SimpleNamespace
    from mlx_streaming.runtime.low_bits import LowBitMisses

    store = SimpleNamespace(pool=SimpleNamespace(slots=2))
    probs = np.array([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.6, 0.1]])
    missing = np.array([0, 1, 2, 3])
    # Default: every token's top expert (0 and 2) is read in full; of the
    # rest the least likely first, as many as the copies' pool holds.
    assert LowBitMisses(store, None, None).choose(missing, probs).tolist() == [1, 3]
    assert LowBitMisses(store, None, 0.25).choose(missing, probs).tolist() == [3]
    assert LowBitMisses(store, None, 0.99).choose(missing, probs).tolist() == [1, 3]
    assert LowBitMisses(store, None, None).choose(missing, None).tolist() == [0, 1]


@pytest.mark.parametrize("damage", ["bits", "layers", "stride", "file"])
def test_a_malformed_low_bits_entry_is_refused(models, tmp_path, damage):
    from mlx_streaming.errors import FormatError

    _, stream_dir = models.get("qwen3_moe", True)
    out = _with_copies(stream_dir, tmp_path)
    path = out / "experts" / "manifest.json"
    manifest = json.loads(path.read_text())
    entry = manifest["low_bits"][0]
    if damage == "bits":
        entry["bits"] = 7
    elif damage == "layers":
        entry["layers"] = entry["layers"][:-1]
    elif damage == "stride":
        entry["layers"][0]["stride"] += 1
    else:
        entry["layers"][0]["file"] = manifest["layers"][0]["file"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(FormatError):
        read_manifest(out)
