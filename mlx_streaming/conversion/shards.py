"""Convert an mlx-lm model on the Hub into a stream directory, shard by
shard, so that the extra disk it needs is about one shard, not the model.

For each weight shard: download it, write the blobs of the layers whose
experts it completes and its spine tensors, delete it. Expert tensors of a
layer that continues in a later shard wait on disk (``.pending``) until
then, so the extra disk is one shard and the tensors of layers split across
shards. The model is laid out from the shards' safetensors headers (fetched
by range request) before anything is downloaded, and the expert records
are those ``mlx_streaming convert`` writes for the same model. The spine
stays whole in safetensors (a version 2 manifest without dense records):
its layers cannot be streamed, as they can after ``mlx_streaming convert``.

The conversion is written into ``DST.partial`` and renamed to ``DST`` when
complete; a run that was killed starts over.
"""

import fcntl
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.utils import infer_quant_config, load_model, save_config

from ..errors import ConversionError
from ..format import (
    FORMAT_VERSION,
    TOKENIZER_PATTERNS,
    LayerSpec,
    Manifest,
    dtype_name,
    experts_dir,
    fsync_path,
    manifest_path,
    spine_manifest,
    write_manifest,
)
from ..models.discover import find_expert_blocks, layer_index, num_experts
from .experts import expert_tensors, find_top_k, write_layer

INDEX = "model.safetensors.index.json"
# Headers of weight files read at once.
HEADER_THREADS = 8
ST_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "U32": mx.uint32,
             "U8": mx.uint8, "I8": mx.int8, "I32": mx.int32, "U16": mx.uint16,
             "I16": mx.int16, "I64": mx.int64, "U64": mx.uint64, "BOOL": mx.bool_}


def _say(msg: str) -> None:
    print(f"[mlx_streaming] {msg}", file=sys.stderr, flush=True)


def convert_repo(repo, dst: Path,
                 on_shard: Optional[Callable[[str], None]] = None) -> Path:
    """The stream directory of the plain mlx-lm model ``repo`` (a
    ``hub.HubRepo``), converted into ``dst`` unless already there.

    Args:
        on_shard: called with each shard's name once it is downloaded, before
            it is converted and deleted (tests measure the disk there).
    """
    if manifest_path(dst).is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    # One conversion of a repo at a time: a second process waits, then finds it done.
    with open(dst.with_name(dst.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if manifest_path(dst).is_file():
            return dst
        work = dst.with_name(dst.name + ".partial")
        shutil.rmtree(work, ignore_errors=True)
        (work / ".download").mkdir(parents=True)
        try:
            _convert(repo, work, on_shard)
        except OSError as e:
            raise ConversionError(f"converting {repo.repo_id} into {work} failed "
                                  f"({e.strerror}); check that the disk has room, then run "
                                  "again") from None
        shutil.rmtree(work / ".download", ignore_errors=True)
        shutil.rmtree(work / ".pending", ignore_errors=True)
        fsync_path(work)
        os.replace(work, dst)
    return dst


def _download(repo, filename: str, into: Path) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo.repo_id, filename, revision=repo.commit,
                                    endpoint=repo.endpoint, local_dir=str(into)))
    except Exception as e:
        raise ConversionError(f"cannot download {filename} of {repo.repo_id} "
                              f"({type(e).__name__}); check the network and the disk") from None


def _small_files(repo) -> List[str]:
    """config, index and tokenizer files: everything but the weights."""
    out = []
    for name in repo.files:
        if "/" in name or name.endswith(".safetensors"):
            continue
        if any(Path(name).match(p) for p in TOKENIZER_PATTERNS) or name == "config.json":
            out.append(name)
    return sorted(out)


