"""The stream directory format, version 2 (see docs/FORMAT.md).

A stream directory is an mlx-lm model directory whose routed experts were
moved out of the safetensors into one blob per MoE layer, and whose
per-layer dense weights into one record per transformer layer:

    config.json, tokenizer files, model*.safetensors   (the always-resident spine)
    experts/manifest.json                              (written last)
    experts/layer{L:03d}.blob                          (num_experts records)
    spine/layer{L:03d}.blob                            (one dense record, version 2)

Each blob holds one fixed-stride record per expert, so reading a missed
expert is a single ``pread`` of ``stride`` bytes at ``expert * stride``; a
layer's dense weights (attention, shared experts, dense MLP) are one read.
Version 1 directories (no dense records: the whole spine in safetensors)
are still read.
"""

import json
import math
import os
import re
import struct
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from .errors import CorruptExpertError, FormatError

FORMAT_NAME = "mlx_streaming.experts"
FORMAT_VERSION = 2
# Versions this package reads: 1 has no dense records.
READ_VERSIONS = (1, 2)
EXPERTS_DIR = "experts"
# Version 2: the per-layer dense records (spine layers that may be streamed).
SPINE_DIR = "spine"
MANIFEST_NAME = "manifest.json"
# Written while a conversion runs and removed when it completes.
CONVERT_STATE_NAME = ".convert-state.json"
# Records are padded to 16 KiB so that uncached (O_DIRECT / F_NOCACHE) reads
# of a whole record are aligned on both Linux and macOS.
RECORD_ALIGNMENT = 16 * 1024
# Segments start on a cache line so every tensor is aligned for SIMD loads.
SEGMENT_ALIGNMENT = 64

_DTYPES = {
    name: getattr(mx, name)
    for name in (
        "bool_",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
    )
}


