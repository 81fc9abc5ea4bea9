"""Low-bit copies of the experts (``convert --miss-bits``): per layer, a
blob of the same records quantized to fewer bits with mlx's own
``quantize``, which a run may read on a miss instead of the full record
(``StreamConfig.miss_bits``; docs/FORMAT.md, docs/routing.md).
"""

import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import ConversionError, FormatError
from ..format import (
    LOW_BITS,
    LOW_RECORD_ALIGNMENT,
    LayerSpec,
    LowBits,
    blob_path,
    check_blob_size,
    dtype_from_name,
    dtype_name,
    experts_dir,
    layout_record,
    read_manifest,
    write_copies_command,
    write_manifest,
)
from .experts import write_blob

# Experts dequantized at a time: bounds the float copy of a large layer.
CHUNK_EXPERTS = 16


def low_bit_file(spec: LayerSpec, bits: int) -> str:
    return spec.file[: -len(".blob")] + f".q{bits}.blob" if spec.file.endswith(".blob") \
        else f"{spec.file}.q{bits}"


def _projections(spec: LayerSpec) -> Dict[str, Dict[str, object]]:
    """Per projection of a record, its segments by key (weight, scales,
    biases, bias)."""
    out: Dict[str, Dict[str, object]] = {}
    for seg in spec.segments:
        proj, key = seg.name.rsplit(".", 1)
        out.setdefault(proj, {})[key] = seg
    return out


def _group_size(spec: LayerSpec, proj: str, input_dims: int) -> int:
    """The source's group size where it divides the width, else 64 or 32."""
    q = spec.quantization.get(proj)
    for g in ((q["group_size"],) if q else ()) + (64, 32):
        if g in (32, 64, 128) and input_dims % g == 0:
            return g
    raise ConversionError(f"layer {spec.layer}: {proj}'s input width {input_dims} is not a "
                          "multiple of 32, which low-bit copies need")


def check_width(spec: LayerSpec, bits: int) -> None:
    """Refuse copies of ``spec``'s records at ``bits`` that convert cannot make."""
    for proj, q in spec.quantization.items():
        if q is not None and q.get("global_scale"):
            raise ConversionError(f"--miss-bits: layer {spec.layer}'s {proj} is quantized with "
                                  "a global scale, which low-bit copies do not support")
        if q is not None and bits >= q["bits"]:
            raise ConversionError(f"--miss-bits {bits}: layer {spec.layer}'s {proj} is "
                                  f"already {q['bits']}-bit; a low-bit copy must be narrower")


def _tensor(blob: np.ndarray, seg, experts: slice) -> mx.array:
    """The segment of ``experts``' records as an mlx array [n, *shape]."""
    raw = np.ascontiguousarray(blob[experts, seg.offset: seg.offset + seg.nbytes])
    return mx.array(raw).view(dtype_from_name(seg.dtype)).reshape(raw.shape[0], *seg.shape)


def full_weight(spec: LayerSpec, proj: str, tensors: Dict[str, mx.array]) -> mx.array:
    """A projection's weights [n, out, in] as the model computes with them:
    dequantized with the record's own quantization where it has one."""
    q = spec.quantization.get(proj)
    if q is None:
        return tensors["weight"]
    return mx.dequantize(tensors["weight"], tensors["scales"], tensors.get("biases"),
                         group_size=q["group_size"], bits=q["bits"],
                         mode=q.get("mode", "affine"))


def quantize_low(weight: mx.array, bits: int, group_size: int) -> Dict[str, mx.array]:
    """The low-bit copy of ``weight``: mlx's affine ``quantize``."""
    wq, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    return {"weight": wq, "scales": scales, "biases": biases}


