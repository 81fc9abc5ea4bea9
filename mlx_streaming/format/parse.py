"""Manifest entries from and to JSON, every field checked.
"""

import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Dict, Optional, Tuple

from .layout import (
    DTYPES,
    FORMAT_NAME,
    LOW_BITS,
    LOW_GROUP_SIZES,
    LOW_RECORD_ALIGNMENT,
    MAX_DIM,
    RECORD_ALIGNMENT,
    SEGMENT_ALIGNMENT,
    DenseSpec,
    LayerSpec,
    LowBits,
    Manifest,
    MtpSpec,
    Segment,
    SpineFile,
    layer_in_path,
)


class Malformed(Exception):
    """A manifest field of the wrong type or out of range (internal)."""


def get_field(d, key, kind, where):
    if not isinstance(d, dict):
        raise Malformed(f"{where} is not an object")
    if key not in d:
        raise Malformed(f"{where} lacks '{key}'")
    value = d[key]
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise Malformed(f"{where}.{key} is {type(value).__name__}, not {kind.__name__}")
    return value


def _nonneg(value, what, low=0):
    if value < low:
        raise Malformed(f"{what} is {value}, below {low}")
    return value


def _segment_from_dict(d, where: str) -> Segment:
    name = get_field(d, "name", str, where)
    dtype = get_field(d, "dtype", str, where)
    if dtype not in DTYPES:
        raise Malformed(f"{where} has unknown dtype {dtype!r}")
    shape = get_field(d, "shape", list, where)
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n < MAX_DIM
               for n in shape):
        raise Malformed(f"{where}.shape is not a list of integers from 1 to {MAX_DIM - 1}")
    offset = _nonneg(get_field(d, "offset", int, where), f"{where}.offset")
    nbytes = _nonneg(get_field(d, "nbytes", int, where), f"{where}.nbytes")
    if math.prod(shape) * DTYPES[dtype].size != nbytes:
        raise Malformed(f"{where}: {nbytes} bytes do not hold a {dtype} tensor of shape {shape}")
    return Segment(name, dtype, tuple(shape), offset, nbytes)


def _check_record_layout(segments, stride: int, where: str) -> None:
    """Segments lie inside the record and do not overlap."""
    end = 0
    for s in sorted(segments, key=lambda s: s.offset):
        if s.offset < end:
            raise Malformed(f"{where}: segment {s.name} overlaps the one before it")
        end = s.offset + s.nbytes
    if end > stride:
        raise Malformed(f"{where}: segments end at byte {end}, beyond the stride {stride}")
    if len({s.name for s in segments}) != len(segments):
        raise Malformed(f"{where}: two segments share a name")


def _quantization_from_dict(q, where: str) -> Dict[str, Optional[dict]]:
    if not isinstance(q, dict):
        raise Malformed(f"{where}.quantization is not an object")
    for name, params in q.items():
        if params is None:
            continue
        w = f"{where}.quantization.{name}"
        _nonneg(get_field(params, "bits", int, w), f"{w}.bits", 1)
        _nonneg(get_field(params, "group_size", int, w), f"{w}.group_size", 1)
        get_field(params, "mode", str, w)
    return q


def _record_fields(d, where: str, size_key: str, alignment: int = RECORD_ALIGNMENT):
    """``(record size, segments, file, layer)`` of an expert layer's or a
    dense record's manifest entry, each checked."""
    size = _nonneg(get_field(d, size_key, int, where), f"{where}.{size_key}", 1)
    if size % alignment:
        raise Malformed(f"{where}.{size_key} {size} is not a multiple of {alignment}")
    segs = get_field(d, "segments", list, where)
    if not segs:
        raise Malformed(f"{where} has no segments")
    segments = tuple(_segment_from_dict(s, f"{where}.segments[{i}]") for i, s in enumerate(segs))
    _check_record_layout(segments, size, where)
    file = get_field(d, "file", str, where)
    if Path(file).name != file or file in ("", ".", ".."):
        raise Malformed(f"{where}.file {file!r} must be a plain file name")
    layer = _nonneg(get_field(d, "layer", int, where), f"{where}.layer")
    if layer >= MAX_DIM:
        raise Malformed(f"{where}.layer {layer} is too large")
    return size, segments, file, layer


