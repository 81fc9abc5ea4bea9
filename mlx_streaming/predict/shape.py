"""A model's sizes as the loader would see them after conversion, from
its headers: the manifest's expert layers and dense records, the always
resident spine, the bytes one decode token reads, and its KV cache.
"""

import math
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Dict, List, Tuple

from ..conversion.experts import TOP_K_KEYS
from ..errors import FormatError
from ..format import (
    FORMAT_VERSION,
    RECORD_ALIGNMENT,
    SAFETENSORS_ITEMSIZE,
    DenseSpec,
    LayerSpec,
    Manifest,
    Segment,
    align,
    layer_in_path,
    layout_record,
)
from ..models.discover import layers_path
from .headers import ModelFiles

EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
# A module of stacked experts (mlx-lm's SwitchGLU/SwitchMLP, or an ``experts`` list).
EXPERT_MODULE = re.compile(r"\.(switch_mlp|switch_glu|experts)\.")


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan and the speed model need of a model."""

    manifest: Manifest
    base_bytes: int  # the always-resident spine (embeddings, head, norms, routers)
    active_bytes: int  # weights one decode token reads with every expert resident
    config: dict

    @property
    def record_bytes(self) -> int:
        return max(spec.stride for spec in self.manifest.layers)

    @property
    def moe_layers(self) -> int:
        return len(self.manifest.layers)

    @property
    def top_k(self) -> int:
        return max(spec.top_k for spec in self.manifest.layers)

    @property
    def experts(self) -> int:
        return max(spec.num_experts for spec in self.manifest.layers)

    @property
    def expert_bytes(self) -> int:
        return self.manifest.expert_nbytes

    @property
    def spine_bytes(self) -> int:
        return self.base_bytes + sum(d.nbytes for d in self.manifest.dense)


def text_config(config: dict) -> dict:
    """The language model's part of a config (a multimodal model nests it)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def model_shape(files: ModelFiles) -> ModelShape:
    """The shape of ``files``' model.

    Raises:
        FormatError: no routed experts, or no top-k in the config.
    """
    if files.manifest is not None:
        m = files.manifest
        active = (files.spine_bytes + sum(d.nbytes for d in m.dense)
                  + sum(spec.top_k * spec.expert_nbytes for spec in m.layers))
        return ModelShape(m, files.spine_bytes, active, files.config)
    return _from_tensors(files)