def _layer_copy(path: Path, spec: LayerSpec, bits: int, progress) -> Tuple[LayerSpec, int]:
    """Write the low-bit blob of one layer; returns its manifest entry and
    group size."""
    check_width(spec, bits)
    projs = _projections(spec)
    blob = np.memmap(blob_path(path, spec), dtype=np.uint8, mode="r",
                     shape=(spec.num_experts, spec.stride))
    views: Dict[str, np.ndarray] = {}
    layout: List[Tuple[str, str, tuple, int]] = []
    quantization, groups = {}, set()
    for start in range(0, spec.num_experts, CHUNK_EXPERTS):
        chunk = slice(start, min(start + CHUNK_EXPERTS, spec.num_experts))
        for proj, segs in projs.items():
            tensors = {k: _tensor(blob, s, chunk) for k, s in segs.items()}
            weight = full_weight(spec, proj, tensors)
            group = _group_size(spec, proj, weight.shape[-1])
            low = quantize_low(weight, bits, group)
            if "bias" in tensors:
                low["bias"] = tensors["bias"]
            mx.eval(low)
            for key, t in low.items():
                name = f"{proj}.{key}"
                if name not in views:
                    views[name] = np.zeros((spec.num_experts, t.nbytes // t.shape[0]), np.uint8)
                    layout.append((name, dtype_name(t.dtype), tuple(t.shape[1:]),
                                   views[name].shape[1]))
                views[name][chunk] = np.array(t.reshape(t.shape[0], -1).view(mx.uint8))
            quantization[proj] = {"bits": bits, "group_size": group, "mode": "affine"}
            groups.add(group)
        progress(0)
    segments, stride = layout_record(layout, LOW_RECORD_ALIGNMENT)
    file = low_bit_file(spec, bits)
    checksums = write_blob(experts_dir(path) / file, [views[n] for n, *_ in layout], stride,
                            segments, progress)
    entry = replace(spec, file=file, stride=stride, segments=segments,
                    quantization=quantization, checksums=tuple(checksums), copy_bits=bits)
    return entry, max(groups)


def _whole(path, copies: LowBits) -> bool:
    """Whether every blob of ``copies`` is there and long enough."""
    try:
        for spec in copies.layers:
            check_blob_size(path, spec)
    except FormatError:
        return False
    return True


def add_low_bits(path, bits: int, progress: Callable[[int], None] = lambda n: None,
                 force: bool = False) -> bool:
    """Write the ``bits``-bit copies of every expert of the stream directory
    at ``path`` and list them in its manifest. Returns False when it holds
    them already, whole (``force``: write them again all the same).

    Raises:
        ConversionError: a width mlx does not quantize to, or experts
            already as narrow.
    """
    if bits not in LOW_BITS:
        raise ConversionError(f"--miss-bits must be one of {', '.join(map(str, LOW_BITS))}, "
                              f"got {bits}")
    try:
        manifest = read_manifest(path)
    except FormatError as e:
        raise ConversionError(str(e)) from None
    held = manifest.low_copies(bits)
    if held is not None:
        if not force and _whole(path, held):
            return False
        manifest = replace(manifest, low_bits=tuple(c for c in manifest.low_bits if c is not held))
    # A tensor-parallel conversion: each rank's copies of its own slices.
    per_rank, groups = [], set()
    for layers in manifest.ranks or (manifest.layers,):
        entries = []
        for spec in layers:
            entry, group = _layer_copy(Path(path), spec, bits, progress)
            entries.append(entry)
            groups.add(group)
        per_rank.append(tuple(entries))
    copies = LowBits(bits, max(groups), per_rank[0], tuple(per_rank) if manifest.ranks else ())
    write_manifest(path, replace(manifest, low_bits=manifest.low_bits + (copies,)))
    return True


def check_low_bits(miss_bits, record_bits: Optional[int] = None) -> Tuple[int, ...]:
    """``miss_bits`` (a width or several) as distinct widths, refused
    before any converting: widths mlx does not quantize to, or not
    narrower than the records' ``record_bits``."""
    if isinstance(miss_bits, int):
        miss_bits = (miss_bits,)
    widths = tuple(dict.fromkeys(int(b) for b in miss_bits))
    for b in widths:
        if b not in LOW_BITS:
            raise ConversionError(f"--miss-bits must be among {', '.join(map(str, LOW_BITS))}, "
                                  f"got {b}")
        if record_bits is not None and b >= record_bits:
            raise ConversionError(f"--miss-bits {b}: the experts are quantized to "
                                  f"{record_bits} bits; a low-bit copy must be narrower")
    return widths


def add_copies(dst, miss_bits, progress: bool = True, force: bool = False) -> Path:
    """Add to the stream directory ``dst`` the low-bit copies of
    ``miss_bits`` it lacks or holds in part (``force``: all of them anew);
    says on stderr which it held already."""
    write_copies(dst, miss_bits, progress, force)
    return Path(dst)


def write_copies(dst, miss_bits, progress: bool = True,
                 force: bool = False) -> Tuple[int, ...]:
    """``add_copies``; returns the widths it wrote."""
    from tqdm import tqdm

    written, present = [], []
    for bits in check_low_bits(miss_bits):
        manifest = read_manifest(dst, blobs=False, dense=False)
        layers = [spec for rank in manifest.ranks or (manifest.layers,) for spec in rank]
        with tqdm(total=sum(spec.num_experts for spec in layers), unit="expert",
                  desc=f"{bits}-bit copies", file=sys.stderr, disable=not progress) as bar:
            (written if add_low_bits(dst, bits, bar.update, force=force) else present).append(bits)
    if present:
        # Whole blobs may still hold damaged records: only their checksums tell.
        widths = ",".join(map(str, present))
        print(f"{dst} holds the {widths}-bit copies already (left as they are): "
              f"`python -m mlx_streaming check {dst}` finds damaged ones, and "
              f"{write_copies_command(dst, widths, force=True)} writes them again",
              file=sys.stderr)
    return tuple(written)
