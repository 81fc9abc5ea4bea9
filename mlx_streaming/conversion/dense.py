"""The spine: what stays resident in safetensors, and the per-layer dense
records (version 2) that may be streamed.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import make_shards

from ..errors import ConversionError
from ..format import (
    DenseSpec,
    dtype_name,
    fsync_path,
    layout_record,
    record_checksum,
    spine_dir,
)
from ..models.discover import (
    get_module,
    input_dims_of,
    layers_path,
    num_experts,
    parent_path,
    router_paths,
)
from .tensor_parallel import rank_file

SPINE_SHARD_GB = 1


def write_spine(model, streamed: set, dst: Path) -> None:
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


def convert_dense(model, blocks, keep: set, streamed: set, dst: Path,
                  rank: Optional[Tuple[int, int]] = None) -> Tuple[DenseSpec, ...]:
    """Write one record of each layer's dense tensors to ``spine/`` (of
    ``model`` sharded as rank ``(r, n)``, in files of that rank's, where given)."""
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
        specs.append(write_dense(dst, prefix, data, dense_quantization(model, prefix, tensors),
                                 rank))
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


def write_dense(dst: Path, prefix: str, tensors, quantization: Dict[str, dict],
                rank: Optional[Tuple[int, int]] = None) -> DenseSpec:
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
    file = f"layer{layer:03d}.blob" if rank is None else rank_file(layer, *rank)
    tmp = spine_dir(dst) / (file + ".tmp")
    with open(tmp, "wb") as f:
        f.write(record.data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, spine_dir(dst) / file)
    crc = record_checksum(record[s.offset:s.offset + s.nbytes] for s in segments)
    return DenseSpec(layer, prefix, file, nbytes, segments, quantization, crc)