def layer_from_dict(d, where: str = "layer", alignment: int = RECORD_ALIGNMENT) -> LayerSpec:
    """A ``LayerSpec`` from its manifest entry, every field checked.

    Raises:
        Malformed: a field is missing, of the wrong type or out of range.
    """
    num = _nonneg(get_field(d, "num_experts", int, where), f"{where}.num_experts", 1)
    stride, segments, file, layer = _record_fields(d, where, "stride", alignment)
    checksums = get_field(d, "checksums", list, where)
    if len(checksums) != num or not all(
        isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 1 << 32 for c in checksums
    ):
        raise Malformed(f"{where}.checksums must be {num} unsigned 32-bit integers")
    top_k = _nonneg(get_field(d, "top_k", int, where), f"{where}.top_k", 1)
    if top_k > num:
        raise Malformed(f"{where}.top_k {top_k} exceeds num_experts {num}")
    module = get_field(d, "module", str, where)
    # MTP layers are numbered after the model's layers, not by their path.
    index = None if module.startswith("mtp.") else layer_in_path(module)
    if index is not None and index != layer:
        # The converter numbers a layer by its module's path: an entry
        # whose module sits in another layer would run another's experts.
        raise Malformed(f"{where}.module {module!r} is not in layer {layer}")
    return LayerSpec(
        layer=layer,
        module=module,
        kind=get_field(d, "kind", str, where),
        file=file,
        num_experts=num,
        top_k=top_k,
        stride=stride,
        segments=segments,
        quantization=_quantization_from_dict(d.get("quantization"), where),
        checksums=tuple(checksums),
    )


def layer_to_dict(spec: LayerSpec) -> dict:
    """A layer's manifest entry (``layer_from_dict``'s input)."""
    d = asdict(spec)
    del d["copy_bits"]  # the entry's place in the manifest says it
    return d


def _spine_from_list(entries) -> Tuple[SpineFile, ...]:
    if not isinstance(entries, list):
        raise Malformed("spine is not a list")
    out = []
    for i, e in enumerate(entries):
        w = f"spine[{i}]"
        name = get_field(e, "name", str, w)
        if Path(name).name != name or name in ("", ".", ".."):
            raise Malformed(f"{w}.name {name!r} must be a plain file name")
        out.append(SpineFile(name, _nonneg(get_field(e, "nbytes", int, w), f"{w}.nbytes"),
                             _nonneg(get_field(e, "crc32", int, w), f"{w}.crc32")))
    return tuple(out)


def manifest_from_dict(d) -> Manifest:
    layers = get_field(d, "layers", list, "manifest")
    if not layers:
        raise Malformed("the manifest lists no layers")
    specs = tuple(layer_from_dict(spec, f"layers[{i}]") for i, spec in enumerate(layers))
    for what in ("layer", "module", "file"):
        values = [getattr(s, what) for s in specs]
        if len(set(values)) != len(values):
            raise Malformed(f"two layers share a {what}")
    source = d.get("source", {})
    spine = _spine_from_list(d["spine"]) if "spine" in d else ()
    mtp = _mtp_from_dict(d["mtp"], specs) if d.get("mtp") is not None else None
    dense = _dense_from_list(d["dense"]) if d.get("version") >= 2 and "dense" in d else ()
    experts = {spec.module for spec in specs}
    for spec in dense:
        for seg in spec.segments:
            full = f"{spec.prefix}.{seg.name}"
            if any(full.startswith(m + ".") for m in experts):
                raise Malformed(f"dense record of layer {spec.layer} holds {full}, a "
                                 "streamed expert tensor")
    ranks = _ranks_from_dict(d["tensor_parallel"], specs) if "tensor_parallel" in d else ()
    dense_ranks = _dense_ranks_from_dict(d["tensor_parallel"], dense) if ranks else ()
    low_bits = _low_bits_from_list(d["low_bits"], specs, ranks) if "low_bits" in d else ()
    return Manifest(version=d["version"], layers=specs,
                    source=source if isinstance(source, dict) else {}, spine=spine, mtp=mtp,
                    dense=dense, ranks=ranks, dense_ranks=dense_ranks, low_bits=low_bits)