def _headers(repo) -> Tuple[Dict[str, str], Dict[str, Tuple[str, tuple]]]:
    """``(tensor -> shard, tensor -> (dtype, shape))`` from the safetensors
    headers, read by range request, of the files mlx_lm.load reads
    (``HubRepo.weight_files``: an index need not list them, nor exist)."""
    from concurrent.futures import ThreadPoolExecutor

    from huggingface_hub import HfApi

    api = HfApi(endpoint=repo.endpoint)

    def header(name: str):
        try:
            return api.parse_safetensors_file_metadata(repo.repo_id, name,
                                                       revision=repo.commit)
        except Exception as e:
            raise ConversionError(f"cannot read the safetensors header of {name} in "
                                  f"{repo.repo_id} ({type(e).__name__}); is it an mlx-lm "
                                  "model?") from None

    names = repo.weight_files
    with ThreadPoolExecutor(max_workers=max(1, min(HEADER_THREADS, len(names)))) as pool:
        headers = list(pool.map(header, names))
    weight_map, tensors = {}, {}
    for shard, fmeta in zip(names, headers):
        for name, t in fmeta.tensors.items():
            if t.dtype not in ST_DTYPES:
                raise ConversionError(f"{repo.repo_id}: tensor {name} has dtype {t.dtype}, "
                                      "which MLX does not load")
            weight_map[name] = shard
            tensors[name] = (t.dtype, tuple(t.shape))
    return weight_map, tensors


def _skeleton(folder: Path, tensors: Dict[str, Tuple[str, tuple]]):
    """The model built from config.json alone, quantized as its weights
    say (mlx-lm's own rule, applied to their shapes), never evaluated."""
    try:
        model, config = load_model(folder, lazy=True, strict=False)
    except (ValueError, KeyError, TypeError) as e:
        raise ConversionError(f"mlx-lm cannot build the model: {e}") from None
    shapes = {k: mx.zeros(shape, ST_DTYPES[dtype]) for k, (dtype, shape) in tensors.items()}
    quantization = config.get("quantization")
    if quantization is not None:

        def predicate(path, module):
            if not hasattr(module, "to_quantized") or "scales" in module:
                return False  # not quantizable, or load_model already did it
            if path in quantization:
                return quantization[path]
            if f"{path}.scales" not in shapes:
                return False
            return infer_quant_config(path, module, shapes)

        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                    mode=quantization.get("mode", "affine"), class_predicate=predicate)
    return model, config


class _Layer:
    """One expert block being assembled from the shards that hold it."""

    def __init__(self, path: str, block, layer: int, file: str, names: List[str], top_k: int):
        self.path, self.block, self.layer, self.file = path, block, layer, file
        self.names = names  # per-expert tensors, in the record's order
        self.top_k = top_k
        self.num = num_experts(block)
        self.parts: Dict[str, Tuple[str, tuple, Path]] = {}  # name -> spilled bytes

    def full(self, name: str) -> str:
        return f"{self.path}.{name}"


def _plan(model, config, weight_map) -> List[_Layer]:
    blocks = find_expert_blocks(model)
    if not blocks:
        raise ConversionError(f"the model ({config.get('model_type')}) has no routed "
                              "experts: it is not a MoE model")
    layers, files = [], set()
    for ordinal, (path, block) in enumerate(blocks):
        layer = layer_index(path, ordinal)
        file = f"layer{layer:03d}.blob"
        if file in files:
            file = f"block{ordinal:03d}.blob"
        files.add(file)
        names = [n for n, _ in expert_tensors(block, num_experts(block))[0]]
        missing = [n for n in names if f"{path}.{n}" not in weight_map]
        if missing:
            raise ConversionError(
                f"the shards lack {path}.{missing[0]}: the repo is not in mlx-lm's format "
                "(experts stacked per layer); convert it with `mlx_lm.convert` first")
        layers.append(_Layer(path, block, layer, file, names,
                             find_top_k(model, path, block, config)))
    return layers


