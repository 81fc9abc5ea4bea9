"""The stream directory format, version 1 (see docs/FORMAT.md).

A stream directory is an mlx-lm model directory whose routed experts were
moved out of the safetensors into one blob per MoE layer:

    config.json, tokenizer files, model*.safetensors   (the resident spine)
    experts/manifest.json                              (written last)
    experts/layer{L:03d}.blob                          (num_experts records)

Each blob holds one fixed-stride record per expert, so reading a missed
expert is a single ``pread`` of ``stride`` bytes at ``expert * stride``.
"""

import json
import os
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from .errors import CorruptExpertError, FormatError

FORMAT_NAME = "mlx_streaming.experts"
FORMAT_VERSION = 1
EXPERTS_DIR = "experts"
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

    def record_offset(self, expert: int) -> int:
        return expert * self.stride


@dataclass(frozen=True)
class Manifest:
    version: int
    layers: Tuple[LayerSpec, ...]
    source: dict = field(default_factory=dict)

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


def _segment_from_dict(d: dict) -> Segment:
    return Segment(d["name"], d["dtype"], tuple(d["shape"]), d["offset"], d["nbytes"])


def layer_from_dict(d: dict) -> LayerSpec:
    return LayerSpec(
        layer=d["layer"],
        module=d["module"],
        kind=d["kind"],
        file=d["file"],
        num_experts=d["num_experts"],
        top_k=d["top_k"],
        stride=d["stride"],
        segments=tuple(_segment_from_dict(s) for s in d["segments"]),
        quantization=d["quantization"],
        checksums=tuple(d["checksums"]),
    )


def manifest_to_dict(manifest: Manifest) -> dict:
    return {
        "format": FORMAT_NAME,
        "version": manifest.version,
        "record_alignment": RECORD_ALIGNMENT,
        "segment_alignment": SEGMENT_ALIGNMENT,
        "checksum": "crc32",
        "source": manifest.source,
        "layers": [asdict(l) for l in manifest.layers],
    }


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON so that a crash leaves either the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(path, manifest: Manifest) -> None:
    write_json_atomic(manifest_path(path), manifest_to_dict(manifest))


def read_manifest(path) -> Manifest:
    """Read and validate ``experts/manifest.json`` of a stream directory.

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
        with open(mpath) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise FormatError(f"{mpath} is not valid JSON ({e}); re-convert the model") from None
    if d.get("format") != FORMAT_NAME:
        raise FormatError(f"{mpath} is not an mlx_streaming manifest")
    version = d.get("version")
    if version != FORMAT_VERSION:
        raise FormatError(
            f"{mpath} has format version {version}, this mlx_streaming reads "
            f"version {FORMAT_VERSION}; upgrade mlx_streaming or re-convert"
        )
    try:
        layers = tuple(layer_from_dict(l) for l in d["layers"])
    except (KeyError, TypeError) as e:
        raise FormatError(f"{mpath} is malformed (missing {e}); re-convert the model") from None
    manifest = Manifest(version=version, layers=layers, source=d.get("source", {}))
    for spec in layers:
        check_blob_size(path, spec)
    return manifest


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


def verify(path, progress=None) -> List[Tuple[int, int]]:
    """Check every expert record against its checksum.

    Returns:
        ``(layer, expert)`` of every record whose checksum does not match.
    """
    manifest = read_manifest(path)
    bad = []
    for spec in manifest.layers:
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