def dtype_name(dtype: mx.Dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise FormatError(f"dtype {dtype} cannot be stored in a stream directory")


def dtype_from_name(name: str) -> mx.Dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise FormatError(
            f"unknown dtype '{name}' in the manifest; re-convert the model"
        ) from None


def align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Segment:
    """One tensor of an expert record: ``name`` is relative to the expert
    block (``gate_proj.weight``), ``shape`` excludes the expert axis."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class LayerSpec:
    """Everything needed to stream the experts of one MoE block."""

    layer: int
    module: str
    kind: str
    file: str
    num_experts: int
    top_k: int
    stride: int
    segments: Tuple[Segment, ...]
    quantization: Dict[str, Optional[dict]]
    checksums: Tuple[int, ...]

    @property
    def expert_nbytes(self) -> int:
        """Bytes one expert occupies in memory (the record without padding)."""
        return sum(s.nbytes for s in self.segments)

    @property
    def blob_nbytes(self) -> int:
        return self.num_experts * self.stride

    def record_offset(self, expert):
        """Where an expert's record starts in the blob (an int, or int64
        offsets of an array of experts)."""
        return expert * self.stride


@dataclass(frozen=True)
class SpineFile:
    """A spine safetensors file: its size and CRC-32 (absent from manifests
    written before spine checksums existed)."""

    name: str
    nbytes: int
    crc32: int


@dataclass(frozen=True)
class MtpSpec:
    """The MTP layers a conversion kept: non-expert tensors in ``spine``,
    routed experts in ``layers`` (blobs like any other layer's)."""

    spine: SpineFile
    layers: Tuple[LayerSpec, ...]


@dataclass(frozen=True)
class DenseSpec:
    """The dense weights of one transformer layer (version 2): one record of
    ``nbytes`` (a multiple of ``RECORD_ALIGNMENT``) in ``spine/{file}``.
    Segment names are relative to ``prefix`` (the layer's module path, e.g.
    ``model.layers.3``); ``quantization`` gives, per module of the record
    that is quantized (relative name), its ``{bits, group_size, mode}``."""

    layer: int
    prefix: str
    file: str
    nbytes: int
    segments: Tuple[Segment, ...]
    quantization: Dict[str, dict]
    crc32: int

    @property
    def tensor_nbytes(self) -> int:
        """Bytes the layer's tensors occupy in memory (the record without padding)."""
        return sum(s.nbytes for s in self.segments)


@dataclass(frozen=True)
class Manifest:
    version: int
    layers: Tuple[LayerSpec, ...]
    source: dict = field(default_factory=dict)
    spine: Tuple[SpineFile, ...] = ()
    # Multi-token-prediction layers (mtp.py): their spine file and expert blobs.
    mtp: Optional["MtpSpec"] = None
    # Version 2: per-layer dense records, in layer order (empty: all in spine).
    dense: Tuple[DenseSpec, ...] = ()

    @property
    def dense_nbytes(self) -> int:
        """Bytes of all dense records' tensors (in memory when all resident)."""
        return sum(d.tensor_nbytes for d in self.dense)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of all routed experts of the model."""
        return sum(l.expert_nbytes * l.num_experts for l in self.layers)


def layout_record(tensors: List[Tuple[str, str, Tuple[int, ...], int]]):
    """Place the tensors of one expert in a record.

    Args:
        tensors: ``(name, dtype, shape, nbytes)`` per tensor, in record order.

    Returns:
        ``(segments, stride)``: the segments with their offsets, and the
        record stride (a multiple of ``RECORD_ALIGNMENT``).
    """
    segments = []
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        offset = align(offset, SEGMENT_ALIGNMENT)
        segments.append(Segment(name, dtype, tuple(shape), offset, nbytes))
        offset += nbytes
    return tuple(segments), align(max(offset, 1), RECORD_ALIGNMENT)


def record_checksum(buffers) -> int:
    """CRC-32 (zlib polynomial) of the segment bytes in record order, the
    padding excluded. ``buffers`` is an iterable of bytes-like objects."""
    crc = 0
    for b in buffers:
        crc = zlib.crc32(b, crc)
    return crc & 0xFFFFFFFF


def experts_dir(path) -> Path:
    return Path(path) / EXPERTS_DIR


def manifest_path(path) -> Path:
    return experts_dir(path) / MANIFEST_NAME


# MLX shapes are int32: a larger dimension is damage, never a model.
MAX_DIM = 2**31


class _Malformed(Exception):
    """A manifest field of the wrong type or out of range (internal)."""


def _get(d, key, kind, where):
    if not isinstance(d, dict):
        raise _Malformed(f"{where} is not an object")
    if key not in d:
        raise _Malformed(f"{where} lacks '{key}'")
    value = d[key]
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise _Malformed(f"{where}.{key} is {type(value).__name__}, not {kind.__name__}")
    return value


def _nonneg(value, what, low=0):
    if value < low:
        raise _Malformed(f"{what} is {value}, below {low}")
    return value


def _segment_from_dict(d, where: str) -> Segment:
    name = _get(d, "name", str, where)
    dtype = _get(d, "dtype", str, where)
    if dtype not in _DTYPES:
        raise _Malformed(f"{where} has unknown dtype {dtype!r}")
    shape = _get(d, "shape", list, where)
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n < MAX_DIM
               for n in shape):
        raise _Malformed(f"{where}.shape is not a list of integers from 1 to {MAX_DIM - 1}")
    offset = _nonneg(_get(d, "offset", int, where), f"{where}.offset")
    nbytes = _nonneg(_get(d, "nbytes", int, where), f"{where}.nbytes")
    if math.prod(shape) * _DTYPES[dtype].size != nbytes:
        raise _Malformed(f"{where}: {nbytes} bytes do not hold a {dtype} tensor of shape {shape}")
    return Segment(name, dtype, tuple(shape), offset, nbytes)


def _check_record_layout(segments, stride: int, where: str) -> None:
    """Segments lie inside the record and do not overlap."""
    end = 0
    for s in sorted(segments, key=lambda s: s.offset):
        if s.offset < end:
            raise _Malformed(f"{where}: segment {s.name} overlaps the one before it")
        end = s.offset + s.nbytes
    if end > stride:
        raise _Malformed(f"{where}: segments end at byte {end}, beyond the stride {stride}")
    if len({s.name for s in segments}) != len(segments):
        raise _Malformed(f"{where}: two segments share a name")


def _quantization_from_dict(q, where: str) -> Dict[str, Optional[dict]]:
    if not isinstance(q, dict):
        raise _Malformed(f"{where}.quantization is not an object")
    for name, params in q.items():
        if params is None:
            continue
        w = f"{where}.quantization.{name}"
        _nonneg(_get(params, "bits", int, w), f"{w}.bits", 1)
        _nonneg(_get(params, "group_size", int, w), f"{w}.group_size", 1)
        _get(params, "mode", str, w)
    return q


def _record_fields(d, where: str, size_key: str):
    """``(record size, segments, file, layer)`` of an expert layer's or a
    dense record's manifest entry, each checked."""
    size = _nonneg(_get(d, size_key, int, where), f"{where}.{size_key}", 1)
    if size % RECORD_ALIGNMENT:
        raise _Malformed(f"{where}.{size_key} {size} is not a multiple of {RECORD_ALIGNMENT}")
    segs = _get(d, "segments", list, where)
    if not segs:
        raise _Malformed(f"{where} has no segments")
    segments = tuple(_segment_from_dict(s, f"{where}.segments[{i}]") for i, s in enumerate(segs))
    _check_record_layout(segments, size, where)
    file = _get(d, "file", str, where)
    if Path(file).name != file or file in ("", ".", ".."):
        raise _Malformed(f"{where}.file {file!r} must be a plain file name")
    layer = _nonneg(_get(d, "layer", int, where), f"{where}.layer")
    if layer >= MAX_DIM:
        raise _Malformed(f"{where}.layer {layer} is too large")
    return size, segments, file, layer


def layer_from_dict(d, where: str = "layer") -> LayerSpec:
    """A ``LayerSpec`` from its manifest entry, every field checked.

    Raises:
        _Malformed: a field is missing, of the wrong type or out of range.
    """
    num = _nonneg(_get(d, "num_experts", int, where), f"{where}.num_experts", 1)
    stride, segments, file, layer = _record_fields(d, where, "stride")
    checksums = _get(d, "checksums", list, where)
    if len(checksums) != num or not all(
        isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 1 << 32 for c in checksums
    ):
        raise _Malformed(f"{where}.checksums must be {num} unsigned 32-bit integers")
    top_k = _nonneg(_get(d, "top_k", int, where), f"{where}.top_k", 1)
    if top_k > num:
        raise _Malformed(f"{where}.top_k {top_k} exceeds num_experts {num}")
    module = _get(d, "module", str, where)
    # MTP layers are numbered after the model's layers, not by their path.
    index = None if module.startswith("mtp.") else layer_in_path(module)
    if index is not None and index != layer:
        # The converter numbers a layer by its module's path: an entry
        # whose module sits in another layer would run another's experts.
        raise _Malformed(f"{where}.module {module!r} is not in layer {layer}")
    return LayerSpec(
        layer=layer,
        module=module,
        kind=_get(d, "kind", str, where),
        file=file,
        num_experts=num,
        top_k=top_k,
        stride=stride,
        segments=segments,
        quantization=_quantization_from_dict(d.get("quantization"), where),
        checksums=tuple(checksums),
    )


# A tokenizer's vocabulary, in the files tokenizers load it from.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer.model.*", "vocab.json",
                    "spiece.model", "tekken.json", "*tiktoken*")


