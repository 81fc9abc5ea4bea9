"""Convert an mlx-lm MoE model into a stream directory.

    python -m mlx_streaming.convert --model SRC --out DST [-q --q-bits 4 --q-group-size 64]

The model is loaded lazily and written one MoE layer at a time, so the peak
memory is about one layer's experts (plus one spine shard), not the model.
A conversion that is killed never leaves a directory that loads: the
manifest is written last, atomically. Running the same command again keeps
the layers that were finished and redoes the rest.
"""

import argparse
import errno
from dataclasses import asdict
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.utils import load_model, make_shards, quantize_model, save_config

from .discover import (
    find_expert_blocks,
    get_module,
    input_dims_of,
    layer_index,
    layers_path,
    num_experts,
    parent_path,
    probe_top_k,
    quantization_of,
    router_paths,
)
from . import mtp
from .errors import ConversionError, FormatError, first_line
from .format import (
    DenseSpec,
    MtpSpec,
    spine_dir,
    SpineFile,
    file_crc32,
    CONVERT_STATE_NAME,
    MANIFEST_NAME,
    FORMAT_VERSION,
    LayerSpec,
    Manifest,
    dtype_name,
    experts_dir,
    fsync_path,
    layer_from_dict,
    layout_record,
    VOCABULARY_FILES,
    has_vocabulary,
    manifest_path,
    check_safetensors,
    record_checksum,
    spine_manifest,
    write_json_atomic,
    write_manifest,
)

SPINE_SHARD_GB = 1
# Fallback only: the number is read off the model itself (probe_top_k).
TOP_K_KEYS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_top_k",
    "n_activated_experts",
    "experts_per_token",
    "top_k",
    "moe_k",
    "moe_topk",
    "top_k_experts",
)
TOKENIZER_PATTERNS = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.jsonl")
SKIP_FILES = {"config.json", "model.safetensors.index.json", CONVERT_STATE_NAME}
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def resolve_source(src: str) -> Path:
    """A local model directory, or a Hugging Face repo fetched into the cache."""
    path = Path(src).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ConversionError(f"{src} has no config.json; it is not an mlx-lm model")
        if manifest_path(path).exists():
            raise ConversionError(f"{src} is already a stream directory: load or generate "
                                  "from it; convert takes the mlx-lm or Hub model")
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                src, allow_patterns=["*.safetensors", *TOKENIZER_PATTERNS, "*.py"]
            )
        )
    except Exception as e:
        raise ConversionError(
            f"{src} is not a local directory and could not be fetched from the "
            f"Hugging Face Hub ({type(e).__name__}); check the path or the network"
        ) from None


def find_top_k(model, block_path: str, block, config: dict) -> int:
    """Experts per token of one block: read off the model (its router's
    output), else from the config's usual keys."""
    text = config.get("text_config") or {}
    widths = (input_dims_of(block), config.get("hidden_size"), text.get("hidden_size"))
    top_k = probe_top_k(model, block_path, widths)
    if top_k is not None:
        return top_k
    for cfg in (config, text):
        for key in TOP_K_KEYS:
            if isinstance(cfg.get(key), int):
                return cfg[key]
    raise ConversionError(
        f"cannot tell how many experts a token uses in {block_path}: its MoE module "
        f"could not be probed and config.json has none of {', '.join(TOP_K_KEYS)}"
    )


