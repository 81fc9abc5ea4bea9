"""Real-size mlx-lm model directories made of sparse files: valid
safetensors headers over holes, so that a 130 GB model's shapes cost a
few hundred kilobytes of disk. ``predict``'s tests and its validation
(``scripts/predict_validation.py``) read them as they would a real repo.
"""

import json
import math
import struct
from pathlib import Path
from typing import Dict, List, Tuple

ITEMSIZE = {"U32": 4, "BF16": 2, "F32": 4}
SHARD_BYTES = 5 * 10**9  # mlx-lm's default shard size


def quantized(name: str, out: int, inp: int, bits: int = 4, group: int = 64,
              lead: Tuple[int, ...] = ()) -> List[Tuple[str, str, tuple]]:
    """mlx-lm's affine-quantized Linear: packed weight, scales, biases."""
    return [(f"{name}.weight", "U32", lead + (out, inp * bits // 32)),
            (f"{name}.scales", "BF16", lead + (out, inp // group)),
            (f"{name}.biases", "BF16", lead + (out, inp // group))]


def qwen3_moe(c: dict) -> List[Tuple[str, str, tuple]]:
    """A Qwen3-MoE model at 4 bits (routers at 8), as mlx-community ships it."""
    h, e, inter = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    out = quantized("model.embed_tokens", c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for proj, o, n in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h),
                           ("o_proj", h, q)):
            out += quantized(f"{p}.self_attn.{proj}", o, n)
        out += [(f"{p}.self_attn.q_norm.weight", "BF16", (c["head_dim"],)),
                (f"{p}.self_attn.k_norm.weight", "BF16", (c["head_dim"],)),
                (f"{p}.input_layernorm.weight", "BF16", (h,)),
                (f"{p}.post_attention_layernorm.weight", "BF16", (h,))]
        out += quantized(f"{p}.mlp.gate", e, h, bits=8)
        for proj, o, n in (("gate_proj", inter, h), ("up_proj", inter, h),
                           ("down_proj", h, inter)):
            out += quantized(f"{p}.mlp.switch_mlp.{proj}", o, n, lead=(e,))
    out += [("model.norm.weight", "BF16", (h,))]
    if not c.get("tie_word_embeddings"):
        out += quantized("lm_head", c["vocab_size"], h)
    return out


def gemma4_moe(c: dict) -> List[Tuple[str, str, tuple]]:
    """A Gemma 4 MoE model at 4 bits: per layer attention (sliding or
    global), a dense MLP beside the routed experts, and a router."""
    h, e, inter = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    out = quantized("model.embed_tokens", c["vocab_size"], h)
    for i, kind in enumerate(c["layer_types"][:c["num_hidden_layers"]]):
        p = f"model.layers.{i}"
        full = kind == "full_attention"
        dim = c["global_head_dim"] if full else c["head_dim"]
        kv = (c["num_global_key_value_heads"] if full else c["num_key_value_heads"]) * dim
        q = c["num_attention_heads"] * dim
        for proj, o, n in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h),
                           ("o_proj", h, q)):
            out += quantized(f"{p}.self_attn.{proj}", o, n)
        for proj, o, n in (("gate_proj", c["intermediate_size"], h),
                           ("up_proj", c["intermediate_size"], h),
                           ("down_proj", h, c["intermediate_size"])):
            out += quantized(f"{p}.mlp.{proj}", o, n)
        out += quantized(f"{p}.router.proj", e, h, bits=8)
        for proj, o, n in (("gate_proj", inter, h), ("up_proj", inter, h),
                           ("down_proj", h, inter)):
            out += quantized(f"{p}.experts.switch_glu.{proj}", o, n, lead=(e,))
        out += [(f"{p}.{norm}.weight", "BF16", (h,)) for norm in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm")]
    return out + [("model.norm.weight", "BF16", (h,))]


FAMILIES = {"qwen3_moe": qwen3_moe, "gemma4": gemma4_moe}


def write_sparse_repo(root: Path, config: dict, shard_bytes: int = SHARD_BYTES) -> int:
    """Write ``config.json`` and sparse ``model-*.safetensors`` shards of
    the model ``config`` describes into ``root``; returns their bytes."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"no sparse layout for model_type {family!r}; one of {list(FAMILIES)}")
    root.mkdir(parents=True, exist_ok=True)
    shards: List[Dict[str, tuple]] = [{}]
    size = 0
    for name, dtype, shape in FAMILIES[family](config.get("text_config") or config):
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        if size + nbytes > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = (dtype, shape, nbytes)
        size += nbytes
    total, weight_map = 0, {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(root / name, tensors)
        weight_map.update({t: name for t in tensors})
    (root / "config.json").write_text(json.dumps(config, indent=1))
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def _write_shard(path: Path, tensors: Dict[str, tuple]) -> int:
    header, offset = {"__metadata__": {"format": "mlx"}}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)  # a hole: no disk used
    return offset
