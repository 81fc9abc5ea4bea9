"""Synthetic MoE models of any size, written without holding them in memory.

Benchmarks of I/O and memory need models of tens of GB on a machine with
less memory. This writes an mlx-lm architecture with random 4-bit weights
one layer at a time: the routed experts' bytes are drawn directly in their
quantized form (random 4-bit codes, scales and biases that keep each weight
within +-1/sqrt(fan_in)), so no float weights are ever materialised.

Two outputs: a stream directory (``fmt="stream"``) or an mlx-lm model
directory (``fmt="mlx-lm"``), which ``mlx_streaming convert`` turns into the
same stream directory and mlx-lm itself can load.
"""

import json
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import save_config

from ..conversion.dense import (
    dense_quantization,
    dense_tensors,
    resident_modules,
    start_dense,
    write_dense,
)
from ..conversion.experts import write_layer
from ..format import FORMAT_VERSION, Manifest, dtype_name, experts_dir, write_manifest
from ..mlx_lm_adapter import model_classes
from ..models.discover import find_expert_blocks, layer_index
from . import tiny

QUANTIZATION = {"group_size": 64, "bits": 4, "mode": "affine"}


def _skeleton(config: dict):
    """The model with lazily initialised, quantized parameters."""
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    nn.quantize(
        model,
        QUANTIZATION["group_size"],
        QUANTIZATION["bits"],
        class_predicate=lambda p, m: hasattr(m, "to_quantized")
        and m.weight.shape[-1] % QUANTIZATION["group_size"] == 0,
    )
    return model


def _random_experts(rng: np.random.Generator, shapes: dict, num: int) -> dict:
    """Random quantized expert tensors ``{name: [num, ...] array}``."""
    out = {}
    for name, (_, shape) in shapes.items():
        proj, kind = name.rsplit(".", 1)
        n = num * int(np.prod(shape))
        # Codes 0..15 times the scale, plus the bias, spread each weight
        # uniformly within +-1/sqrt(fan_in).
        fan_in = shapes[f"{proj}.scales"][1][-1] * QUANTIZATION["group_size"]
        if kind == "weight":
            data = np.frombuffer(rng.bytes(n * 4), dtype=np.uint32)
        elif kind == "scales":
            data = np.full(n, 2.0 / np.sqrt(fan_in) / 15, dtype=np.float32)
        elif kind == "biases":
            data = np.full(n, -1.0 / np.sqrt(fan_in), dtype=np.float32)
        else:  # an expert's output bias
            data = np.zeros(n, dtype=np.float32)
        out[name] = data.reshape(num, *shape)
    return out


def _write_dense(out: Path, model, blocks, rng: np.random.Generator, progress):
    """Dense records of random weights, one layer at a time: quantized
    tensors drawn in their quantized form, others small normal floats."""
    start_dense(out)
    specs = []
    keep = resident_modules(model, blocks)
    for prefix, tensors in sorted(dense_tensors(model, blocks, keep).items(),
                                  key=lambda kv: int(kv[0].rsplit(".", 1)[1])):
        data = {}
        for name, value in tensors.items():
            n = int(np.prod(value.shape))
            module, kind = name.rsplit(".", 1)
            if kind == "weight" and value.dtype == mx.uint32:
                array = np.frombuffer(rng.bytes(n * 4), dtype=np.uint32)
            elif kind in ("scales", "biases") and f"{module}.weight" in tensors:
                fan_in = tensors[f"{module}.scales"].shape[-1] * QUANTIZATION["group_size"]
                step = 2.0 / np.sqrt(fan_in) / 15
                array = np.full(n, step if kind == "scales" else -7.5 * step, dtype=np.float32)
            else:
                array = (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float32)
            if value.dtype not in (mx.uint32, mx.float32):
                array = np.array(mx.array(array).astype(value.dtype).view(mx.uint8), copy=False)
            data[name] = (dtype_name(value.dtype), value.shape, array.view(np.uint8).ravel())
        specs.append(write_dense(out, prefix, data, dense_quantization(model, prefix, tensors)))
        if progress is not None:
            progress(1)
    return tuple(specs)


def make_synthetic(
    out,
    tokenizer_dir: Path,
    family: str = "qwen3_moe",
    fmt: str = "stream",
    seed: int = 0,
    progress: Optional[Callable[[int], None]] = None,
    **overrides,
) -> Path:
    """Write a synthetic model; ``overrides`` change the family's tiny config
    (``hidden_size``, ``num_hidden_layers``, ``num_experts``, ...).

    Returns:
        The directory written.
    """
    if fmt not in ("stream", "mlx-lm"):
        raise ValueError("fmt must be 'stream' or 'mlx-lm'")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())["model"]["vocab"]
    config = tiny.tiny_config(family, len(vocab), **overrides)
    config["quantization"] = dict(QUANTIZATION)
    mx.random.seed(seed)
    model = _skeleton(config)
    blocks = find_expert_blocks(model)
    rng = np.random.default_rng(seed)
    streamed = set()
    layers = []
    shards = []
    top_k = next(config[k] for k in ("num_experts_per_tok", "num_experts_per_token") if k in config)
    if fmt == "stream":
        experts_dir(out).mkdir(exist_ok=True)
    for ordinal, (path, block) in enumerate(blocks):
        params = dict(tree_flatten(block.parameters()))
        num = next(iter(params.values())).shape[0]
        shapes = {k: (v.dtype, v.shape[1:]) for k, v in params.items()}
        tensors = _random_experts(rng, shapes, num)
        streamed.update(f"{path}.{k}" for k in params)
        layer = layer_index(path, ordinal)
        if fmt == "stream":
            views = [(k, str(v.dtype), v.shape[1:], v.reshape(num, -1).view(np.uint8))
                     for k, v in tensors.items()]
            layers.append(write_layer(out, path, layer, f"layer{layer:03d}.blob", block, top_k,
                                      views))
        else:
            shard = f"experts-{layer:03d}.safetensors"
            mx.save_safetensors(str(out / f"model-{shard}"),
                                {f"{path}.{k}": mx.array(v) for k, v in tensors.items()})
            shards.append(shard)
        if progress is not None:
            progress(1)
    dense = ()
    if fmt == "stream":
        dense = _write_dense(out, model, blocks, rng, progress)
        streamed.update(f"{d.prefix}.{s.name}" for d in dense for s in d.segments)
    spine = {k: v for k, v in tree_flatten(model.parameters()) if k not in streamed}
    mx.save_safetensors(str(out / "model.safetensors"), spine, metadata={"format": "mlx"})
    save_config(config, out / "config.json")
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    if fmt == "stream":
        source = {"model": "synthetic", "family": family, "seed": seed, "fingerprint": "synthetic"}
        write_manifest(out, Manifest(FORMAT_VERSION, tuple(layers), source, dense=dense))
    return out