def _check_low_layer(low: LayerSpec, full: LayerSpec, bits: int, where: str) -> None:
    """A low-bit layer quantizes each projection of its full layer to
    ``bits`` (affine): weight, scales and biases of the same shapes' rows."""
    projs = {s.name.rsplit(".", 1)[0] for s in full.segments}
    names = {s.name for s in low.segments}
    if set(low.quantization) != projs:
        raise Malformed(f"{where}.quantization does not name the layer's projections")
    for proj in projs:
        q = low.quantization[proj]
        if q is None or q["bits"] != bits or q["mode"] != "affine" or \
                not {f"{proj}.weight", f"{proj}.scales", f"{proj}.biases"} <= names:
            raise Malformed(f"{where}: {proj} is not an affine {bits}-bit copy")
        rows = {s.name: s.shape[0] for s in low.segments if s.name.startswith(proj + ".")}
        full_rows = next(s.shape[0] for s in full.segments if s.name == f"{proj}.weight")
        scales = next(s for s in low.segments if s.name == f"{proj}.scales")
        if rows[f"{proj}.weight"] != full_rows or len(scales.shape) != 2 or \
                scales.shape[1] * q["group_size"] * bits != \
                next(s for s in low.segments if s.name == f"{proj}.weight").shape[1] * 32:
            raise Malformed(f"{where}: {proj}'s copy does not match its record's shape")


def _low_copies(entries, w: str, bits: int, main: Tuple[LayerSpec, ...]):
    """One width's copies of ``main``'s layers, each checked against its layer."""
    if not isinstance(entries, list):
        raise Malformed(f"{w} is not a list")
    specs = tuple(replace(layer_from_dict(spec, f"{w}[{j}]", LOW_RECORD_ALIGNMENT), copy_bits=bits)
                  for j, spec in enumerate(entries))
    if [(s.layer, s.module, s.num_experts, s.top_k) for s in specs] != \
            [(s.layer, s.module, s.num_experts, s.top_k) for s in main]:
        raise Malformed(f"{w} are not the manifest's layers")
    for j, (low, full) in enumerate(zip(specs, main)):
        _check_low_layer(low, full, bits, f"{w}[{j}]")
    return specs


def _low_bits_from_list(entries, main: Tuple[LayerSpec, ...],
                        ranks: Tuple[Tuple[LayerSpec, ...], ...] = ()) -> Tuple[LowBits, ...]:
    """The low-bit copies of the experts: per width, the manifest's layers
    quantized (of a tensor-parallel conversion, each rank's slices), each
    in a file of its own."""
    if not isinstance(entries, list):
        raise Malformed("low_bits is not a list")
    out = []
    for i, e in enumerate(entries):
        w = f"low_bits[{i}]"
        bits = get_field(e, "bits", int, w)
        group = get_field(e, "group_size", int, w)
        if bits not in LOW_BITS or group not in LOW_GROUP_SIZES:
            raise Malformed(f"{w}: bits {bits} / group_size {group} are not a width mlx "
                            "quantizes to")
        specs = _low_copies(get_field(e, "layers", list, w), f"{w}.layers", bits, main)
        per_rank = ()
        if ranks:
            lists = get_field(e, "ranks", list, w)
            if len(lists) != len(ranks):
                raise Malformed(f"{w}.ranks holds {len(lists)} ranks' copies, not {len(ranks)}")
            per_rank = tuple(_low_copies(listed, f"{w}.ranks[{r}]", bits, rank)
                             for r, (listed, rank) in enumerate(zip(lists, ranks)))
            if per_rank[0] != specs:
                raise Malformed(f"{w}.ranks[0] are not its layers")
        elif "ranks" in e:
            raise Malformed(f"{w}.ranks: the conversion is not tensor parallel")
        out.append(LowBits(bits, group, specs, per_rank))
    if len({c.bits for c in out}) != len(out):
        raise Malformed("low_bits lists a width twice")
    files = [s.file for s in (tuple(spec for r in ranks for spec in r) if ranks else main)] + \
        [s.file for c in out for s in c.all_layers]
    if len(set(files)) != len(files):
        raise Malformed("a low-bit blob shares a file with another layer")
    return tuple(out)


