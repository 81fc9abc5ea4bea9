"""What the tests share: tiny models built once per session, the logits
trace and the exactness check against mlx-lm's resident model, the bytes of
a record or a pool slot, resharded and version-1 copies, the package's
commands and server run as a user runs them, and synthetic routing."""

import fcntl
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import Dict, Tuple

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import mlx_streaming
from mlx_streaming.bench.ranks import free_ports
from mlx_streaming.conversion.local import convert
from mlx_streaming.io.native import load_extension
from mlx_streaming.testing import tiny

# The native extension, when built; the reader paths to test with it.
EXT, WHY = load_extension()
IO_PATHS = ["python"] + (["native"] if EXT is not None else [])
# The tiny models' vocabulary, the tests' prompt (token ids in it) and how
# many greedy steps a logits trace takes after it.
VOCAB = 512
PROMPT = [1, 7, 42, 300, 5, 18, 99, 260, 3, 77, 150, 11, 480, 23, 64, 9] * 3
DECODE_STEPS = 32
# The experts of the synthetic routing workloads.
EXPERTS = 32


def logits_trace(model, prompt=PROMPT, steps: int = DECODE_STEPS):
    """Prefill logits of ``prompt`` (token ids), then those of ``steps``
    greedy decode steps."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([prompt]), cache=cache)[:, -1]]
    mx.eval(out[-1])
    for _ in range(steps):
        token = mx.argmax(out[-1], axis=-1, keepdims=True)
        out.append(model(token, cache=cache)[:, -1])
        mx.eval(out[-1])
    return out


def assert_same_logits(reference, streamed):
    assert len(reference) == len(streamed)
    for i, (r, s) in enumerate(zip(reference, streamed)):
        assert mx.array_equal(r, s).item(), f"logits differ at step {i}"


def greedy_text(model, tokenizer, max_tokens=16):
    return mlx_lm.generate(model, tokenizer, prompt=PROMPT[:12], max_tokens=max_tokens)


class ModelFactory:
    """Tiny models per (family, quantized, overrides), built once per test run:
    ``root`` may be shared by several test processes (pytest-xdist workers),
    each model built by the first that asks for it, under a file lock."""

    def __init__(self, root: Path, tokenizer_dir: Path):
        self.root = Path(root)
        self.tokenizer_dir = tokenizer_dir
        self._cache: Dict[Tuple[str, bool], Tuple[Path, Path]] = {}

    def get(self, family: str, quantized: bool, **overrides) -> Tuple[Path, Path]:
        key = (family, quantized, tuple(sorted(overrides.items())))
        if key not in self._cache:
            name = f"{family}-{'q4' if quantized else 'f32'}-{zlib.crc32(repr(key).encode()):08x}"
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / f"{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not (self.root / f"{name}.done").exists():
                    self._build(name, family, quantized, overrides)
                    (self.root / f"{name}.done").touch()
            self._cache[key] = (self.root / name, self.root / f"{name}-stream")
        return self._cache[key]

    def _build(self, name: str, family: str, quantized: bool, overrides: dict) -> None:
        for partial in (self.root / name, self.root / f"{name}-stream"):
            shutil.rmtree(partial, ignore_errors=True)  # a build that was interrupted
        config = tiny.tiny_config(family, VOCAB, **overrides)
        model = tiny.build_model(config)
        src = tiny.save_mlx_model(model, config, self.root / name, self.tokenizer_dir,
                                  quantize=quantized)
        if overrides.get("num_nextn_predict_layers"):
            tiny.add_mtp_weights(model, config, src, quantize=quantized)
        convert(src, self.root / f"{name}-stream", progress=False)


def pool_sizes(stream_dir: Path):
    """One call's minimum, half the experts, and all experts."""
    manifest = mlx_streaming.format.read_manifest(stream_dir)
    spec = manifest.layers[0]
    return [spec.top_k, spec.num_experts // 2, spec.num_experts]


def check_matches_resident(src: Path, stream_dir: Path, **load_kwargs):
    """The streamed model's prefill and decode logits are bit-identical to
    mlx-lm's resident model, and greedy generation gives the same text."""
    reference, ref_tok = mlx_lm.load(str(src))
    with mlx_streaming.load(stream_dir, **load_kwargs) as (model, tokenizer):
        assert_same_logits(logits_trace(reference), logits_trace(model))
        assert greedy_text(model, tokenizer) == greedy_text(reference, ref_tok)
    return model


def record_bytes(stream_dir: Path, layer_spec, expert: int) -> bytes:
    path = Path(stream_dir) / "experts" / layer_spec.file
    with open(path, "rb") as f:
        f.seek(expert * layer_spec.stride)
        return f.read(layer_spec.stride)


def pool_bytes(store, expert: int) -> bytes:
    slot = int(store.pool.slot_of_expert[expert])
    return b"".join(np.asarray(v[slot]).tobytes() for v in store.pool.views)


def reshard(src: Path, dst: Path, max_bytes: int) -> Path:
    """A copy of the mlx-lm model ``src`` whose weights are split into
    shards of at most ``max_bytes`` (as a large model's are)."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(
        "*.safetensors", "model.safetensors.index.json"))
    weights = {}
    for f in sorted(src.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    shards, current, size = [], {}, 0
    for name in sorted(weights):
        if current and size + weights[name].nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = weights[name]
        size += weights[name].nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(dst / name), shard, metadata={"format": "mlx"})
        weight_map.update({k: name for k in shard})
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def downgrade_to_v1(stream_dir: Path, out: Path) -> Path:
    """A copy of a version-2 stream directory in version 1's layout: the
    dense records' tensors back in the spine safetensors, no ``spine/``."""
    from mlx_streaming.format import (
        dense_path,
        dtype_from_name,
        manifest_path,
        manifest_to_dict,
        read_manifest,
        spine_manifest,
    )

    stream_dir, out = Path(stream_dir), Path(out)
    shutil.copytree(stream_dir, out, ignore=shutil.ignore_patterns("spine"))
    manifest = read_manifest(stream_dir)
    weights = {}
    for f in sorted(out.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
        f.unlink()
    for d in manifest.dense:
        record = np.fromfile(dense_path(stream_dir, d), dtype=np.uint8)
        for s in d.segments:
            raw = mx.array(record[s.offset:s.offset + s.nbytes])
            weights[f"{d.prefix}.{s.name}"] = raw.view(dtype_from_name(s.dtype)).reshape(s.shape)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    d = manifest_to_dict(manifest)
    d["version"] = 1
    d.pop("dense", None)
    d["spine"] = [dict(name=s.name, nbytes=s.nbytes, crc32=s.crc32) for s in spine_manifest(out)]
    manifest_path(out).write_text(json.dumps(d))
    return out


def count_splits(monkeypatch) -> list:
    """The token count of each call that overlap split (``Paged._split``),
    appended as the calls run."""
    from mlx_streaming.runtime.block import Paged

    split, original = [], Paged._split

    def counted(self, inner, x, indices, *args):
        split.append(indices.size // indices.shape[-1])
        return original(self, inner, x, indices, *args)

    monkeypatch.setattr(Paged, "_split", counted)
    return split


def run(*args, check_ok=True):
    """``python -m *args``, checked to succeed unless ``check_ok`` is false."""
    proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=600)
    if check_ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def assert_one_line_error(proc, pattern):
    """``proc`` failed with one line that says what went wrong (matching
    ``pattern``), never a traceback."""
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: "), proc.stderr
    assert re.search(pattern, lines[-1]), lines[-1]


def free_port() -> int:
    (port,) = free_ports(1)
    return port


class Server:
    """``python -m mlx_streaming.server`` (or ``mlx_lm server``) on a free
    port, ready to answer: its URL, an ``openai`` client and its log."""

    def __init__(self, stream_dir, *flags, module="mlx_streaming.server"):
        self.port = free_port()
        command = ["mlx_lm", "server"] if module == "mlx_lm" else [module]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *command, "--model", str(stream_dir),
             "--port", str(self.port), *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        import openai  # a test dependency: only a test starts a Server

        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        # Read stderr as it comes: the server logs a request after replying.
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read_stderr, daemon=True)
        self.reader.start()

    def _read_stderr(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for_log(self, text: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in list(self.lines)):
            assert time.monotonic() < deadline and self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.05)

    def post(self, path, body, raw: bytes = None):
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, dict(r.headers), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read())

    def stop(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=30)
        return "".join(self.lines)


def recency_calls(n: int, seed: int = 0) -> list:
    """A working set that drifts: each call's 4 experts come from a window
    of 6 that moves one expert every 3 calls (old favourites never return)."""
    rng = np.random.default_rng(seed)
    return [np.sort((t // 3 + rng.choice(6, 4, replace=False)) % EXPERTS) for t in range(n)]


def frequency_calls(n: int, seed: int = 0) -> list:
    """A hot set of 6 experts, 3 of each call's 4, and one cold expert each
    call (a one-off that LRU keeps in place of a hot one)."""
    rng = np.random.default_rng(seed)
    hot = np.arange(6)
    return [np.sort(np.concatenate([rng.choice(hot, 3, replace=False),
                                    [6 + (7 * t) % (EXPERTS - 6)]])) for t in range(n)]
