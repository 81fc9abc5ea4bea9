"""Expert blobs: one fixed-stride record per expert of an MoE block.
"""

import os
from pathlib import Path
from typing import List

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import ConversionError
from ..format import (
    LayerSpec,
    dtype_name,
    experts_dir,
    layout_record,
    record_checksum,
)
from ..models.discover import (
    input_dims_of,
    num_experts,
    probe_top_k,
    quantization_of,
)

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


def expert_tensors(block, num: int):
    """The per-expert tensors of a block (leading axis = experts) and the
    rest (kept in the spine)."""
    experts, rest = [], []
    for name, value in tree_flatten(block.parameters()):
        (experts if value.ndim >= 1 and value.shape[0] == num else rest).append((name, value))
    return experts, rest


def write_blob(path: Path, views, stride: int, segments, progress) -> List[int]:
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
    checksums = write_blob(experts_dir(dst) / file, views, stride, segments, progress)
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


def convert_layer(block, path, layer, file, top_k, dst: Path, progress) -> LayerSpec:
    num = num_experts(block)
    tensors, _ = expert_tensors(block, num)
    mx.eval([t for _, t in tensors])
    # [E, nbytes] byte views of each tensor (bfloat16 has no numpy dtype).
    tensors = [
        (name, dtype_name(t.dtype), t.shape[1:],
         np.array(t.reshape(num, -1).view(mx.uint8), copy=False))
        for name, t in tensors
    ]
    return write_layer(dst, path, layer, file, block, top_k, tensors, progress)


def release_experts(block, spec: LayerSpec) -> None:
    names = {s.name for s in spec.segments}
    block.update(
        tree_unflatten(
            [(k, mx.array([])) for k, _ in tree_flatten(block.parameters()) if k in names]
        )
    )