def _fingerprint(src: Path, options: dict) -> str:
    h = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    for f in sorted(src.glob("*.safetensors")) + [src / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _cast(model, dtype) -> None:
    def cast(p):
        return p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p

    model.update(tree_map(cast, model.parameters()))


class _State:
    """Finished layers of an interrupted conversion (``DST/.convert-state.json``)."""

    def __init__(self, dst: Path, fingerprint: str):
        self.path = dst / CONVERT_STATE_NAME
        self.fingerprint = fingerprint
        self.layers: Dict[str, dict] = {}
        saved = _read_json(self.path)
        if saved.get("fingerprint") == fingerprint and isinstance(saved.get("layers"), dict):
            self.layers = saved["layers"]

    def start(self) -> None:
        """Mark the directory as this conversion's before anything is written."""
        write_json_atomic(self.path, {"fingerprint": self.fingerprint, "layers": self.layers})

    def done(self, file: str, dst: Path) -> Optional[LayerSpec]:
        d = self.layers.get(file)
        if d is None:
            return None
        try:
            spec = layer_from_dict(d)
        except Exception:
            return None  # a damaged state entry: redo the layer
        blob = experts_dir(dst) / file
        if not blob.exists() or blob.stat().st_size != spec.blob_nbytes:
            return None
        return spec

    def record(self, spec: LayerSpec) -> None:
        self.layers[spec.file] = asdict(spec)
        write_json_atomic(self.path, {"fingerprint": self.fingerprint, "layers": self.layers})


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``, or {} when it is missing or damaged."""
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _expert_tensors(block, num: int):
    """The per-expert tensors of a block (leading axis = experts) and the
    rest (kept in the spine)."""
    experts, rest = [], []
    for name, value in tree_flatten(block.parameters()):
        (experts if value.ndim >= 1 and value.shape[0] == num else rest).append((name, value))
    return experts, rest


def _write_blob(path: Path, views, stride: int, segments, progress) -> List[int]:
    """Write one record per expert; returns the record checksums."""
    checksums = []
    tmp = path.with_name(path.name + ".tmp")
    record = np.zeros(stride, dtype=np.uint8)
    with open(tmp, "wb") as f:
        for e in range(len(views[0])):
            for seg, view in zip(segments, views):
                record[seg.offset : seg.offset + seg.nbytes] = view[e]
            checksums.append(
                record_checksum(record[s.offset : s.offset + s.nbytes] for s in segments)
            )
            f.write(record.data)
            progress(1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return checksums


def write_layer(dst: Path, module_path: str, layer: int, file: str, block, top_k: int,
                tensors, progress=lambda n: None) -> LayerSpec:
    """Write the blob of one expert block and return its manifest entry.

    ``tensors``: ``(name, dtype name, per-expert shape, bytes)`` for each
    per-expert tensor, ``bytes`` a ``[num_experts, nbytes]`` uint8 array.
    """
    views = [v for *_, v in tensors]
    layout = [(name, dtype, shape, v.shape[1]) for name, dtype, shape, v in tensors]
    segments, stride = layout_record(layout)
    checksums = _write_blob(experts_dir(dst) / file, views, stride, segments, progress)
    return LayerSpec(
        layer=layer,
        module=module_path,
        kind=type(block).__name__,
        file=file,
        num_experts=len(views[0]),
        top_k=top_k,
        stride=stride,
        segments=segments,
        quantization=quantization_of(block),
        checksums=tuple(checksums),
    )


def _convert_layer(block, path, layer, file, top_k, dst: Path, progress) -> LayerSpec:
    num = num_experts(block)
    tensors, _ = _expert_tensors(block, num)
    mx.eval([t for _, t in tensors])
    # [E, nbytes] byte views of each tensor (bfloat16 has no numpy dtype).
    tensors = [
        (name, dtype_name(t.dtype), t.shape[1:],
         np.array(t.reshape(num, -1).view(mx.uint8), copy=False))
        for name, t in tensors
    ]
    return write_layer(dst, path, layer, file, block, top_k, tensors, progress)


def _write_spine(model, streamed: set, dst: Path) -> None:
    spine = {k: v for k, v in tree_flatten(model.parameters()) if k not in streamed}
    for old in dst.glob("model*.safetensors"):
        old.unlink()
    shards = make_shards(spine, max_file_size_gb=SPINE_SHARD_GB)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for name, shard in zip(names, shards):
        tmp = dst / (name + ".tmp.safetensors")
        try:
            mx.save_safetensors(str(tmp), shard, metadata={"format": "mlx"})
        except RuntimeError as e:  # MLX reports a failed write this way
            raise ConversionError(
                f"cannot write {tmp} ({e}); check that the disk has room and is writable"
            ) from None
        fsync_path(tmp)
        os.replace(tmp, dst / name)
        weight_map.update({k: name for k in shard})
        # Free the shard's evaluated tensors before the next one.
        model.update(tree_unflatten([(k, mx.array([])) for k in shard]))
    total = sum(v.nbytes for v in spine.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for pattern in TOKENIZER_PATTERNS:
        for f in src.glob(pattern):
            if f.name not in SKIP_FILES and f.is_file():
                shutil.copyfile(f, dst / f.name)


def _fsync_written(dst: Path) -> None:
    """Everything the manifest will declare complete is on disk first."""
    for pattern in (*TOKENIZER_PATTERNS, "*.safetensors"):
        for f in dst.glob(pattern):
            if f.is_file():
                fsync_path(f)
    fsync_path(dst)


def _clear_dst(dst: Path) -> None:
    """Remove what ``--force`` replaces in a stream or mlx-lm model
    directory: blobs and manifest, spine and index, config, and every file
    of the tokenizer patterns (``*.json``, ``*.txt``, ``*.model``, ...), since
    a stale one would be the new model's. Other files stay."""
    # The manifest goes first: from here on the directory never looks complete.
    manifest_path(dst).unlink(missing_ok=True)
    experts = experts_dir(dst)
    if experts.is_dir():
        for f in experts.iterdir():
            if f.is_file() and (f.suffix in (".blob", ".tmp") or f.name == MANIFEST_NAME):
                f.unlink()
        if not any(experts.iterdir()):
            experts.rmdir()
    if spine_dir(dst).is_dir():
        shutil.rmtree(spine_dir(dst))
    names = {"model.safetensors.index.json", CONVERT_STATE_NAME, "config.json"}
    for pattern in (*TOKENIZER_PATTERNS, "model*.safetensors", "*.tmp*"):
        names.update(f.name for f in dst.glob(pattern) if f.is_file())
    for name in names:
        (dst / name).unlink(missing_ok=True)
    fsync_path(dst)


def _check_not_source(src: Path, dst: Path) -> None:
    if dst.exists() and os.path.samefile(src, dst):
        raise ConversionError(
            f"--out {dst} is the source model itself: converting in place would "
            "replace its weights; choose another --out"
        )


def _dst_state(dst: Path, fingerprint: str) -> str:
    """What ``dst`` holds: ``"done"`` (this conversion), ``"resume"`` (this
    conversion, interrupted), ``"empty"``, ``"stream"`` (another converted
    or interrupted model), ``"model"`` (an mlx-lm model) or ``"foreign"``."""
    if not dst.exists():
        return "empty"
    if manifest_path(dst).is_file():
        source = _read_json(manifest_path(dst)).get("source")
        done = isinstance(source, dict) and source.get("fingerprint") == fingerprint
        return "done" if done else "stream"
    if (dst / CONVERT_STATE_NAME).exists():
        same = _read_json(dst / CONVERT_STATE_NAME).get("fingerprint") == fingerprint
        return "resume" if same else "stream"
    if (dst / "config.json").exists():
        return "model"
    others = [f for f in dst.iterdir() if f != experts_dir(dst)]
    if others or (experts_dir(dst).is_dir() and any(experts_dir(dst).iterdir())):
        return "foreign"
    return "empty"


def _check_dst(dst: Path, state: str, force: bool) -> None:
    """Refuse to write where it would destroy something not asked for.

    ``--force`` replaces another converted model or an mlx-lm model
    directory; a directory of anything else is never written into.
    """
    if state == "foreign":
        raise ConversionError(
            f"{dst} holds files that are not a model; choose an empty or new --out"
        )
    if state in ("stream", "model") and not force:
        what = ("a different converted model" if state == "stream" else "an mlx-lm model")
        raise ConversionError(
            f"{dst} already holds {what}; pass --force to replace it or choose another --out"
        )


def _disk_error(e: OSError, dst: Path) -> ConversionError:
    where = e.filename or dst
    if e.errno == errno.ENOSPC:
        return ConversionError(
            f"the disk holding {dst} is full (writing {where}); free space and run the "
            "same command again: finished layers are kept"
        )
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return ConversionError(
            f"cannot write {where} ({e.strerror}); choose a writable --out"
        )
    return ConversionError(f"cannot write {where} ({e.strerror}); check --out and the disk")


def convert(
    src,
    dst,
    *,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    q_mode: str = "affine",
    dtype: Optional[str] = None,
    force: bool = False,
    progress: bool = True,
    on_layer: Optional[Callable[[LayerSpec], None]] = None,
) -> Path:
    """Convert the mlx-lm MoE model at ``src`` into a stream directory.

    Args:
        src: a local mlx-lm model directory or a Hugging Face repo id.
        dst: the stream directory to write.
        quantize: quantize the model (``q_bits``, ``q_group_size``,
            ``q_mode``) with mlx-lm's quantizer while converting.
        dtype: cast floating weights first (``float16``, ``bfloat16``,
            ``float32``); quantization scales take this dtype.
        force: overwrite a different model already converted at ``dst``.
        progress: show a progress bar.
        on_layer: called after each layer's blob is complete.

    Returns:
        The path of the stream directory.

    Raises:
        ConversionError: the model cannot be converted (not found, not MoE,
            already quantized and ``quantize`` asked, ...).
    """
    dst = Path(dst).expanduser()
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {', '.join(DTYPES)}")
    options = dict(
        quantize=quantize, q_bits=q_bits, q_group_size=q_group_size, q_mode=q_mode, dtype=dtype
    )
    src_path = None
    try:
        src_path = resolve_source(str(src))
        _check_not_source(src_path, dst)
        fingerprint = _fingerprint(src_path, options)
        holds = _dst_state(dst, fingerprint)
        if holds == "done" and not force:
            print(f"{dst} is already converted from {src}", file=sys.stderr)
            return dst
        if not has_vocabulary(src_path):
            print(f"warning: {src} has no tokenizer vocabulary ({', '.join(VOCABULARY_FILES)}); "
                  "the converted model will not load until you copy it in", file=sys.stderr)
        _check_dst(dst, holds, force)
        # Everything that can refuse the source runs before dst is touched.
        model, config = _load_source(src, src_path)
        model, config, blocks = _prepare_model(model, config, src, quantize, q_bits,
                                               q_group_size, q_mode, dtype)
        if holds in ("done", "stream", "model"):
            _clear_dst(dst)
        experts_dir(dst).mkdir(parents=True, exist_ok=True)
        state = _State(dst, fingerprint)
        state.start()
        return _convert_layers(model, config, blocks, state, src, src_path, dst, fingerprint,
                               options, progress, on_layer)
    except OSError as e:
        raise _os_error(e, src_path, dst) from None


def _os_error(e: OSError, src_path: Optional[Path], dst: Path) -> ConversionError:
    failed = Path(e.filename).absolute() if e.filename is not None else None
    if (src_path is not None and failed is not None
            and failed.is_relative_to(src_path.absolute())
            and not failed.is_relative_to(dst.absolute())):
        return ConversionError(f"cannot read {e.filename} of the source model ({e.strerror})")
    return _disk_error(e, dst)


def _load_source(src, src_path: Path):
    index = src_path / "model.safetensors.index.json"
    if index.exists():
        # mlx-lm loads whatever shards it finds; a missing one would
        # surface as missing weights or a bare file error.
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ConversionError(f"{index} is damaged; re-download the model") from None
        missing = sorted(s for s in shards if not (src_path / s).exists())
        if missing:
            raise ConversionError(
                f"{src} lacks {len(missing)} weight shard(s) its index names (first: "
                f"{missing[0]}); finish the download or re-download the model"
            )
    for f in src_path.glob("*.safetensors"):
        try:
            check_safetensors(f)
        except FormatError as e:
            raise ConversionError(str(e).replace("re-convert the model",
                                                 "re-download the source model")) from None
    try:
        return load_model(src_path, lazy=True)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ConversionError(f"mlx-lm cannot load {src}: {e}") from None


def _prepare_model(model, config, src, quantize, q_bits, q_group_size, q_mode, dtype):
    """Cast and quantize as asked; returns ``(model, config, expert blocks)``."""
    blocks = find_expert_blocks(model)
    if not blocks:
        raise ConversionError(
            f"{src} ({config.get('model_type')}) has no routed experts "
            "(no SwitchGLU/SwitchMLP modules): it is not a MoE model"
        )
    if dtype is not None:
        _cast(model, DTYPES[dtype])
        config["torch_dtype"] = dtype
    if quantize:
        if "quantization" in config:
            raise ConversionError(f"{src} is already quantized; convert it without -q")
        try:
            model, config = quantize_model(model, config, q_group_size, q_bits, mode=q_mode)
        except ValueError as e:
            raise ConversionError(f"cannot quantize with these settings: {e}") from None
    return model, config, blocks


def _convert_layers(model, config, blocks, state, src, src_path, dst, fingerprint, options,
                    progress, on_layer) -> Path:
    layers, streamed = [], set()
    keep = resident_modules(model, blocks)
    total = sum(num_experts(b) for _, b in blocks)
    bar = _progress_bar(total, progress)
    for ordinal, (path, block) in enumerate(blocks):
        layer = layer_index(path, ordinal)
        file = f"layer{layer:03d}.blob"
        if any(l.file == file for l in layers):
            file = f"block{ordinal:03d}.blob"
        spec = state.done(file, dst)
        if spec is None:
            bar.set_description(f"experts of {path}")
            top_k = find_top_k(model, path, block, config)
            spec = _convert_layer(block, path, layer, file, top_k, dst, bar.update)
            state.record(spec)
        else:
            bar.update(spec.num_experts)
        layers.append(spec)
        streamed.update(f"{path}.{s.name}" for s in spec.segments)
        _release_experts(block, spec)
        if on_layer is not None:
            on_layer(spec)
    bar.close()

    mtp_spec = _convert_mtp(model, config, src_path, dst, layers[-1].top_k, options, bar)
    dense = _convert_dense(model, blocks, keep, streamed, dst)
    streamed.update(f"{d.prefix}.{s.name}" for d in dense for s in d.segments)
    _write_spine(model, streamed, dst)
    save_config(dict(config), dst / "config.json")
    _copy_tokenizer(src_path, dst)
    _fsync_written(dst)
    source = {"model": str(src), "fingerprint": fingerprint, "options": options}
    write_manifest(dst, Manifest(FORMAT_VERSION, tuple(layers), source, spine_manifest(dst),
                                 mtp_spec, dense))
    state.path.unlink(missing_ok=True)
    return dst


def resident_modules(model, blocks) -> set:
    """Module paths that stay out of the dense records: the expert blocks
    and their routers (prefetch scores the next layer's router before that
    layer's record is read). Call before the experts are released."""
    keep = set()
    for path, block in blocks:
        keep.update(router_paths(model, path, num_experts(block), input_dims_of(block)))
        keep.add(path)
    return keep


def dense_tensors(model, blocks, keep: set) -> Dict[str, Dict[str, mx.array]]:
    """Per transformer layer prefix (``model.layers.3``), the tensors that go
    into its dense record: every tensor of the layer with two or more axes
    (attention, shared experts, dense MLP) outside the modules ``keep``.
    Norms, biases and other vectors stay in the resident spine."""
    # One list of layers (the one holding the most expert blocks), so that
    # layer numbers name records uniquely; any other stays resident.
    paths = [layers_path(path) for path, _ in blocks]
    lst = max(set(paths) - {None}, key=paths.count, default=None)
    if lst is None:
        return {}
    params = tree_flatten(model.parameters())
    # A tensor that two modules share (tied weights) stays resident: a
    # record would hold one copy per layer, and a ring one per buffer.
    uses: Dict[int, int] = {}
    for _, value in params:
        uses[id(value)] = uses.get(id(value), 0) + 1
    out: Dict[str, Dict[str, mx.array]] = {}
    for name, value in params:
        if not name.startswith(lst + "."):
            continue
        index, rest = name[len(lst) + 1:].split(".", 1)
        module = parent_path(name)
        if (not index.isdigit() or value.ndim < 2 or uses[id(value)] > 1
                or any(module == k or module.startswith(k + ".") for k in keep)):
            continue
        out.setdefault(f"{lst}.{index}", {})[rest] = value
    return out


def _convert_dense(model, blocks, keep: set, streamed: set,
                   dst: Path) -> Tuple[DenseSpec, ...]:
    """Write one record of each layer's dense tensors to ``spine/``."""
    start_dense(dst)
    specs = []
    for prefix, tensors in sorted(dense_tensors(model, blocks, keep).items(),
                                  key=lambda kv: int(kv[0].rsplit(".", 1)[1])):
        tensors = {k: v for k, v in tensors.items() if f"{prefix}.{k}" not in streamed}
        if not tensors:
            continue
        mx.eval(list(tensors.values()))
        data = {k: (dtype_name(v.dtype), v.shape, np.array(v.reshape(-1).view(mx.uint8),
                                                            copy=False))
                for k, v in tensors.items()}
        specs.append(write_dense(dst, prefix, data, dense_quantization(model, prefix, tensors)))
        # Free the layer's evaluated tensors before the next one.
        model.update(tree_unflatten([(f"{prefix}.{k}", mx.array([])) for k in tensors]))
    fsync_path(spine_dir(dst))
    return tuple(specs)


def start_dense(dst: Path) -> None:
    """An empty ``spine/`` for the dense records."""
    out = spine_dir(dst)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()


def dense_quantization(model, prefix: str, names) -> Dict[str, dict]:
    """``{module: {bits, group_size, mode}}`` of the quantized modules that
    own the tensors ``names`` (relative to ``prefix``)."""
    out = {}
    for k in names:
        module = get_module(model, parent_path(f"{prefix}.{k}"))
        if "scales" in module and hasattr(module, "bits"):
            q = {"bits": module.bits, "group_size": module.group_size, "mode": module.mode}
            if module.get("global_scale") is not None:
                q["global_scale"] = True
            out[parent_path(k)] = q
    return out


def write_dense(dst: Path, prefix: str, tensors, quantization: Dict[str, dict]) -> DenseSpec:
    """Write the dense record of the layer at ``prefix``; ``tensors`` maps
    each name (relative to ``prefix``) to ``(dtype name, shape, bytes)``,
    ``bytes`` a uint8 array. Returns its manifest entry."""
    names = sorted(tensors)
    layout = [(k, tensors[k][0], tuple(tensors[k][1]), tensors[k][2].nbytes) for k in names]
    segments, nbytes = layout_record(layout)
    record = np.zeros(nbytes, dtype=np.uint8)
    for seg in segments:
        record[seg.offset:seg.offset + seg.nbytes] = tensors[seg.name][2]
    layer = int(prefix.rsplit(".", 1)[1])
    file = f"layer{layer:03d}.blob"
    tmp = spine_dir(dst) / (file + ".tmp")
    with open(tmp, "wb") as f:
        f.write(record.data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, spine_dir(dst) / file)
    crc = record_checksum(record[s.offset:s.offset + s.nbytes] for s in segments)
    return DenseSpec(layer, prefix, file, nbytes, segments, quantization, crc)


def _convert_mtp(model, config, src_path: Path, dst: Path, top_k: int, options: dict,
                 bar) -> Optional[MtpSpec]:
    """Keep the model's MTP layers (``mtp.py``), which mlx-lm drops: their
    routed experts as blobs, the rest in ``mtp.safetensors``. None when the
    config declares none or the source has no such weights."""
    count = mtp.mtp_layers_of(config)
    if not count:
        return None
    unsupported = mtp.supports(model)
    if unsupported:
        print(f"[mlx_streaming] config.json declares MTP layers, but they are kept only for "
              f"DeepSeek-V3-style models ({unsupported}); --draft mtp will not be available",
              file=sys.stderr)
        return None
    first = len(model.model.layers)
    found = mtp.source_tensors(sorted(src_path.glob("*.safetensors")), first, count)
    if len(found) < count:
        print(f"[mlx_streaming] config.json declares {count} MTP layer(s) but the source "
              "has no weights for them (mlx-lm's converter drops them); --draft mtp will "
              "not be available", file=sys.stderr)
        return None
    modules = mtp.build(model, count)
    specs, rest = [], {}
    for depth, module in enumerate(modules):
        weights = mtp.sanitize(model, found[depth])
        if options["dtype"] is not None:
            weights = {k: v.astype(DTYPES[options["dtype"]])
                       if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
        mtp.load_weights(module, weights, config.get("quantization")
                         if not options["quantize"] else None)
        mtp.check_complete(module, weights, str(src_path))
        if options["quantize"]:
            mtp.quantize(module, options["q_group_size"], options["q_bits"], options["q_mode"])
        ((path, block),) = find_expert_blocks(module)
        spec = _convert_layer(block, f"mtp.{depth}.{path}", first + depth,
                              f"mtp{depth:02d}.blob", top_k, dst, bar.update)
        names = {f"{path}.{s.name}" for s in spec.segments}
        rest.update({f"mtp.{depth}.{k}": v for k, v in tree_flatten(module.parameters())
                     if k not in names})
        specs.append(spec)
    tmp = dst / (mtp.MTP_FILE + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), rest, metadata={"format": "mlx"})
    fsync_path(tmp)
    os.replace(tmp, dst / mtp.MTP_FILE)
    spine = SpineFile(mtp.MTP_FILE, (dst / mtp.MTP_FILE).stat().st_size,
                      file_crc32(dst / mtp.MTP_FILE))
    return MtpSpec(spine, tuple(specs))


def _release_experts(block, spec: LayerSpec) -> None:
    names = {s.name for s in spec.segments}
    block.update(
        tree_unflatten(
            [(k, mx.array([])) for k, _ in tree_flatten(block.parameters()) if k in names]
        )
    )


class _NoBar:
    def update(self, n=1):
        pass

    def set_description(self, s):
        pass

    def close(self):
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="expert", file=sys.stderr)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_streaming convert",
        description="Convert an mlx-lm MoE model into a stream directory.",
    )
    p.add_argument("--model", required=True, help="local mlx-lm model dir or HF repo id")
    p.add_argument("--out", required=True, help="stream directory to write")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize while converting")
    p.add_argument("--q-bits", type=int, default=4)
    p.add_argument("--q-group-size", type=int, default=64)
    p.add_argument("--q-mode", default="affine", choices=["affine", "mxfp4", "nvfp4", "mxfp8"])
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="cast floating weights before quantizing (float32 scales "
                        "are fastest on MLX's CPU backend)")
    p.add_argument("--force", action="store_true", help="overwrite another converted model")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--upload", default=None, metavar="ORG/REPO",
                   help="then publish the stream directory to this Hub model repo, which "
                        "`mlx_streaming.load('ORG/REPO')` streams by HTTP range")
    p.add_argument("--private", action="store_true", help="create the --upload repo private")
    p.add_argument("--endpoint", default=None,
                   help="the Hub's URL for --upload (default: huggingface_hub's, HF_ENDPOINT)")
    return p