def has_vocabulary(path: Path) -> bool:
    """Whether a model directory holds a tokenizer's vocabulary."""
    return any(f.is_file() for pattern in VOCABULARY_FILES for f in path.glob(pattern))


def layer_in_path(module: str) -> Optional[int]:
    """The transformer layer a module path names (its last integer), or
    None for a path without one."""
    numbers = re.findall(r"(?:^|\.)(\d+)(?:\.|$)", module)
    return int(numbers[-1]) if numbers else None


def _spine_from_list(entries) -> Tuple[SpineFile, ...]:
    if not isinstance(entries, list):
        raise _Malformed("spine is not a list")
    out = []
    for i, e in enumerate(entries):
        w = f"spine[{i}]"
        name = _get(e, "name", str, w)
        if Path(name).name != name or name in ("", ".", ".."):
            raise _Malformed(f"{w}.name {name!r} must be a plain file name")
        out.append(SpineFile(name, _nonneg(_get(e, "nbytes", int, w), f"{w}.nbytes"),
                             _nonneg(_get(e, "crc32", int, w), f"{w}.crc32")))
    return tuple(out)


def _manifest_from_dict(d) -> Manifest:
    layers = _get(d, "layers", list, "manifest")
    if not layers:
        raise _Malformed("the manifest lists no layers")
    specs = tuple(layer_from_dict(l, f"layers[{i}]") for i, l in enumerate(layers))
    for what in ("layer", "module", "file"):
        values = [getattr(s, what) for s in specs]
        if len(set(values)) != len(values):
            raise _Malformed(f"two layers share a {what}")
    source = d.get("source", {})
    spine = _spine_from_list(d["spine"]) if "spine" in d else ()
    mtp = _mtp_from_dict(d["mtp"], specs) if d.get("mtp") is not None else None
    dense = _dense_from_list(d["dense"]) if d.get("version") >= 2 and "dense" in d else ()
    experts = {l.module for l in specs}
    for spec in dense:
        for seg in spec.segments:
            full = f"{spec.prefix}.{seg.name}"
            if any(full.startswith(m + ".") for m in experts):
                raise _Malformed(f"dense record of layer {spec.layer} holds {full}, a "
                                 "streamed expert tensor")
    return Manifest(version=d["version"], layers=specs,
                    source=source if isinstance(source, dict) else {}, spine=spine, mtp=mtp,
                    dense=dense)