def _ranks_from_dict(d, main: Tuple[LayerSpec, ...]) -> Tuple[Tuple[LayerSpec, ...], ...]:
    """Each rank's expert layers of a tensor-parallel conversion: the same
    layers as rank 0's (``main``), each rank in files of its own."""
    n = _nonneg(get_field(d, "ranks", int, "tensor_parallel"), "tensor_parallel.ranks", 2)
    lists = get_field(d, "layers", list, "tensor_parallel")
    if len(lists) != n:
        raise Malformed(f"tensor_parallel.layers has {len(lists)} ranks, not {n}")
    ranks = []
    for r, entries in enumerate(lists):
        if not isinstance(entries, list):
            raise Malformed(f"tensor_parallel.layers[{r}] is not a list")
        specs = tuple(layer_from_dict(spec, f"tensor_parallel.layers[{r}][{i}]")
                      for i, spec in enumerate(entries))
        same = [(s.layer, s.module, s.num_experts, s.top_k) for s in specs] == \
            [(s.layer, s.module, s.num_experts, s.top_k) for s in main]
        if not same:
            raise Malformed(f"tensor_parallel.layers[{r}] are not the manifest's layers")
        ranks.append(specs)
    if ranks[0] != main:
        raise Malformed("tensor_parallel.layers[0] are not the manifest's layers")
    files = [s.file for rank in ranks for s in rank]
    if len(set(files)) != len(files):
        raise Malformed("two ranks' layers share a file")
    return tuple(ranks)


def _dense_ranks_from_dict(d, main: Tuple[DenseSpec, ...]) -> Tuple[Tuple[DenseSpec, ...], ...]:
    """Each rank's dense records of a tensor-parallel conversion (none before
    they were split): the same layers as rank 0's (``main``), in files of its own."""
    if "dense" not in d:
        return ()
    lists = get_field(d, "dense", list, "tensor_parallel")
    if len(lists) != d["ranks"]:
        raise Malformed(f"tensor_parallel.dense has {len(lists)} ranks, not {d['ranks']}")
    ranks = tuple(_dense_from_list(entries, f"tensor_parallel.dense[{r}]")
                  for r, entries in enumerate(lists))
    if ranks[0] != main:
        raise Malformed("tensor_parallel.dense[0] are not the manifest's dense records")
    def names(specs):
        return [(s.layer, s.prefix, [g.name for g in s.segments]) for s in specs]

    for r, specs in enumerate(ranks):
        if names(specs) != names(main):
            raise Malformed(f"tensor_parallel.dense[{r}] are not the manifest's dense layers")
    files = [s.file for rank in ranks for s in rank]
    if len(set(files)) != len(files):
        raise Malformed("two ranks' dense records share a file")
    return ranks