def upload(out: Path, repo_id: str, endpoint: Optional[str] = None,
           private: bool = False) -> str:
    """Publish the stream directory ``out`` to the Hub model repo ``repo_id``
    (created if needed) in one commit. Returns the commit URL."""
    from huggingface_hub import HfApi

    if not manifest_path(out).is_file():
        raise ConversionError(f"{out} is not a complete stream directory; convert it first")
    api = HfApi(endpoint=endpoint)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(out),
                                 commit_message="Upload mlx_streaming stream directory",
                                 ignore_patterns=[CONVERT_STATE_NAME, "*.tmp*"])
    except Exception as e:
        raise ConversionError(
            f"cannot upload {out} to {repo_id} ({type(e).__name__}: "
            f"{first_line(e)}); log in with `hf auth login` or set HF_TOKEN, "
            "and check the repo id") from None
    return str(info)


def main(argv=None) -> int:
    from .cli import run_main

    args = setup_arg_parser().parse_args(argv)

    def body():
        out = convert(
            args.model,
            args.out,
            quantize=args.quantize,
            q_bits=args.q_bits,
            q_group_size=args.q_group_size,
            q_mode=args.q_mode,
            dtype=args.dtype,
            force=args.force,
            progress=not args.no_progress,
        )
        print(f"wrote {out}", file=sys.stderr)
        if args.upload:
            url = upload(Path(out), args.upload, args.endpoint, args.private)
            print(f"uploaded to {args.upload}: {url}", file=sys.stderr)

    return run_main(body)


if __name__ == "__main__":
    from .cli import leave

    leave(main())
