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
from mlx_streaming.conversion.copies import add_low_bits, full_weight
from mlx_streaming.errors import ConfigError, ConversionError, CorruptExpertError
from mlx_streaming.format import blob_path, damaged_records, read_manifest
from mlx_streaming.testing.families import FAMILIES
from mlx_streaming.testing.helpers import assert_same_logits, logits_trace


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


@pytest.mark.parametrize("family", FAMILIES)
def test_miss_bits_on_every_family(models, tmp_path, family):
    """Every family runs with low-bit miss reads, deterministically."""
    _, stream_dir = models.get(family, True)
    spec = read_manifest(stream_dir).layers[0]
    out = _with_copies(stream_dir, tmp_path)
    traces = []
    for _ in range(2):
        with mlx_streaming.load(out, slots_per_layer=max(spec.top_k, spec.num_experts // 2),
                                miss_bits=2) as (model, _):
            traces.append(logits_trace(model, steps=10))
            report = mlx_streaming.stats(model)
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


def test_a_weight_limits_which_misses_take_copies(models, tmp_path):
    """Misses below the weight take copies, the rest are read in full."""
    _, stream_dir = models.get("qwen3_moe", True)
    out = _with_copies(stream_dir, tmp_path)
    share = {}
    for weight in (1.0, 0.2):
        with mlx_streaming.load(out, slots_per_layer=6, miss_bits=2,
                                miss_bits_weight=weight) as (model, _):
            logits_trace(model, steps=24)
            share[weight] = mlx_streaming.stats(model)["miss_bits"]["share_of_misses"]
    assert 0 < share[0.2] < share[1.0]


def test_miss_bits_reads_fewer_bytes_and_says_so(models, tmp_path, recwarn):
    _, stream_dir = models.get("qwen3_moe", True)
    out = _with_copies(stream_dir, tmp_path)
    manifest = read_manifest(out)
    with mlx_streaming.load(out, slots_per_layer=6, miss_bits=2) as (model, _):
        logits_trace(model, steps=24)
        total = mlx_streaming.stats(model)["total"]
    # Every copy read costs its own bytes, fewer than a record's.
    full, low = manifest.layers[0].expert_nbytes, manifest.low_copies(2).layers[0].expert_nbytes
    copies = (total["records_read"] * full - total["bytes_read"]) / (full - low)
    assert copies == int(copies) and 0 < copies <= total["low_bit_pairs"]
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
        with mlx_streaming.load(out, slots_per_layer=8, miss_bits=2) as (model, tokenizer):
            texts.append(mlx_streaming.batch_generate(model, tokenizer, prompts,
                                                      max_tokens=12).texts)
            assert mlx_streaming.stats(model)["miss_bits"]["substituted"] > 0
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
    convert = [sys.executable, "-m", "mlx_streaming.convert", "--no-progress"]
    proc = subprocess.run(convert + ["--model", str(src), "--out", str(out), "--miss-bits", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    # Without --model: copies added to the directory alone.
    proc = subprocess.run(convert + ["--out", str(out), "--miss-bits", "3"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    after = json.loads((out / "experts" / "manifest.json").read_text())
    assert [c["bits"] for c in after["low_bits"]] == [2, 3]
    assert after["layers"] == before["layers"]  # the records are untouched
    # A missing blob of an unused width does not stop a load; adding that
    # width again writes it anew.
    q3 = out / "experts" / after["low_bits"][1]["layers"][0]["file"]
    q3.unlink()
    with mlx_streaming.load(out, slots_per_layer=6, miss_bits=2):
        pass
    with pytest.raises(mlx_streaming.errors.FormatError):
        mlx_streaming.load(out, slots_per_layer=6, miss_bits=3)
    proc = subprocess.run(convert + ["--out", str(out), "--miss-bits", "3"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert q3.is_file() and not damaged_records(out)
    for bad in (["-q", "--miss-bits", "4"],):
        proc = subprocess.run(convert + ["--model", str(src), "--out", str(tmp_path / "x"), *bad],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode != 0 and "--miss-bits" in proc.stderr, proc.stderr
        assert not (tmp_path / "x" / "experts" / "manifest.json").exists()


def _damage(path, spec, expert):
    """Flip a byte of one record of ``spec``'s blob."""
    with open(blob_path(path, spec), "r+b") as f:
        f.seek(spec.record_offset(expert) + spec.segments[0].offset)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_adding_copies_a_directory_holds_says_so(models, tmp_path, capsys):
    """Copies already there are left as they are, and said to be, with
    how to check them and how to write them again."""
    from mlx_streaming.conversion import command

    _, stream_dir = models.get("qwen3_moe", True)
    out = _with_copies(stream_dir, tmp_path)
    low = read_manifest(out).low_copies(2).layers[0]
    _damage(out, low, 1)
    assert command.main(["--out", str(out), "--miss-bits", "2,3", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "wrote the 3-bit copies" in err and "2,3-bit" not in err, err
    assert "holds the 2-bit copies already" in err and "mlx_streaming check" in err
    assert f"--out {out} --miss-bits 2 --force" in err
    assert damaged_records(out) == [(low.layer, 1)]
    assert command.main(["--out", str(out), "--miss-bits", "2", "--force", "--no-progress"]) == 0
    assert "wrote the 2-bit copies" in capsys.readouterr().err
    assert damaged_records(out) == []


def test_damaged_copies_are_named_as_copies_with_their_fix(models, tmp_path, capsys):
    """Damage to a copy says it is the B-bit copies and names the convert
    command that writes them again, not a whole re-conversion."""
    from mlx_streaming import check
    from mlx_streaming.conversion import command

    _, stream_dir = models.get("qwen3_moe", True)
    out = _with_copies(stream_dir, tmp_path)
    low = read_manifest(out).low_copies(2).layers[0]
    _damage(out, low, 1)
    assert check.main([str(out)]) == 1
    err = capsys.readouterr().err
    assert f"1 damaged 2-bit copies of expert records (convert --miss-bits): layer " \
        f"{low.layer} expert 1;" in err, err
    assert f"--out {out} --miss-bits 2 --force" in err and "re-convert" not in err
    # A truncated blob: `check` says so without pointing to itself.
    with open(blob_path(out, low), "r+b") as f:
        f.truncate(low.stride)
    assert check.main([str(out)]) == 1
    err = capsys.readouterr().err
    assert "blob of the 2-bit copies" in err and f"--out {out} --miss-bits 2`" in err, err
    assert "re-convert" not in err and "mlx_streaming check" not in err
    with pytest.raises(CorruptExpertError, match="blob of the 2-bit copies") as e:
        mlx_streaming.load(out, slots_per_layer=low.top_k, miss_bits=2)
    assert "re-convert" not in str(e.value) and f"--out {out} --miss-bits 2`" in str(e.value)
    blob_path(out, low).unlink()
    with pytest.raises(mlx_streaming.errors.FormatError, match="2-bit copies.* is missing") as e:
        mlx_streaming.load(out, slots_per_layer=low.top_k, miss_bits=2)
    assert "re-convert" not in str(e.value) and f"--out {out} --miss-bits 2`" in str(e.value)
    # The command named is enough.
    assert command.main(["--out", str(out), "--miss-bits", "2", "--no-progress"]) == 0
    assert check.main([str(out)]) == 0
    assert "and their 2-bit copies" in capsys.readouterr().out


def test_mtp_layers_run_with_miss_bits(models, tmp_path):
    """Copies are made for the model's layers; its MTP layers read in full."""
    _, stream = models.get("deepseek_v3", quantized=True, num_nextn_predict_layers=1)
    out = _with_copies(stream, tmp_path)
    spec = read_manifest(out).layers[0]
    model, tokenizer = mlx_streaming.load(out, slots_per_layer=spec.top_k + 1, mtp=True,
                                          miss_bits=2)
    proc_text = mlx_lm.generate(model, tokenizer, prompt="def f(x):", max_tokens=8)
    assert isinstance(proc_text, str)
    assert mlx_streaming.stats(model)["miss_bits"]["substituted"] > 0


def test_reservations_add_up():
    from types import SimpleNamespace

    from mlx_streaming.runtime.memory import MemoryPlan, reserved_plan

    spec = SimpleNamespace(expert_nbytes=100, num_experts=8, top_k=2, module="m")
    manifest = SimpleNamespace(layers=(spec,), mtp=None)
    plan = MemoryPlan(budget=2000, source="test", base=0, slots=8, pool=800, pinned=(),
                      streamed=(), ring_buffers=0, ring=0, pinned_bytes=0, usable=1000)
    once = reserved_plan(plan, manifest, 150, "a")
    assert once.slots == 8 and once.reserved == 150
    twice = reserved_plan(once, manifest, 150, "b")
    # 800 of pool + 300 reserved no longer fit in 1000: one slot goes.
    assert twice.reserved == 300 and twice.slots == 7


def test_which_misses_take_copies():
    from types import SimpleNamespace

    from mlx_streaming.runtime.low_bits import LowBitMisses

    store = SimpleNamespace(pool=SimpleNamespace(slots=2))
    probs = np.array([[0.5, 0.3, 0.15, 0.05, 0.0], [0.1, 0.2, 0.3, 0.1, 0.3]])
    # Each token routes 2 experts; expert 4 is the second token's most
    # probable one but not routed (a steered routing).
    ids = np.array([[0, 1], [2, 3]])
    missing = np.array([0, 1, 2, 3])
    # Shares of the routed weight: 0 0.625, 1 0.375, 2 0.75, 3 0.25.
    # Default: each token's weightiest routed expert (0, 2) read in full.
    assert LowBitMisses(store, None, None).choose(missing, ids, probs).tolist() == [1, 3]
    assert LowBitMisses(store, None, 0.3).choose(missing, ids, probs).tolist() == [3]
    # The least weighty first, as many as the scratch pool holds.
    assert LowBitMisses(store, None, 0.99).choose(missing, ids, probs).tolist() == [1, 3]
    assert LowBitMisses(store, None, None).choose(missing, ids, None).tolist() == [0, 1]


@pytest.mark.parametrize("damage", ["bits", "layers", "stride", "file", "ranks"])
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
    elif damage == "ranks":  # per-rank copies of a conversion that is not split
        entry["ranks"] = [entry["layers"], entry["layers"]]
    else:
        entry["layers"][0]["file"] = manifest["layers"][0]["file"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(FormatError):
        read_manifest(out)


def test_bench_quality_gives_miss_bits_the_same_memory(models, tmp_path, capsys):
    from mlx_streaming.bench.__main__ import main as bench_main

    _, stream_dir = models.get("qwen3_moe", True)
    out = _with_copies(stream_dir, tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("def read(path):\n    with open(path) as f:\n        return f.read()\n" * 20)
    assert bench_main(["quality", "--model", str(out), "--text", str(text), "--tokens", "32",
                       "--pool", "0.75", "--settings", "miss-bits:2,cache-aware:1:8+miss-bits:2",
                       "--out", str(tmp_path / "q")]) == 0
    rows = json.loads((tmp_path / "q" / "quality.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok"] * 3
    manifest = read_manifest(out)
    full, low = manifest.layers[0], manifest.low_copies(2).layers[0]
    scratch = -(-low.top_k * low.expert_nbytes // full.expert_nbytes)
    assert rows[1]["slots"] == rows[2]["slots"] == rows[0]["slots"] - scratch
    assert rows[1]["route_agreement"] == 1 and rows[1]["low_bit_share"] > 0
    assert bench_main(["quality", "--model", str(out), "--settings", "miss-bits:3",
                       "--out", str(tmp_path / "q3")]) == 1
    assert "no 3-bit copies" in capsys.readouterr().err


def test_bench_serve_gives_miss_bits_the_same_memory(models, tmp_path):
    """A served ``+miss-bits`` case gets bench quality's pool: the copies'
    scratch out of the same expert memory."""
    import argparse

    from mlx_streaming.bench import serve
    from mlx_streaming.bench.quality import equal_memory_slots

    _, stream_dir = models.get("qwen3_moe", True)
    manifest = read_manifest(_with_copies(stream_dir, tmp_path))
    args = argparse.Namespace(model=stream_dir, mlx_model=None, clients=[4], read_mbps=None,
                              decode_concurrency=4, cases=["batched", "batched+miss-bits:2"])
    (_, (_, plain)), (_, (_, low)) = serve._servers(args, 12, manifest).items()
    pool = equal_memory_slots(manifest, 12, 2)
    assert pool < 12 and plain[plain.index("--slots-per-layer") + 1] == "12"
    assert low[low.index("--slots-per-layer") + 1] == str(pool)
    assert low[low.index("--miss-bits") + 1] == "2"
