"""Hostile input: each failure a new user met, reproduced, and now either
exact output or one line that says what to do (issue 8)."""

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_streaming
from mlx_streaming.runtime import memory as budget
from mlx_streaming.config import StreamConfig
from mlx_streaming.conversion.local import convert
from mlx_streaming.errors import (
    BudgetError,
    ConfigError,
    ConversionError,
    CorruptExpertError,
    FormatError,
)
from mlx_streaming.format import manifest_path, read_manifest
from helpers import PROMPT, check_matches_resident, logits_trace
from test_cli import assert_one_line_error, run


def tree_digest(path: Path) -> dict:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


def edit_manifest(stream_dir: Path, edit) -> None:
    d = json.loads(manifest_path(stream_dir).read_text())
    edit(d)
    manifest_path(stream_dir).write_text(json.dumps(d))


@pytest.fixture
def src_copy(tmp_path, qwen):
    dst = tmp_path / "src"
    shutil.copytree(qwen[0], dst)
    return dst


# -- convert never destroys data -------------------------------------------------

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
    assert blobs == [l.file for l in read_manifest(dst).layers]
    assert not (dst / "chat_template.jinja").exists()
    check_matches_resident(small, dst, slots_per_layer=2)


# -- disk errors and damaged sources during convert ---------------------------

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


# -- damaged stream directories ---------------------------------------------

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
    from mlx_streaming.io.native import NativeReader, load_extension
    from mlx_streaming.errors import ExpertReadError

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


# -- verification -----------------------------------------------------------

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
        with open(blob, "r+b") as f:  # rewritten in place: same inode
            for e in range(spec.num_experts):
                f.seek(e * spec.stride + 3)
                f.write(b"\x5a\xa5")
    with pytest.raises(CorruptExpertError, match="checksum mismatch"):
        for step in range(1, 13):
            token = mx.argmax(out, axis=-1, keepdims=True)
            out = model(token, cache=cache)[:, -1]
            assert mx.array_equal(out, reference[step]).item(), f"wrong logits at {step}"


# -- options and command lines -----------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--cache-gb", "0"], "cache_gb must be above 0"),
    (["--cache-gb", "-1"], "cache_gb must be above 0"),
    (["--cache-gb", "nan"], "cache_gb must be a finite number"),
    (["--cache-gb", "inf"], "cache_gb must be a finite number"),
    (["--slots-per-layer", "0"], "slots_per_layer must be between 1 and"),
    (["--slots-per-layer", "-3"], "slots_per_layer must be between 1 and"),
    (["--io-threads", "0"], "io_threads must be between 1 and 64"),
    (["--io-threads", "100000"], "io_threads must be between 1 and 64"),
    (["--prefetch-records", "-1"], "prefetch_records must be between 0 and 65536"),
    (["--max-tokens", "-5"], "--max-tokens: must be an integer from 1"),
    (["--max-tokens", "0"], "--max-tokens: must be an integer from 1"),
    (["--temp", "1e-38"], "--temp: must be 0 \\(greedy\\) or at least 0.001"),
    (["--temp", "-1"], "--temp: must be a finite number at least 0"),
    (["--top-p", "0"], "--top-p: must be a finite number above 0"),
    (["--num-draft-tokens", "0"], "--num-draft-tokens: must be an integer from 1 to 64"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--prompt", ""], "prompt is empty"),
    (["--seed", str(10**30)], "--seed: must be an integer from 0"),
    (["--trace", "/"], "cannot write the trace to /"),
    (["--stats-json", "/", "--max-tokens", "2"], "cannot write --stats-json /"),
    # A directory where nothing can be made (as root, only such a one refuses).
    (["--stats-json", "/proc/s.json"], "cannot write --stats-json /proc/s.json"),
])
def test_bad_flags_are_one_line_errors(qwen, flags, message):
    proc = run("mlx_streaming.generate", "--model", str(qwen[1]), *flags, check_ok=False)
    assert_one_line_error(proc, message)


