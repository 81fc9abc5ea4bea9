"""Multi-token-prediction (MTP) layers: kept by the converter, attached at
load (``load(..., mtp=True)``), drafted with (``decode.mtp.MtpDraft``); built
from the family's own classes (docs/design.md, "models/mtp_layers.py")."""

import re
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.utils import infer_quant_config

from ..errors import ConversionError

MTP_FILE = "mtp.safetensors"


CONFIG_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")


# Tensors of the MTP module that are not the decoder layer's.
OWN = ("enorm", "hnorm", "eh_proj", "shared_head.norm")


# Copies of the main model's embedding and head, which the module shares.
SHARED = ("embed_tokens", "shared_head.head")


def mtp_layers_of(config: dict) -> int:
    for cfg in (config, config.get("text_config") or {}):
        for key in CONFIG_KEYS:
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return cfg[key]
    return 0


class MTPLayer(nn.Module):
    """One next-token-prediction depth around the family's decoder layer."""

    def __init__(self, args, layer_cls, layer_idx: int):
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(hidden, eps=eps)
        self.hnorm = nn.RMSNorm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer_cls(args, layer_idx)
        self.shared_head = nn.Module()
        self.shared_head.norm = nn.RMSNorm(hidden, eps=eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache) -> mx.array:
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache, return_array=True)
        return self.layer(x, mask, cache)


def supports(model: nn.Module) -> Optional[str]:
    """Why ``model`` cannot carry DeepSeek-V3-style MTP layers, or None."""
    inner = getattr(model, "model", None)
    for what, ok in (("model.layers", hasattr(inner, "layers")),
                     ("model.embed_tokens", hasattr(inner, "embed_tokens")),
                     ("lm_head", hasattr(model, "lm_head")),
                     ("args.rms_norm_eps", hasattr(getattr(model, "args", None),
                                                   "rms_norm_eps"))):
        if not ok:
            return f"its mlx-lm model has no {what}"
    return None


def build(model: nn.Module, count: int) -> List[MTPLayer]:
    """``count`` MTP layers for ``model`` (mlx-lm), unevaluated."""
    layers = model.model.layers
    layer_cls = type(layers[-1])
    first = len(layers)
    return [MTPLayer(model.args, layer_cls, first + i) for i in range(count)]


def source_tensors(files: Sequence, first: int, count: int) -> Dict[int, Dict[str, mx.array]]:
    """The MTP tensors in safetensors ``files``: ``{depth: {name: array}}``,
    names relative to ``model.layers.{first + depth}``."""
    out: Dict[int, Dict[str, mx.array]] = {}
    pattern = re.compile(r"model\.layers\.(\d+)\.(.+)")
    for f in files:
        for name, value in mx.load(str(f)).items():
            m = pattern.fullmatch(name)
            if m and first <= int(m.group(1)) < first + count:
                out.setdefault(int(m.group(1)) - first, {})[m.group(2)] = value
    return out


def sanitize(model: nn.Module, tensors: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """The family's own ``sanitize`` on one MTP layer's tensors, renamed as layer
    0's and back into ``MTPLayer``'s names."""
    own = {k: v for k, v in tensors.items() if k.startswith(OWN)}
    layer = {f"model.layers.0.{k}": v for k, v in tensors.items()
             if not k.startswith(OWN) and not k.startswith(SHARED)}
    if hasattr(model, "sanitize"):
        layer = model.sanitize(layer)
    out = {f"layer.{k[len('model.layers.0.'):]}": v for k, v in layer.items()
           if k.startswith("model.layers.0.")}
    out.update(own)
    return out


def load_weights(mtp: MTPLayer, weights: Dict[str, mx.array], quantization: Optional[dict]):
    """Quantize ``mtp`` as its weights say (mlx-lm's rule: a module is
    quantized when its ``scales`` are there), then load them."""
    if quantization is not None:
        def predicate(path, module):
            if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
                return False
            return infer_quant_config(path, module, weights)

        nn.quantize(mtp, group_size=quantization["group_size"], bits=quantization["bits"],
                    mode=quantization.get("mode", "affine"), class_predicate=predicate)
    mtp.load_weights(list(weights.items()), strict=False)


def quantize(mtp: MTPLayer, group_size: int, bits: int, mode: str) -> None:
    """Quantize while converting (``-q``), as mlx-lm's quantizer would."""
    nn.quantize(mtp, group_size=group_size, bits=bits, mode=mode,
                class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % group_size == 0)


def check_complete(mtp: MTPLayer, weights: Dict[str, mx.array], where: str) -> None:
    missing = sorted(set(k for k, _ in tree_flatten(mtp.parameters())) - set(weights))
    if missing:
        raise ConversionError(f"{where} lacks {len(missing)} MTP weights (first: {missing[0]})")