def dense_from_dict(d, where: str = "dense") -> DenseSpec:
    """A ``DenseSpec`` from its manifest entry, every field checked."""
    nbytes, segments, file, layer = _record_fields(d, where, "nbytes")
    prefix = _get(d, "prefix", str, where)
    if not prefix.endswith(f".{layer}") or prefix.startswith("."):
        raise _Malformed(f"{where}.prefix {prefix!r} is not the path of layer {layer}")
    if any(s.offset % SEGMENT_ALIGNMENT for s in segments):
        raise _Malformed(f"{where}: a segment is not aligned to {SEGMENT_ALIGNMENT} bytes")
    quantization = _quantization_from_dict(_get(d, "quantization", dict, where), where)
    if any(q is None for q in quantization.values()):
        raise _Malformed(f"{where}.quantization lists an unquantized module")
    modules = {s.name.rsplit(".", 1)[0] for s in segments if "." in s.name}
    if not set(quantization) <= modules:
        raise _Malformed(f"{where}.quantization names a module the record does not hold")
    crc = _get(d, "crc32", int, where)
    if not 0 <= crc < 1 << 32:
        raise _Malformed(f"{where}.crc32 is not an unsigned 32-bit integer")
    return DenseSpec(layer=layer, prefix=prefix, file=file,
                     nbytes=nbytes, segments=segments, quantization=quantization, crc32=crc)


def _dense_from_list(entries) -> Tuple[DenseSpec, ...]:
    if not isinstance(entries, list):
        raise _Malformed("dense is not a list")
    specs = tuple(dense_from_dict(e, f"dense[{i}]") for i, e in enumerate(entries))
    if [s.layer for s in specs] != sorted(s.layer for s in specs):
        raise _Malformed("dense records are not in layer order")
    for what in ("layer", "prefix", "file"):
        values = [getattr(s, what) for s in specs]
        if len(set(values)) != len(values):
            raise _Malformed(f"two dense records share a {what}")
    return specs


def _mtp_from_dict(d, main: Tuple[LayerSpec, ...]) -> "MtpSpec":
    if not isinstance(d, dict):
        raise _Malformed("mtp is not an object")
    (spine,) = _spine_from_list([_get(d, "spine", dict, "mtp")])
    layers = tuple(layer_from_dict(l, f"mtp.layers[{i}]")
                   for i, l in enumerate(_get(d, "layers", list, "mtp")))
    for what in ("layer", "module", "file"):
        values = [getattr(s, what) for s in main + layers]
        if len(set(values)) != len(values):
            raise _Malformed(f"an MTP layer shares a {what} with another layer")
    return MtpSpec(spine, layers)