def test_config_errors_are_value_errors_and_streaming_errors():
    for bad in (dict(cache_gb=float("nan")), dict(io_threads=10**5), dict(checksums="sometimes"),
                dict(policy="mru"), dict(prefetch_records=-1),
                dict(slots_per_layer=2.5), dict(direct_io="yes"), dict(direct_io=1),
                dict(overlap=1), dict(mtp=0), dict(prefetch_affinity="on"),
                dict(read_pace_mbps=0.001), dict(read_pace_mbps=-1.0),
                dict(read_pace_mbps=1e12)):
        with pytest.raises(ConfigError):
            StreamConfig(**bad)
    assert issubclass(ConfigError, ValueError)


def test_numpy_numbers_are_accepted_and_stored_as_python_numbers():
    import numpy as np

    config = StreamConfig(prefetch_precision=np.float32(0.5), slots_per_layer=np.int64(4),
                          cache_gb=2)
    assert (config.prefetch_precision, config.slots_per_layer, config.cache_gb) == (0.5, 4, 2.0)
    assert type(config.prefetch_precision) is float and type(config.slots_per_layer) is int
    for bad in (dict(prefetch_precision=True), dict(prefetch_precision=np.bool_(True)),
                dict(slots_per_layer=np.float64(3)), dict(prefetch_precision=np.float32(1.5)),
                dict(cache_gb=10**400), dict(slots_per_layer=10**400)):  # not OverflowError
        with pytest.raises(ConfigError):
            StreamConfig(**bad)


def test_load_takes_mlx_lm_load_arguments(qwen):
    model, tokenizer, config = mlx_streaming.load(str(qwen[1]), None, None, None, False, True,
                                                  slots_per_layer=4)
    assert config["model_type"] == "qwen3_moe"
    with pytest.raises(ConfigError, match="adapter_path"):
        mlx_streaming.load(qwen[1], adapter_path="adapters")
    with pytest.raises(ConfigError, match="unknown option 'cache_size'"):
        mlx_streaming.load(qwen[1], cache_size=3)


