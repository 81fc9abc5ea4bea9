"""Low-bit copies of the experts (``convert --miss-bits``): per layer, a
blob of the same records quantized to fewer bits with mlx's own
``quantize``, which a run may read on a miss instead of the full record
(``StreamConfig.miss_bits``; docs/FORMAT.md, docs/routing.md).
"""

from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Tuple
import mlx.core as mx
import numpy as np
from ..errors import ConversionError, FormatError
from ..format import (LOW_BITS, LOW_RECORD_ALIGNMENT, LayerSpec, LowBits, blob_path, dtype_from_name, dtype_name,
                      experts_dir, layout_record, read_manifest, write_manifest)
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


def _check_width(spec: LayerSpec, bits: int) -> None:
    for proj, q in spec.quantization.items():
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
    _check_width(spec, bits)
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
                    quantization=quantization, checksums=tuple(checksums))
    return entry, max(groups)


def add_low_bits(path, bits: int, progress: Callable[[int], None] = lambda n: None) -> bool:
    """Write the ``bits``-bit copies of every expert of the stream directory
    at ``path`` and list them in its manifest. Returns False when it holds
    them already.

    Raises:
        ConversionError: a width mlx does not quantize to, a tensor-parallel
            conversion, or experts already as narrow.
    """
    if bits not in LOW_BITS:
        raise ConversionError(f"--miss-bits must be one of {', '.join(map(str, LOW_BITS))}, "
                              f"got {bits}")
    try:
        manifest = read_manifest(path)
    except FormatError as e:
        raise ConversionError(str(e)) from None
    if manifest.low_copies(bits) is not None:
        return False
    if manifest.ranks:
        raise ConversionError("--miss-bits: a tensor-parallel conversion has no low-bit "
                              "copies (each rank would need its own); convert without "
                              "--tensor-parallel for them")
    entries, groups = [], set()
    for spec in manifest.layers:
        entry, group = _layer_copy(Path(path), spec, bits, progress)
        entries.append(entry)
        groups.add(group)
    copies = LowBits(bits, max(groups), tuple(entries))
    write_manifest(path, replace(manifest, low_bits=manifest.low_bits + (copies,)))
    return True