def manifest_to_dict(manifest: Manifest) -> dict:
    return {
        "format": FORMAT_NAME,
        "version": manifest.version,
        "record_alignment": RECORD_ALIGNMENT,
        "segment_alignment": SEGMENT_ALIGNMENT,
        "checksum": "crc32",
        "source": manifest.source,
        "spine": [asdict(s) for s in manifest.spine],
        "layers": [asdict(l) for l in manifest.layers],
        **({"mtp": {"spine": asdict(manifest.mtp.spine),
                    "layers": [asdict(l) for l in manifest.mtp.layers]}}
           if manifest.mtp is not None else {}),
        **({"dense": [asdict(d) for d in manifest.dense]} if manifest.version >= 2 else {}),
    }


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON so that a crash leaves either the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (so that renames in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(path, manifest: Manifest) -> None:
    write_json_atomic(manifest_path(path), manifest_to_dict(manifest))


def read_manifest(path, blobs: bool = True) -> Manifest:
    """Read and validate ``experts/manifest.json`` of a stream directory
    (and, with ``blobs``, that each blob is there and long enough).

    Raises:
        FormatError: the directory is not a complete stream directory of a
            version this package reads.
    """
    mpath = manifest_path(path)
    if not mpath.exists():
        if (Path(path) / CONVERT_STATE_NAME).exists():
            raise FormatError(
                f"the conversion into {path} did not finish; run the same "
                "`mlx_streaming convert` command again to complete it"
            )
        if (Path(path) / "config.json").exists():
            raise FormatError(
                f"{path} is not a converted stream directory (no {EXPERTS_DIR}/"
                f"{MANIFEST_NAME}); run `mlx_streaming convert --model {path} "
                "--out DIR` first, or re-run an interrupted conversion"
            )
        raise FormatError(f"{path} does not exist or is not a model directory")
    try:
        with open(mpath, "rb") as f:
            d = json.loads(f.read().decode("utf-8"))
    except IsADirectoryError:
        raise FormatError(f"{mpath} is a directory, not a manifest; re-convert the model") from None
    except OSError as e:
        raise FormatError(f"cannot read {mpath}: {e.strerror}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(
            f"{mpath} is not valid JSON ({type(e).__name__}); re-convert the model"
        ) from None
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        raise FormatError(f"{mpath} is not an mlx_streaming manifest; re-convert the model")
    version = d.get("version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise FormatError(
            f"{mpath} has format version {version!r}, this mlx_streaming reads "
            f"versions {', '.join(map(str, READ_VERSIONS))}; upgrade mlx_streaming or re-convert"
        )
    try:
        manifest = _manifest_from_dict(d)
    except _Malformed as e:
        raise FormatError(f"{mpath} is malformed ({e}); re-convert the model") from None
    if blobs:
        for spec in manifest.layers + (manifest.mtp.layers if manifest.mtp else ()):
            check_blob_size(path, spec)
    for spec in manifest.dense:
        check_dense_size(path, spec)
    return manifest


def spine_dir(path) -> Path:
    return Path(path) / SPINE_DIR


def dense_path(path, spec: DenseSpec) -> Path:
    return spine_dir(path) / spec.file


def check_dense_size(path, spec: DenseSpec) -> None:
    f = dense_path(path, spec)
    try:
        size = f.stat().st_size
    except FileNotFoundError:
        raise FormatError(f"layer {spec.layer}: dense record {f} is missing; "
                          "re-convert the model") from None
    if size < spec.nbytes:
        raise FormatError(f"layer {spec.layer}: dense record {f} is truncated ({size} of "
                          f"{spec.nbytes} bytes); re-convert the model")


def read_dense(path, spec: DenseSpec) -> bytearray:
    """A whole dense record (for checks and tools, not the hot path)."""
    buf = bytearray(spec.nbytes)
    with open(dense_path(path, spec), "rb", buffering=0) as f:
        n = f.readinto(memoryview(buf))
    if n != spec.nbytes:
        raise FormatError(f"layer {spec.layer}: dense record is truncated; re-convert")
    return buf


def dense_checksum(record, spec: DenseSpec) -> int:
    view = memoryview(record)
    return record_checksum(view[s.offset : s.offset + s.nbytes] for s in spec.segments)


def blob_path(path, spec: LayerSpec) -> Path:
    return experts_dir(path) / spec.file


def check_blob_size(path, spec: LayerSpec) -> None:
    bpath = blob_path(path, spec)
    try:
        size = bpath.stat().st_size
    except FileNotFoundError:
        raise FormatError(
            f"layer {spec.layer}: expert blob {bpath} is missing; re-convert the model"
        ) from None
    if size < spec.blob_nbytes:
        first_bad = size // spec.stride
        raise CorruptExpertError(
            spec.layer,
            first_bad,
            f"blob {bpath} is truncated ({size} of {spec.blob_nbytes} bytes)",
        )


# safetensors dtypes that MLX loads, and their item sizes.
_SAFETENSORS_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
}
# A header larger than this is damage, not a model (safetensors' own cap).
MAX_SAFETENSORS_HEADER = 100 << 20
SPINE_PATTERN = "model*.safetensors"


def spine_files(path) -> List[Path]:
    return sorted(Path(path).glob(SPINE_PATTERN))