def dense_from_dict(d, where: str = "dense") -> DenseSpec:
    """A ``DenseSpec`` from its manifest entry, every field checked."""
    nbytes, segments, file, layer = _record_fields(d, where, "nbytes")
    prefix = get_field(d, "prefix", str, where)
    if not prefix.endswith(f".{layer}") or prefix.startswith("."):
        raise Malformed(f"{where}.prefix {prefix!r} is not the path of layer {layer}")
    if any(s.offset % SEGMENT_ALIGNMENT for s in segments):
        raise Malformed(f"{where}: a segment is not aligned to {SEGMENT_ALIGNMENT} bytes")
    quantization = _quantization_from_dict(get_field(d, "quantization", dict, where), where)
    if any(q is None for q in quantization.values()):
        raise Malformed(f"{where}.quantization lists an unquantized module")
    modules = {s.name.rsplit(".", 1)[0] for s in segments if "." in s.name}
    if not set(quantization) <= modules:
        raise Malformed(f"{where}.quantization names a module the record does not hold")
    crc = get_field(d, "crc32", int, where)
    if not 0 <= crc < 1 << 32:
        raise Malformed(f"{where}.crc32 is not an unsigned 32-bit integer")
    return DenseSpec(layer=layer, prefix=prefix, file=file,
                     nbytes=nbytes, segments=segments, quantization=quantization, crc32=crc)


def _dense_from_list(entries, where: str = "dense") -> Tuple[DenseSpec, ...]:
    if not isinstance(entries, list):
        raise Malformed(f"{where} is not a list")
    specs = tuple(dense_from_dict(e, f"{where}[{i}]") for i, e in enumerate(entries))
    if [s.layer for s in specs] != sorted(s.layer for s in specs):
        raise Malformed(f"{where}: records are not in layer order")
    for what in ("layer", "prefix", "file"):
        values = [getattr(s, what) for s in specs]
        if len(set(values)) != len(values):
            raise Malformed(f"{where}: two records share a {what}")
    return specs


def _ranks_to_dict(manifest: Manifest) -> dict:
    d = {"ranks": len(manifest.ranks),
         "layers": [[layer_to_dict(spec) for spec in rank] for rank in manifest.ranks]}
    if manifest.dense_ranks:
        d["dense"] = [[asdict(spec) for spec in rank] for rank in manifest.dense_ranks]
    return d


def _mtp_from_dict(d, main: Tuple[LayerSpec, ...]) -> "MtpSpec":
    if not isinstance(d, dict):
        raise Malformed("mtp is not an object")
    (spine,) = _spine_from_list([get_field(d, "spine", dict, "mtp")])
    layers = tuple(layer_from_dict(spec, f"mtp.layers[{i}]")
                   for i, spec in enumerate(get_field(d, "layers", list, "mtp")))
    for what in ("layer", "module", "file"):
        values = [getattr(s, what) for s in main + layers]
        if len(set(values)) != len(values):
            raise Malformed(f"an MTP layer shares a {what} with another layer")
    return MtpSpec(spine, layers)


def _low_bits_to_dict(copies: LowBits) -> dict:
    d = {"bits": copies.bits, "group_size": copies.group_size,
         "layers": [layer_to_dict(spec) for spec in copies.layers]}
    if copies.ranks:
        d["ranks"] = [[layer_to_dict(spec) for spec in rank] for rank in copies.ranks]
    return d


def manifest_to_dict(manifest: Manifest) -> dict:
    return {
        "format": FORMAT_NAME,
        "version": manifest.version,
        "record_alignment": RECORD_ALIGNMENT,
        "segment_alignment": SEGMENT_ALIGNMENT,
        "checksum": "crc32",
        "source": manifest.source,
        "spine": [asdict(s) for s in manifest.spine],
        "layers": [layer_to_dict(spec) for spec in manifest.layers],
        **({"mtp": {"spine": asdict(manifest.mtp.spine),
                    "layers": [layer_to_dict(spec) for spec in manifest.mtp.layers]}}
           if manifest.mtp is not None else {}),
        **({"dense": [asdict(d) for d in manifest.dense]} if manifest.version >= 2 else {}),
        **({"tensor_parallel": _ranks_to_dict(manifest)} if manifest.ranks else {}),
        **({"low_bits": [_low_bits_to_dict(c) for c in manifest.low_bits]}
           if manifest.low_bits else {}),
    }