def _from_tensors(files: ModelFiles) -> ModelShape:
    config = text_config(files.config)
    experts = next((config[k] for k in EXPERT_COUNT_KEYS if isinstance(config.get(k), int)),
                   None)
    top_k = next((config[k] for k in TOP_K_KEYS if isinstance(config.get(k), int)), None)
    if not experts or not top_k:
        missing = "the number of experts" if not experts else "experts per token"
        raise FormatError(f"config.json of {files.name} has no {missing} (one of "
                          f"{', '.join(EXPERT_COUNT_KEYS if not experts else TOP_K_KEYS)}): "
                          "predict handles MoE models")
    blocks: Dict[str, List[Tuple[str, str, tuple, int]]] = defaultdict(list)
    rest: Dict[str, int] = {}
    for name, (dtype, shape) in sorted(files.tensors.items()):
        nbytes = math.prod(shape) * SAFETENSORS_ITEMSIZE.get(dtype, 1)  # F8_*: 1 byte
        match = list(EXPERT_MODULE.finditer(name))
        if match and len(shape) >= 2 and shape[0] == experts:
            end = match[-1].end() - 1
            blocks[name[:end]].append((name[end + 1:], dtype, shape[1:], nbytes // experts))
        else:
            rest[name] = nbytes
    if not blocks:
        raise FormatError(f"{files.name} has no stacked expert tensors ({experts} experts each, "
                          "in a switch_mlp or experts module): is it an mlx-lm MoE model?")
    layers = tuple(_layer_spec(path, i, tensors, experts, top_k)
                   for i, (path, tensors) in enumerate(sorted(
                       blocks.items(), key=lambda kv: layer_in_path(kv[0]) or 0)))
    dense = _dense_records(rest, files.tensors, set(blocks), experts)
    base = sum(rest.values()) - sum(d.nbytes_unpadded for d in dense)
    manifest = Manifest(FORMAT_VERSION, layers, dense=tuple(d.spec for d in dense))
    active = (sum(rest.values()) - _unread_embedding(files.config, rest)
              + sum(spec.top_k * spec.expert_nbytes for spec in layers))
    return ModelShape(manifest, base, active, files.config)


def _layer_spec(path: str, ordinal: int, tensors, experts: int, top_k: int) -> LayerSpec:
    segments, stride = layout_record([(n, d, s, b) for n, d, s, b in tensors])
    layer = layer_in_path(path)
    layer = ordinal if layer is None else layer
    return LayerSpec(layer, path, "SwitchGLU", f"layer{layer:03d}.blob", experts, top_k, stride,
                     segments, {}, ())


@dataclass(frozen=True)
class _Dense:
    spec: DenseSpec
    nbytes_unpadded: int


def _dense_records(rest: Dict[str, int], tensors, blocks: set, experts: int):
    """Each transformer layer's dense record as the converter writes it:
    its tensors of two or more axes outside the experts and routers."""
    lists = [layers_path(b) for b in blocks]
    lst = max(set(lists) - {None}, key=lists.count, default=None)
    by_layer: Dict[int, list] = defaultdict(list)
    for name, nbytes in rest.items():
        dtype, shape = tensors[name]
        if lst is None or not name.startswith(lst + "."):
            continue
        index = name[len(lst) + 1:].split(".", 1)[0]
        if not index.isdigit() or len(shape) < 2:
            continue
        if shape[0] == experts:  # a router (or its scales): resident
            continue
        by_layer[int(index)].append((name[len(lst) + len(index) + 2:], dtype, shape, nbytes))
    out = []
    for layer, items in sorted(by_layer.items()):
        segments, nbytes = layout_record(items)
        spec = DenseSpec(layer, f"{lst}.{layer}", f"layer{layer:03d}.blob", nbytes, segments,
                         {}, 0)
        out.append(_Dense(spec, sum(b for *_, b in items)))
    return out


def _unread_embedding(config: dict, rest: Dict[str, int]) -> int:
    """Bytes of an untied input embedding, which a token reads one row of
    (a tied one is read whole as the head)."""
    if text_config(config).get("tie_word_embeddings", config.get("tie_word_embeddings")):
        return 0
    return sum(n for k, n in rest.items() if "embed_tokens" in k)


def kv_cache_bytes(config: dict, context: int) -> int:
    """The bf16 KV cache of ``context`` tokens: every attention layer's
    keys and values, sliding-window layers holding at most their window
    (sizes the config lacks, or gives as other than numbers, count 0)."""
    c = text_config(config)

    def num(key: str, default: int = 0) -> int:
        value = c.get(key)
        return value if type(value) is int and value > 0 else default

    layers, heads = num("num_hidden_layers"), num("num_key_value_heads", num("num_attention_heads"))
    head_dim = num("head_dim", num("hidden_size") // max(1, num("num_attention_heads", 1)))
    types = c.get("layer_types")
    types = types if isinstance(types, list) else ["full_attention"] * layers
    window = num("sliding_window", context)
    total = 0
    for kind in types[:layers]:
        full = kind != "sliding_attention"
        dim = num("global_head_dim", head_dim) if full else head_dim
        kv = num("num_global_key_value_heads", heads) if full else heads
        total += 2 * kv * dim * (context if full else min(context, window)) * 2
    return total


def split(shape: ModelShape, ranks: int) -> ModelShape:
    """One rank's share of a model split tensor-parallel over ``ranks``
    Macs: a slice of every expert and dense record; the resident spine
    (embeddings, head, norms, routers) is kept whole on each."""
    if ranks == 1:
        return shape

    def sliced(nbytes: int) -> Tuple[Tuple[Segment, ...], int]:
        part = -(-nbytes // ranks)
        return (Segment("slice", "uint8", (part,), 0, part),), align(part, RECORD_ALIGNMENT)

    layers = []
    for spec in shape.manifest.layers:
        segments, stride = sliced(spec.expert_nbytes)
        layers.append(replace(spec, segments=segments, stride=stride))
    dense = []
    for d in shape.manifest.dense:
        segments, nbytes = sliced(d.tensor_nbytes)
        dense.append(replace(d, segments=segments, nbytes=nbytes))
    manifest = replace(shape.manifest, layers=tuple(layers), dense=tuple(dense))
    resident = shape.base_bytes
    active = resident + (shape.active_bytes - resident) // ranks
    return replace(shape, manifest=manifest, active_bytes=active)
