"""The records of a stream directory: what a manifest describes (see
docs/FORMAT.md), and how an expert's tensors are laid out in its record.
"""

import re
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from ..errors import FormatError

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


# Low-bit copies are small: padded only to the uncached reads' own 4 KiB.
LOW_RECORD_ALIGNMENT = 4096


# Segments start on a cache line so every tensor is aligned for SIMD loads.
SEGMENT_ALIGNMENT = 64


DTYPES = {
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
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise FormatError(f"dtype {dtype} cannot be stored in a stream directory")


def dtype_from_name(name: str) -> mx.Dtype:
    try:
        return DTYPES[name]
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
    # The width of the low-bit copies this layer holds (``LowBits``); None:
    # the records themselves. Not written to the manifest: its place says it.
    copy_bits: Optional[int] = None

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


# Widths and group sizes of low-bit copies (mlx's affine quantization).
LOW_BITS = (2, 3, 4, 5, 6, 8)
LOW_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class LowBits:
    """Low-bit copies of every expert (``convert --miss-bits``): per expert
    layer of the manifest, in its order, a blob of the same experts
    quantized to ``bits`` (affine, ``group_size``) with mlx's ``quantize``,
    read on a miss in place of the full record (``StreamConfig.miss_bits``)."""

    bits: int
    group_size: int
    layers: Tuple[LayerSpec, ...]
    # A tensor-parallel conversion: each rank's copies of its own slices
    # (``layers`` are rank 0's). Empty: not split.
    ranks: Tuple[Tuple[LayerSpec, ...], ...] = ()

    @property
    def all_layers(self) -> Tuple[LayerSpec, ...]:
        """Every blob's layer entry: all ranks' copies."""
        return tuple(spec for rank in self.ranks for spec in rank) if self.ranks else self.layers


@dataclass(frozen=True)
class Manifest:
    version: int
    layers: Tuple[LayerSpec, ...]
    source: dict = field(default_factory=dict)
    spine: Tuple[SpineFile, ...] = ()
    # Multi-token-prediction layers (models.mtp_layers): their spine file and expert blobs.
    mtp: Optional["MtpSpec"] = None
    # Version 2: per-layer dense records, in layer order (empty: all in spine).
    dense: Tuple[DenseSpec, ...] = ()
    # A tensor-parallel conversion: each rank's expert layers (its slices of
    # every expert, in files of its own); ``layers`` are rank 0's. Empty: none.
    ranks: Tuple[Tuple[LayerSpec, ...], ...] = ()
    # Its dense records likewise: each rank's slices; ``dense`` are rank 0's.
    dense_ranks: Tuple[Tuple[DenseSpec, ...], ...] = ()
    # Low-bit copies of the experts, one entry per width. Empty: none.
    low_bits: Tuple[LowBits, ...] = ()

    def low_copies(self, bits: int) -> Optional[LowBits]:
        """The low-bit copies of width ``bits``, or None."""
        return next((c for c in self.low_bits if c.bits == bits), None)

    @property
    def tensor_parallel(self) -> int:
        """The number of ranks the experts were split for (1: not split)."""
        return max(1, len(self.ranks))

    def expert_layers(self) -> Tuple[LayerSpec, ...]:
        """Every expert layer with a blob: all ranks' and the MTP layers (the
        low-bit copies apart: ``low_layers``)."""
        main = tuple(spec for rank in self.ranks for spec in rank) if self.ranks else self.layers
        return main + (self.mtp.layers if self.mtp else ())

    def low_layers(self, bits: Optional[int] = None) -> Tuple[LayerSpec, ...]:
        """The layers of the low-bit copies: of every width, or of ``bits``."""
        return tuple(spec for c in self.low_bits if bits in (None, c.bits) for spec in c.all_layers)

    @property
    def dense_nbytes(self) -> int:
        """Bytes of all dense records' tensors (in memory when all resident)."""
        return sum(d.tensor_nbytes for d in self.dense)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of all routed experts of the model."""
        return sum(spec.expert_nbytes * spec.num_experts for spec in self.layers)


def layout_record(tensors: List[Tuple[str, str, Tuple[int, ...], int]],
                  alignment: int = RECORD_ALIGNMENT):
    """Place the tensors of one expert in a record.

    Args:
        tensors: ``(name, dtype, shape, nbytes)`` per tensor, in record order.

    Returns:
        ``(segments, stride)``: the segments with their offsets, and the
        record stride (a multiple of ``alignment``).
    """
    segments = []
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        offset = align(offset, SEGMENT_ALIGNMENT)
        segments.append(Segment(name, dtype, tuple(shape), offset, nbytes))
        offset += nbytes
    return tuple(segments), align(max(offset, 1), alignment)


def record_checksum(buffers) -> int:
    """CRC-32 (zlib polynomial) of the segment bytes in record order, the
    padding excluded. ``buffers`` is an iterable of bytes-like objects."""
    crc = 0
    for b in buffers:
        crc = zlib.crc32(b, crc)
    return crc & 0xFFFFFFFF


# MLX shapes are int32: a larger dimension is damage, never a model.
MAX_DIM = 2**31


def layer_in_path(module: str) -> Optional[int]:
    """The transformer layer a module path names (its last integer), or
    None for a path without one."""
    numbers = re.findall(r"(?:^|\.)(\d+)(?:\.|$)", module)
    return int(numbers[-1]) if numbers else None