def _convert(repo, work: Path, on_shard) -> None:
    download = work / ".download"
    for name in _small_files(repo):
        _download(repo, name, download)
    weight_map, tensors = _headers(repo)
    model, config = _skeleton(download, tensors)
    layers = _plan(model, config, weight_map)
    streamed = {spec.full(n) for spec in layers for n in spec.names}
    experts_dir(work).mkdir(parents=True, exist_ok=True)
    (work / ".pending").mkdir()
    shards = sorted(set(weight_map.values()))
    specs: Dict[str, LayerSpec] = {}
    spine_map: Dict[str, str] = {}
    for i, shard in enumerate(shards):
        path = _download(repo, shard, download)
        weights = _load_shard(path, repo)
        for layer in layers:
            present = [n for n in layer.names if layer.full(n) in weights]
            if not present or layer.file in specs:
                continue
            if len(layer.parts) + len(present) == len(layer.names):
                specs[layer.file] = _write_layer(layer, weights, work)
            else:  # the layer goes on in a later shard
                _spill(layer, weights, present, work)
        spine = {k: v for k, v in weights.items() if k not in streamed}
        if spine:
            mx.save_safetensors(str(work / shard), spine, metadata={"format": "mlx"})
            fsync_path(work / shard)
            spine_map.update({k: shard for k in spine})
        del weights, spine
        if on_shard is not None:
            on_shard(shard)  # the most disk this conversion holds: the shard is still there
        path.unlink()
        _say(f"{repo.repo_id}: shard {i + 1}/{len(shards)} ({shard}) converted and deleted")
    if len(specs) != len(layers):
        raise ConversionError(f"{repo.repo_id}: the shards did not hold every expert tensor")
    _finish(repo, work, download, config, [specs[spec.file] for spec in layers], spine_map)


def _load_shard(path: Path, repo) -> Dict[str, mx.array]:
    try:
        return mx.load(str(path))
    except (RuntimeError, ValueError) as e:
        raise ConversionError(f"{path.name} of {repo.repo_id} cannot be read ({e}); the "
                              "download is damaged or not safetensors") from None


def _bytes(layer: _Layer, name: str, t: mx.array) -> np.ndarray:
    """``[experts, nbytes]`` bytes of one per-expert tensor."""
    if t.shape[0] != layer.num:
        raise ConversionError(f"{layer.full(name)} has {t.shape[0]} experts, the model "
                              f"{layer.num}")
    return np.array(t.reshape(layer.num, -1).view(mx.uint8), copy=False)


def _spill(layer: _Layer, weights: Dict[str, mx.array], names: List[str], work: Path) -> None:
    """Keep this shard's tensors of an unfinished layer in ``.pending``."""
    for name in names:
        t = weights[layer.full(name)]
        spill = work / ".pending" / f"{layer.file}.{name}.npy"
        np.save(spill, _bytes(layer, name, t))
        layer.parts[name] = (dtype_name(t.dtype), tuple(t.shape[1:]), spill)


def _write_layer(layer: _Layer, weights: Dict[str, mx.array], work: Path) -> LayerSpec:
    """Write the blob of a layer from this shard's tensors and the ones kept
    from earlier shards, then drop those."""
    tensors = []
    for name in layer.names:
        t = weights.get(layer.full(name))
        if t is not None:
            tensors.append((name, dtype_name(t.dtype), tuple(t.shape[1:]),
                            _bytes(layer, name, t)))
        else:
            dtype, shape, spill = layer.parts[name]
            tensors.append((name, dtype, shape, np.load(spill, mmap_mode="r")))
    spec = write_layer(work, layer.path, layer.layer, layer.file, layer.block, layer.top_k,
                       tensors)
    for *_, spill in layer.parts.values():
        spill.unlink()
    layer.parts.clear()
    return spec


def _finish(repo, work: Path, download: Path, config: dict, specs: List[LayerSpec],
            spine_map: Dict[str, str]) -> None:
    save_config(dict(config), work / "config.json")
    for f in download.iterdir():
        if f.is_file() and f.name not in ("config.json", INDEX):
            shutil.copyfile(f, work / f.name)
    index = {"metadata": {}, "weight_map": dict(sorted(spine_map.items()))}
    (work / INDEX).write_text(json.dumps(index, indent=1))
    for f in work.iterdir():
        if f.is_file():
            fsync_path(f)
    source = {"model": f"{repo.repo_id}@{repo.commit}", "fingerprint": repo.commit,
              "options": {"from": "hub, shard by shard"}}
    write_manifest(work, Manifest(FORMAT_VERSION, tuple(specs), source, spine_manifest(work)))