def check_safetensors(path: Path) -> None:
    """Check a safetensors file's header against the file before MLX reads
    it: a damaged header must be a one-line error, never a crash.

    Raises:
        FormatError: the header is unreadable or names bytes the file lacks.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if n < 0 or n > min(size - 8, MAX_SAFETENSORS_HEADER):
                raise _Malformed(f"header length {n} does not fit the {size}-byte file")
            header = json.loads(f.read(n).decode("utf-8"))
        data = size - 8 - n
        if not isinstance(header, dict):
            raise _Malformed("the header is not a JSON object")
        for name, t in header.items():
            if name == "__metadata__":
                meta = {} if t is None else t  # MLX writes null when there is none
                if not isinstance(meta, dict) or not all(
                        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
                    raise _Malformed("__metadata__ is not a map of strings")
                continue
            dtype = _get(t, "dtype", str, name)
            if dtype not in _SAFETENSORS_ITEMSIZE:
                raise _Malformed(f"{name} has unknown dtype {dtype!r}")
            shape = _get(t, "shape", list, name)
            offsets = _get(t, "data_offsets", list, name)
            ints = shape + offsets
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
                raise _Malformed(f"{name} has a negative or non-integer shape or offset")
            if any(n >= MAX_DIM for n in shape):
                raise _Malformed(f"{name} has a dimension of {max(shape)}")
            if len(offsets) != 2 or not offsets[0] <= offsets[1] <= data:
                raise _Malformed(f"{name}'s bytes {offsets} lie outside the file")
            if offsets[1] - offsets[0] != math.prod(shape) * _SAFETENSORS_ITEMSIZE[dtype]:
                raise _Malformed(f"{name}'s {offsets[1] - offsets[0]} bytes do not hold "
                                 f"a {dtype} tensor of shape {shape}")
    except OSError as e:
        raise FormatError(f"cannot read spine file {path}: {e.strerror}") from None
    except (_Malformed, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(
            f"spine file {path} is damaged ({e}); re-convert the model"
        ) from None


def file_crc32(path: Path, chunk: int = 16 << 20) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
    return crc & 0xFFFFFFFF


def spine_manifest(path) -> Tuple[SpineFile, ...]:
    """Size and CRC-32 of every spine file (written into the manifest)."""
    return tuple(SpineFile(f.name, f.stat().st_size, file_crc32(f)) for f in spine_files(path))


def check_spine_files(path, manifest: Manifest, checksums: bool) -> None:
    """The spine files the manifest records exist with their sizes (and,
    with ``checksums``, their CRC-32). Manifests without spine entries
    (written before they existed) are not checked.

    Raises:
        FormatError: a spine file is missing, truncated or damaged.
    """
    for s in manifest.spine:
        f = Path(path) / s.name
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise FormatError(f"spine file {f} is missing; re-convert the model") from None
        if size != s.nbytes:
            raise FormatError(f"spine file {f} has {size} bytes, the manifest records "
                              f"{s.nbytes}; re-convert the model")
        if checksums and _crc_or_none(f) != s.crc32:
            raise FormatError(f"spine file {f} fails its checksum; re-convert the model")


def _crc_or_none(path: Path) -> Optional[int]:
    try:
        return file_crc32(path)
    except OSError:
        return None


def verify_spine(path, manifest: Manifest) -> List[str]:
    """Names of the spine files that are missing or fail their checksums."""
    bad = []
    for s in manifest.spine + ((manifest.mtp.spine,) if manifest.mtp else ()):
        f = Path(path) / s.name
        if not f.is_file() or f.stat().st_size != s.nbytes or _crc_or_none(f) != s.crc32:
            bad.append(s.name)
    for d in manifest.dense:
        try:
            ok = dense_checksum(read_dense(path, d), d) == d.crc32
        except (OSError, FormatError):
            ok = False
        if not ok:
            bad.append(f"{SPINE_DIR}/{d.file}")
    return bad


def verify(path, progress=None) -> List[Tuple[int, int]]:
    """Check every expert record against its checksum.

    Returns:
        ``(layer, expert)`` of every record whose checksum does not match.
    """
    manifest = read_manifest(path)
    bad = []
    for spec in manifest.layers + (manifest.mtp.layers if manifest.mtp else ()):
        with open(blob_path(path, spec), "rb", buffering=0) as f:
            buf = bytearray(spec.stride)
            view = memoryview(buf)
            for e in range(spec.num_experts):
                f.seek(spec.record_offset(e))
                f.readinto(view)
                segs = (view[s.offset : s.offset + s.nbytes] for s in spec.segments)
                if record_checksum(segs) != spec.checksums[e]:
                    bad.append((spec.layer, e))
                if progress is not None:
                    progress(1)
    return bad