def test_sigint_during_start_up_is_one_line(qwen):
    import signal

    for delay in (0.15, 0.4, 0.8, 1.5):
        proc = subprocess.Popen([sys.executable, "-m", "mlx_streaming.generate", "--model",
                                 str(qwen[1]), "--max-tokens", "50"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert "Traceback" not in err, f"after {delay} s:\n{err}"
        # 130: our handler's exit; -SIGINT: Python re-raising the signal at exit.
        assert proc.returncode in (0, 130, -signal.SIGINT), (proc.returncode, err)


@pytest.mark.parametrize("leave", [True, False])
def test_sigint_while_the_interpreter_exits_ends_it_quietly(leave):
    # A Ctrl-C that lands after a command's work, while Python joins its
    # threads at exit, printed a traceback (seen in CI); ``leave`` ends the
    # process without the interpreter's teardown: at once, quietly, with its
    # status.
    # The thread holds the exit open so that the interrupt lands there.
    import signal

    code = ("import sys, threading, time\n"
            "from mlx_streaming.cli import leave\n"
            "threading.Thread(target=time.sleep, args=(1.5,)).start()\n"
            "print('exiting', flush=True)\n"
            + ("leave(0)\n" if leave else "sys.exit(0)\n"))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "exiting\n"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if leave:
        assert (proc.returncode, err) == (0, "")
    else:  # the case ``leave`` exists for: the test can tell them apart
        assert "Traceback" in err and "KeyboardInterrupt" in err


# -- paths and names ----------------------------------------------------------

def test_tilde_paths_are_expanded(tmp_path, qwen, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    dst = convert(qwen[0], "~/models/q", progress=False)
    assert Path(dst) == tmp_path / "models" / "q"
    assert not Path("~").exists()
    model, _ = mlx_streaming.load("~/models/q", slots_per_layer=4)
    model.streaming.close()
    proc = run("mlx_streaming.check", "~/models/q")
    assert "match their checksums" in proc.stdout


def test_importing_the_convert_module_keeps_convert_callable(tmp_path, qwen):
    script = f"""
import mlx_streaming.convert
import mlx_streaming
out = mlx_streaming.convert({str(qwen[0])!r}, {str(tmp_path / 's')!r}, progress=False)
print(mlx_streaming.format.read_manifest(out).layers[0].file)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "layer000.blob"


# -- memory --------------------------------------------------------------------

def test_explicit_pool_beyond_available_memory_is_refused(qwen):
    manifest = read_manifest(qwen[1])
    per_slot = budget.bytes_per_slot(manifest)
    spine = 10_000
    dense = sum(d.nbytes for d in manifest.dense)  # fits beside the pool: stays resident
    # A quarter of what is available stays free for the rest of the process.
    available = lambda: int((spine + dense + 6 * per_slot) / 0.75) + 100  # noqa: E731
    plan = lambda config: budget.plan_memory(manifest, config, spine, available)  # noqa: E731
    assert plan(StreamConfig(slots_per_layer=6)).slots == 6
    # Refused, naming the most slots that fit and leave that room; that
    # number loads.
    with pytest.raises(BudgetError, match=r"can go to the model .*: use "
                                          r"--slots-per-layer (\d+) ") as e:
        plan(StreamConfig(slots_per_layer=8))
    most = int(str(e.value).split("--slots-per-layer ")[1].split()[0])
    assert 4 <= most < 8
    assert plan(StreamConfig(slots_per_layer=most)).total <= available() * 3 / 4
    # cache_gb covers the spine too: the advice is what is available, less
    # the same room.
    with pytest.raises(BudgetError, match=r"can go to the model .*: use --cache-gb 0\.000\d+ or") as e:
        plan(StreamConfig(cache_gb=(spine + dense + 8 * per_slot) / 1e9))
    advised = float(str(e.value).split("--cache-gb ")[1].split()[0])
    assert available() * 0.74 < advised * 1e9 <= available() * 3 / 4
    assert plan(StreamConfig(cache_gb=advised)).total <= available() * 3 / 4


def test_prefetchs_staging_area_is_in_the_memory_plan(qwen):
    """The staging area comes out of the budget: a cache_gb that holds n
    slots per layer without prefetch holds fewer with it, the plan's total
    stays within the budget, and the loaded model's staging is the size the
    plan counted. With every expert resident there is nothing to stage."""
    manifest = read_manifest(qwen[1])
    per_slot = budget.bytes_per_slot(manifest)
    spine = 10_000
    dense = sum(d.nbytes for d in manifest.dense)
    plan = lambda **kw: budget.plan_memory(  # noqa: E731
        manifest, StreamConfig(**kw), spine, lambda: 1 << 40)
    records, stride = budget.staging_shape(manifest, StreamConfig(prefetch="next-layer"))
    staged_slots = math.ceil(records * stride / per_slot)  # slots the staging costs
    n = budget.min_slots(manifest) + staged_slots + 1
    assert n < budget.max_slots(manifest)
    off = plan(cache_gb=(spine + dense + n * per_slot) / 1e9)
    on = plan(cache_gb=(spine + dense + n * per_slot) / 1e9, prefetch="next-layer")
    assert off.slots == n and off.staging == 0
    assert on.staging == records * stride > 0
    assert on.slots == n - staged_slots
    assert on.total <= on.budget
    everything = budget.max_slots(manifest)
    assert plan(cache_gb=1e3, prefetch="next-layer").slots == everything
    assert plan(cache_gb=1e3, prefetch="next-layer").staging == 0
    # An explicit pool is as asked; the staging is added to what it needs.
    asked = plan(slots_per_layer=4, prefetch="next-layer")
    assert asked.staging == on.staging
    assert asked.total == plan(slots_per_layer=4).total + on.staging

    model, _ = mlx_streaming.load(qwen[1], slots_per_layer=4, prefetch="next-layer")
    runtime = model.streaming
    try:
        assert runtime.plan.staging == on.staging
        assert mlx_streaming.stats(model)["memory"]["staging_gb"] == on.staging / 1e9
    finally:
        runtime.close()


def test_what_loads_in_a_small_cgroup_runs(tmp_path, tokenizer_dir):
    """In a 0.5 GB memory cgroup, 0.8 GB of experts: a size that would eat
    into what the rest of the process needs is refused, naming the number
    that fits (once, --cache-gb 0.44 on a 0.77 GB model loaded and was
    killed); the sizes advised, and the defaults, load and run without a
    kill and without the pools shrinking at once (the advice left nothing
    for the pressure bar)."""
    from mlx_streaming.testing import synthetic
    from mlx_streaming.bench.common import BenchError, MemoryLimit

    stream = synthetic.make_synthetic(
        tmp_path / "big", tokenizer_dir, hidden_size=1024, num_hidden_layers=2,
        num_experts=64, num_experts_per_tok=2, moe_intermediate_size=4096)
    assert read_manifest(stream).expert_nbytes > 0.8e9
    try:
        limit = MemoryLimit(0.5)
    except BenchError as e:
        pytest.skip(str(e))

    def generate(*flags):
        proc = subprocess.run(
            [sys.executable, "-m", "mlx_streaming.generate", "--model", str(stream),
             "--max-tokens", "24", *flags],
            capture_output=True, text=True, preexec_fn=limit.enter, timeout=300)
        assert limit.oom_kills() == 0, proc.stderr
        return proc

    try:
        refused = generate("--slots-per-layer", "64")
        assert_one_line_error(refused, r"slots_per_layer=64 needs .* use --slots-per-layer \d+")
        most = refused.stderr.split("--slots-per-layer ")[-1].split()[0]
        refused = generate("--cache-gb", "0.44")
        assert_one_line_error(refused, r"cache_gb=0.44 needs .* use --cache-gb [\d.]+ or less")
        advised = refused.stderr.split("--cache-gb ")[-1].split()[0]
        for flags in (["--slots-per-layer", most], ["--cache-gb", advised], []):
            proc = generate(*flags)
            assert proc.returncode == 0, (flags, proc.stderr)
            assert "pools shrink" not in proc.stderr, (flags, proc.stderr)
    finally:
        limit.close()


def test_the_spine_ring_shrinks_to_one_before_a_refusal(qwen):
    """A model whose streamed spine fits with a ring of one buffer and not
    two loads with the defaults (the ring shrinks); asked for two, it is
    refused."""
    manifest = read_manifest(qwen[1])
    base = 10_000
    largest = max(d.nbytes for d in manifest.dense)
    least_one = base + largest + budget.min_slots(manifest) * budget.bytes_per_slot(manifest)
    available = lambda: int(least_one / 0.75) + 100  # noqa: E731 (a quarter is headroom)
    plan = budget.plan_memory(manifest, StreamConfig(), base, available)
    assert plan.ring_buffers == 1 and plan.streamed
    with pytest.raises(BudgetError, match="the model needs at least"):
        budget.plan_memory(manifest, StreamConfig(spine_ring=2), base, available)
    assert budget.plan_memory(manifest, StreamConfig(spine_ring=1), base,
                              available).ring_buffers == 1


# -- install without the native extension --------------------------------------

def test_failed_native_build_leaves_a_working_install(tmp_path, monkeypatch, capsys):
    import runpy

    from setuptools import Distribution

    root = Path(__file__).resolve().parents[1]
    setup = runpy.run_path(str(root / "setup.py"), run_name="setup_under_test")
    ext = setup["CMakeExtension"]("mlx_streaming._ext", tmp_path / "no-native-sources")
    # optional: an editable install then skips copying the missing library.
    assert ext.optional
    cmd = setup["CMakeBuild"](Distribution({"name": "mlx_streaming", "ext_modules": [ext]}))
    cmd.build_lib, cmd.build_temp = str(tmp_path / "lib"), str(tmp_path / "tmp")
    cmd.ensure_finalized()
    monkeypatch.delenv("MLX_STREAMING_REQUIRE_NATIVE", raising=False)
    cmd.build_extension(ext)  # a failed build is a warning, not a failed install
    assert "native extension failed to build" in capsys.readouterr().err
    monkeypatch.setenv("MLX_STREAMING_REQUIRE_NATIVE", "1")
    with pytest.raises(Exception):
        cmd.build_extension(ext)


def test_without_the_extension_load_warns_and_reads_in_python(qwen, monkeypatch):
    import mlx_streaming.io.choice as loader

    monkeypatch.setattr(loader, "load_extension", lambda: (None, "not built (no compiler)"))
    with pytest.warns(RuntimeWarning, match="not built .*slower Python reader"):
        model, _ = mlx_streaming.load(qwen[1], slots_per_layer=4)
    assert mlx_streaming.stats(model)["io"] == "python"
    assert "not built" in mlx_streaming.stats(model)["io_reason"]
    check_matches_resident(qwen[0], qwen[1], slots_per_layer=4, io="python")


# -- found by a hostile probe of the command line and load() ------------------

@pytest.mark.parametrize("damage", ["no config", "bad config", "no tokenizer"])
def test_a_stream_directory_missing_its_config_or_tokenizer_is_one_line(stream_copy, damage,
                                                                       monkeypatch):
    if damage == "no config":
        (stream_copy / "config.json").unlink()
    elif damage == "bad config":
        (stream_copy / "config.json").write_text("{garbage")
    else:
        (stream_copy / "tokenizer.json").unlink()
    match = "tokenizer" if damage == "no tokenizer" else "config.json"

    def never(*args):
        raise AssertionError("the runtime was built before the tokenizer was checked")

    with monkeypatch.context() as m:
        m.setattr("mlx_streaming.runtime.loader._build_runtime", never)  # known before the weights
        with pytest.raises(FormatError, match=match):
            mlx_streaming.load(stream_copy, slots_per_layer=4)
    proc = run("mlx_streaming.generate", "--model", str(stream_copy), "--max-tokens", "2",
               check_ok=False)
    assert_one_line_error(proc, match)


def test_a_manifest_entry_naming_another_layers_module_is_refused(stream_copy):
    """Its experts would run in the other layer: wrong output, checksums fine."""
    path = manifest_path(stream_copy)
    manifest = json.loads(path.read_text())
    first, second = manifest["layers"][:2]
    first["module"], second["module"] = second["module"], first["module"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="is not in layer"):
        mlx_streaming.load(stream_copy, slots_per_layer=4)


def test_trace_must_be_a_path_outside_the_model(qwen):
    for bad in (True, "", 5):
        with pytest.raises(ConfigError, match="trace must be a file path"):
            StreamConfig(trace=bad)
    assert StreamConfig(trace="~/t.jsonl").trace == os.path.expanduser("~/t.jsonl")
    blob = qwen[1] / "experts" / read_manifest(qwen[1]).layers[0].file
    before = blob.stat().st_size
    with pytest.raises(ConfigError, match="model's own directory"):
        mlx_streaming.load(qwen[1], trace=str(blob))
    assert blob.stat().st_size == before


def test_load_refuses_arguments_of_the_wrong_kind(qwen):
    with pytest.raises(ConfigError, match="model_config must be a dict"):
        mlx_streaming.load(qwen[1], model_config="x")
    with pytest.raises(ConfigError, match="config must be a StreamConfig"):
        mlx_streaming.load(qwen[1], config={"slots_per_layer": 4})


def test_odd_prompts_and_outputs_are_one_line_or_quiet(qwen, tmp_path):
    stream = str(qwen[1])
    proc = run("mlx_streaming.generate", "--model", stream, "--max-tokens", "2", "--prompt",
               os.fsdecode(b"\xff\xfe abc"), check_ok=False)  # not UTF-8: surrogates
    assert_one_line_error(proc, "not valid UTF-8")
    proc = run("mlx_streaming.generate", "--model", stream, "--max-tokens", "2",
               "--stats-json", str(tmp_path / "missing" / "s.json"), check_ok=False)
    assert_one_line_error(proc, "cannot write --stats-json")
    assert "tok/s" not in proc.stderr  # refused before generating
    # The reader of the output leaves (``| head``): a quiet stop.
    gen = subprocess.Popen([sys.executable, "-m", "mlx_streaming.generate", "--model", stream,
                            "--max-tokens", "50"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    gen.stdout.close()
    err = gen.stderr.read()
    assert gen.wait(300) == 141 and "Traceback" not in err and "Exception" not in err, err


def test_converting_a_stream_directory_or_one_without_a_tokenizer_says_so(qwen, tmp_path,
                                                                           capsys):
    with pytest.raises(ConversionError, match="already a stream directory"):
        convert(qwen[1], tmp_path / "again")
    src = tmp_path / "src"
    shutil.copytree(qwen[0], src)
    for f in ("tokenizer.json", "tokenizer.model", "vocab.json"):
        (src / f).unlink(missing_ok=True)
    convert(src, tmp_path / "out")
    assert "has no tokenizer vocabulary" in capsys.readouterr().err
    (src / "tekken.json").write_text("{}")  # Mistral's: a vocabulary, no warning
    convert(src, tmp_path / "out2")
    assert "tokenizer vocabulary" not in capsys.readouterr().err
