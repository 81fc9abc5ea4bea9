"""The mlx-lm model built around a stream directory: its spine loaded and
checked against the manifest, its MTP layers attached."""

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from ..config import StreamConfig
from ..errors import ConfigError, FormatError
from ..format import Manifest, check_safetensors, file_crc32, spine_files
from ..models import mtp_layers
from ..models.discover import find_expert_blocks, num_experts


def load_spine(path: Path, manifest: Manifest, model_config=None, trust_remote_code=False):
    """Build the mlx-lm model lazily and load all but the experts and dense
    records; the config returned is the model's own (without theirs)."""
    for f in spine_files(path):
        check_safetensors(f)
    overrides, added = _dense_quantization(path, manifest, model_config or {})
    try:
        model, model_config = load_model(path, lazy=True, strict=False,
                                         model_config=overrides,
                                         trust_remote_code=trust_remote_code)
        for key in added:
            model_config["quantization"].pop(key, None)
    except (ValueError, FileNotFoundError, KeyError, TypeError, RuntimeError) as e:
        raise FormatError(f"cannot build the model in {path}: {e}") from None
    blocks = dict(find_expert_blocks(model))
    for spec in manifest.layers:
        if spec.module not in blocks:
            raise FormatError(
                f"the manifest names expert block {spec.module}, which the "
                f"{model_config.get('model_type')} model does not have; re-convert"
            )
        have = num_experts(blocks[spec.module])
        if have != spec.num_experts:
            raise FormatError(
                f"layer {spec.layer}: the manifest records {spec.num_experts} experts but "
                f"the model has {have}; re-convert the model"
            )
    _check_spine_complete(path, model, manifest)
    return model, model_config


def _dense_quantization(path: Path, manifest: Manifest, model_config: dict):
    """``model_config`` with mlx-lm's per-module quantization for the dense records'
    quantized modules (whose scales are not in safetensors), and the keys added."""
    extra = {f"{d.prefix}.{name}": q for d in manifest.dense for name, q in d.quantization.items()}
    if not extra:
        return model_config, []
    try:
        on_disk = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise FormatError(f"cannot read {path}/config.json ({e}); re-convert the model, or "
                          "copy the source model's config.json back") from None
    base = model_config.get("quantization", on_disk.get("quantization"))
    if not isinstance(base, dict):
        raise FormatError(f"{path}/config.json has no quantization, but the dense records "
                          "hold quantized weights; re-convert the model")
    added = [k for k in extra if k not in base]
    return {**model_config, "quantization": {**base, **extra}}, added


def _check_spine_complete(path: Path, model: nn.Module, manifest: Manifest) -> None:
    streamed = {f"{spec.module}.{s.name}" for spec in manifest.layers for s in spec.segments}
    streamed |= {f"{d.prefix}.{s.name}" for d in manifest.dense for s in d.segments}
    weights = {}
    for f in spine_files(path):
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:
            raise FormatError(f"spine file {f} cannot be read ({e}); re-convert the model") from None
    if hasattr(model, "sanitize"):
        # Lazy arrays: whatever sanitize computes is never evaluated.
        weights = model.sanitize(weights)
    loaded = set(weights)
    params = dict(tree_flatten(model.parameters()))
    expected = set(params) - streamed
    for k in sorted(expected & loaded):
        if tuple(weights[k].shape) != tuple(params[k].shape):
            raise FormatError(
                f"spine tensor {k} is {tuple(weights[k].shape)} but the model expects "
                f"{tuple(params[k].shape)}; re-convert the model"
            )
    missing = sorted(expected - loaded)
    if missing:
        raise FormatError(
            f"{path} lacks {len(missing)} spine weights (first: {missing[0]}); "
            "the conversion is incomplete or damaged, re-convert the model"
        )


def attach_mtp(model: nn.Module, path: Path, manifest: Manifest, model_config: dict,
                config: StreamConfig) -> Manifest:
    """Build the MTP layers (``models.mtp_layers``) as ``model.mtp`` with their non-expert
    weights; returns the manifest with their expert layers, streamed like the rest."""
    if manifest.mtp is None:
        raise ConfigError(
            f"{path} has no MTP layers: the model declares none, or it was converted "
            "from weights without them (mlx-lm's converter drops them); convert from the "
            "original checkpoint, or draft with --draft ngram or --draft-model")
    unsupported = mtp_layers.supports(model)
    if unsupported:
        raise ConfigError(f"MTP drafting needs a DeepSeek-V3-style model, and "
                          f"{model_config.get('model_type')}'s is not: {unsupported}")
    f = path / manifest.mtp.spine.name
    if not f.is_file() or f.stat().st_size != manifest.mtp.spine.nbytes:
        raise FormatError(f"{f} is missing or not the size the manifest records; re-convert")
    if config.checksums == "always" and file_crc32(f) != manifest.mtp.spine.crc32:
        raise FormatError(f"{f} fails its checksum; re-convert the model")
    layers = mtp_layers.build(model, len(manifest.mtp.layers))
    weights = mx.load(str(f))
    for depth, layer in enumerate(layers):
        prefix = f"mtp.{depth}."
        mine = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        mtp_layers.load_weights(layer, mine, model_config.get("quantization") or
                         {"group_size": 64, "bits": 4})
    model.mtp = layers
    return replace(manifest, layers=manifest.layers + manifest.mtp.layers)


def spine_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in spine_files(path))


def check_experts_compute_here(manifest: Manifest) -> None:
    """Refuse unquantized half-precision experts on MLX's CPU backend, whose
    ``gather_mm`` computes float32 only: an error at load, not at the first token."""
    if mx.default_device() != mx.cpu:
        return
    for spec in manifest.layers:
        for seg in spec.segments:
            proj = seg.name.split(".", 1)[0]
            if (seg.name.endswith(".weight") and spec.quantization.get(proj) is None
                    and seg.dtype in ("float16", "bfloat16")):
                raise FormatError(
                    f"the experts of layer {spec.layer} are unquantized {seg.dtype}, which "
                    "MLX's CPU backend cannot compute (float32 only there); convert the "
                    "model again with -q, or with --dtype float32")
