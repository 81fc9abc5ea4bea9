"""Convert an mlx-lm MoE model into a stream directory.

The model is loaded lazily and written one MoE layer at a time, so the peak
memory is about one layer's experts (plus one spine shard), not the model.
A conversion that is killed never leaves a directory that loads: the
manifest is written last, atomically. Running the same command again keeps
the layers that were finished and redoes the rest.
"""

import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.utils import load_model, quantize_model, save_config

from ..errors import ConversionError, FormatError
from ..format import (
    FORMAT_VERSION,
    TOKENIZER_PATTERNS,
    VOCABULARY_FILES,
    LayerSpec,
    Manifest,
    MtpSpec,
    SpineFile,
    check_safetensors,
    experts_dir,
    file_crc32,
    fsync_path,
    has_vocabulary,
    manifest_path,
    spine_manifest,
    write_manifest,
)
from ..models import mtp_layers
from ..models.discover import (
    find_expert_blocks,
    get_module,
    layer_index,
    num_experts,
    projections,
)
from .copies import add_copies, check_low_bits
from .dense import convert_dense, resident_modules, start_dense, write_spine
from .experts import convert_layer, find_top_k, release_experts
from .resume import (
    SKIP_FILES,
    State,
    check_dst,
    check_not_source,
    clear_dst,
    conversion_fingerprint,
    dst_state,
    fsync_written,
    os_error,
)
from .tensor_parallel import check_ranks, rank_file, rank_models

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def resolve_source(src: str) -> Path:
    """A local model directory, or a Hugging Face repo fetched into the cache."""
    path = Path(src).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ConversionError(f"{src} has no config.json; it is not an mlx-lm model")
        if manifest_path(path).exists():
            raise ConversionError(f"{src} is already a stream directory: load or generate "
                                  "from it; convert takes the mlx-lm or Hub model")
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                src, allow_patterns=["*.safetensors", *TOKENIZER_PATTERNS, "*.py"]
            )
        )
    except Exception as e:
        raise ConversionError(
            f"{src} is not a local directory and could not be fetched from the "
            f"Hugging Face Hub ({type(e).__name__}); check the path or the network"
        ) from None


def _cast(model, dtype) -> None:
    def cast(p):
        return p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p

    model.update(tree_map(cast, model.parameters()))


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for pattern in TOKENIZER_PATTERNS:
        for f in src.glob(pattern):
            if f.name not in SKIP_FILES and f.is_file():
                shutil.copyfile(f, dst / f.name)


def convert(
    src,
    dst,
    *,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    q_mode: str = "affine",
    dtype: Optional[str] = None,
    force: bool = False,
    progress: bool = True,
    on_layer: Optional[Callable[[LayerSpec], None]] = None,
    tensor_parallel: int = 1,
    miss_bits: Sequence[int] = (),
) -> Path:
    """Convert the mlx-lm MoE model at ``src`` into a stream directory.

    Args:
        src: a local mlx-lm model directory or a Hugging Face repo id.
        dst: the stream directory to write.
        quantize: quantize the model (``q_bits``, ``q_group_size``,
            ``q_mode``) with mlx-lm's quantizer while converting.
        dtype: cast floating weights first (``float16``, ``bfloat16``,
            ``float32``); quantization scales take this dtype.
        force: overwrite a different model already converted at ``dst``.
        tensor_parallel: split every expert into this many ranks' slices, as
            the family's ``shard()`` does, each rank's in blobs of its own
            (for ``sharded_load(tensor_group=...)`` with as many ranks).
        miss_bits: widths (2, 3, ...) of low-bit copies of every expert to
            write besides the records (``StreamConfig.miss_bits`` reads them
            on a miss); added to a directory already converted.
        progress: show a progress bar.
        on_layer: called after each layer's blob is complete.

    Returns:
        The path of the stream directory.

    Raises:
        ConversionError: the model cannot be converted (not found, not MoE,
            already quantized and ``quantize`` asked, ...).
    """
    dst = Path(dst).expanduser()
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {', '.join(DTYPES)}")
    if quantize:
        check_quantization(q_bits, q_group_size, q_mode)
    check_ranks(tensor_parallel)
    miss_bits = check_low_bits(miss_bits, q_bits if quantize else None)
    options = dict(
        quantize=quantize, q_bits=q_bits, q_group_size=q_group_size, q_mode=q_mode, dtype=dtype
    )
    if tensor_parallel > 1:  # absent otherwise: earlier conversions keep their fingerprint
        options["tensor_parallel"] = tensor_parallel
    src_path = None
    try:
        src_path = resolve_source(str(src))
        check_not_source(src_path, dst)
        fingerprint = conversion_fingerprint(src_path, options)
        holds = dst_state(dst, fingerprint)
        if holds == "done" and not force:
            print(f"{dst} is already converted from {src}", file=sys.stderr)
            return add_copies(dst, miss_bits, progress)
        if not has_vocabulary(src_path):
            print(f"warning: {src} has no tokenizer vocabulary ({', '.join(VOCABULARY_FILES)}); "
                  "the converted model will not load until you copy it in", file=sys.stderr)
        check_dst(dst, holds, force)
        # Everything that can refuse the source runs before dst is touched.
        model, config = _load_source(src, src_path)
        def prepare(m, c):
            return _prepare_model(m, c, src, quantize, q_bits, q_group_size, q_mode, dtype)

        model, config, blocks = prepare(model, config)
        ranks = []
        if tensor_parallel > 1:
            ranks = rank_models(lambda: _quiet(prepare, *_load_source(src, src_path))[0],
                                tensor_parallel, config.get("model_type"))
        if holds in ("done", "stream", "model"):
            clear_dst(dst)
        experts_dir(dst).mkdir(parents=True, exist_ok=True)
        state = State(dst, fingerprint)
        state.start()
        out = _convert_layers(model, config, blocks, state, src, src_path, dst, fingerprint,
                              options, progress, on_layer, ranks)
        return add_copies(out, miss_bits, progress)
    except OSError as e:
        raise os_error(e, src_path, dst) from None


def _quiet(prepare, model, config):
    """``prepare`` without its warnings (said once, of the main model)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare(model, config)


def _load_source(src, src_path: Path):
    index = src_path / "model.safetensors.index.json"
    if index.exists():
        # mlx-lm loads whatever shards it finds; a missing one would
        # surface as missing weights or a bare file error.
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ConversionError(f"{index} is damaged; re-download the model") from None
        missing = sorted(s for s in shards if not (src_path / s).exists())
        if missing:
            raise ConversionError(
                f"{src} lacks {len(missing)} weight shard(s) its index names (first: "
                f"{missing[0]}); finish the download or re-download the model"
            )
    for f in src_path.glob("*.safetensors"):
        try:
            check_safetensors(f)
        except FormatError as e:
            raise ConversionError(str(e).replace("re-convert the model",
                                                 "re-download the source model")) from None
    try:
        return load_model(src_path, lazy=True)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ConversionError(f"mlx-lm cannot load {src}: {e}") from None


def _prepare_model(model, config, src, quantize, q_bits, q_group_size, q_mode, dtype):
    """Cast and quantize as asked; returns ``(model, config, expert blocks)``."""
    blocks = find_expert_blocks(model)
    if not blocks:
        raise ConversionError(
            f"{src} ({config.get('model_type')}) has no routed experts "
            "(no SwitchGLU/SwitchMLP modules): it is not a MoE model"
        )
    if dtype is not None:
        _cast(model, DTYPES[dtype])
        config["torch_dtype"] = dtype
    if quantize:
        if "quantization" in config:
            raise ConversionError(f"{src} is already quantized; convert it without -q")
        try:
            model, config = quantize_model(model, config, q_group_size, q_bits, mode=q_mode)
        except ValueError as e:
            raise ConversionError(f"cannot quantize with these settings: {e}") from None
        float_experts = [path for path, block in blocks
                         if any(not isinstance(block[n], QuantizedSwitchLinear)
                                for n in projections(block))]
        if float_experts:
            # mlx-lm skips a layer whose inputs the group size does not divide.
            raise ConversionError(
                f"--q-group-size {q_group_size} does not divide the inputs of the experts of "
                f"{float_experts[0]}, which would stay unquantized; use a smaller one "
                f"({_smaller(q_group_size, q_mode)})")
    else:
        unquantized_floats_warning(model, blocks)
    return model, config, blocks


# What mx.quantize takes, per mode: (bits, group sizes).
QUANTIZATION = {"affine": ((2, 3, 4, 5, 6, 8), (32, 64, 128)), "mxfp4": ((4,), (32,)),
                "nvfp4": ((4,), (16,)), "mxfp8": ((8,), (32,))}


def _smaller(group_size: int, mode: str) -> str:
    sizes = [g for g in QUANTIZATION.get(mode, ((), ()))[1] if g < group_size]
    return " or ".join(map(str, sizes)) or f"none smaller is taken for {mode}"


def quantization_defaults(mode: str):
    """(bits, group size) a mode takes by default: mlx-lm's 4 and 64 for
    affine, the only ones the others take."""
    if mode == "affine":
        return 4, 64
    bits, groups = QUANTIZATION[mode]
    return bits[0], groups[0]


def check_quantization(bits: int, group_size: int, mode: str) -> None:
    """Refuse quantization settings MLX does not take before anything is
    read (a 0 became mlx-lm's default, silently)."""
    if mode not in QUANTIZATION:
        raise ConversionError(f"--q-mode must be one of {', '.join(QUANTIZATION)}, got {mode!r}")
    allowed_bits, allowed_groups = QUANTIZATION[mode]
    if bits not in allowed_bits:
        raise ConversionError(f"--q-bits must be one of {', '.join(map(str, allowed_bits))} "
                              f"for {mode}, got {bits}")
    if group_size not in allowed_groups:
        raise ConversionError(f"--q-group-size must be one of "
                              f"{', '.join(map(str, allowed_groups))} for {mode}, got {group_size}")


def unquantized_floats_warning(model, blocks) -> None:
    """Warn when the experts stay unquantized in a half-precision type:
    MLX's CPU backend computes unquantized experts in float32 only (they
    run on a GPU)."""
    for path, block in blocks:
        for name in projections(block):
            dtype = block[name].weight.dtype
            if dtype in (mx.float16, mx.bfloat16):
                warnings.warn(
                    f"mlx_streaming: the experts of {path} stay unquantized {dtype}, which "
                    "MLX's CPU backend cannot compute (float32 only there); convert with -q, "
                    "or --dtype float32, to run them on a CPU", RuntimeWarning, stacklevel=4)
                return



def _convert_layers(model, config, blocks, state, src, src_path, dst, fingerprint, options,
                    progress, on_layer, ranks) -> Path:
    """Every expert block's blob (one per rank of ``ranks``, the models
    sharded per rank, where given), then the spine and the manifest."""
    layers, streamed, rank_layers = [], set(), []
    keep = resident_modules(model, blocks)
    total = sum(num_experts(b) for _, b in blocks) * max(1, len(ranks))
    bar = _progress_bar(total, progress)
    for ordinal, (path, block) in enumerate(blocks):
        layer = layer_index(path, ordinal)
        file = f"layer{layer:03d}.blob"
        if any(spec.file == file for spec in layers):
            file = f"block{ordinal:03d}.blob"
        top_k = None
        sources = [(file, block)] if not ranks else \
            [(rank_file(layer, r, len(ranks)), get_module(m, path)) for r, m in enumerate(ranks)]
        specs = []
        for name, source in sources:
            spec = state.done(name, dst)
            if spec is None:
                bar.set_description(f"experts of {path}")
                top_k = top_k or find_top_k(model, path, block, config)
                spec = convert_layer(source, path, layer, name, top_k, dst, bar.update)
                state.record(spec)
            else:
                bar.update(spec.num_experts)
            if ranks:
                release_experts(source, spec)
            specs.append(spec)
        spec = specs[0]
        rank_layers.append(specs)
        layers.append(spec)
        streamed.update(f"{path}.{s.name}" for s in spec.segments)
        release_experts(block, spec)
        if on_layer is not None:
            on_layer(spec)
    bar.close()

    # MTP layers do not run split: a tensor-parallel conversion leaves them out.
    mtp_spec = None if ranks else _convert_mtp(model, config, src_path, dst, layers[-1].top_k,
                                               options, bar)
    start_dense(dst)
    # Tensor parallel: each rank's slices of every dense layer, cut by shard() as its experts.
    dense_ranks = tuple(convert_dense(m, blocks, keep, streamed, dst, (r, len(ranks)))
                        for r, m in enumerate(ranks))
    dense = dense_ranks[0] if ranks else convert_dense(model, blocks, keep, streamed, dst)
    streamed.update(f"{d.prefix}.{s.name}" for d in dense for s in d.segments)
    write_spine(model, streamed, dst)
    save_config(dict(config), dst / "config.json")
    _copy_tokenizer(src_path, dst)
    fsync_written(dst)
    source = {"model": str(src), "fingerprint": fingerprint, "options": options}
    by_rank = tuple(zip(*rank_layers)) if ranks else ()
    write_manifest(dst, Manifest(FORMAT_VERSION, tuple(layers), source, spine_manifest(dst),
                                 mtp_spec, dense, by_rank, dense_ranks))
    state.path.unlink(missing_ok=True)
    return dst


def _convert_mtp(model, config, src_path: Path, dst: Path, top_k: int, options: dict,
                 bar) -> Optional[MtpSpec]:
    """Keep the model's MTP layers (``models.mtp_layers``), which mlx-lm drops: their
    routed experts as blobs, the rest in ``mtp.safetensors``. None when the
    config declares none or the source has no such weights."""
    count = mtp_layers.mtp_layers_of(config)
    if not count:
        return None
    unsupported = mtp_layers.supports(model)
    if unsupported:
        print(f"[mlx_streaming] config.json declares MTP layers, but they are kept only for "
              f"DeepSeek-V3-style models ({unsupported}); --draft mtp will not be available",
              file=sys.stderr)
        return None
    first = len(model.model.layers)
    found = mtp_layers.source_tensors(sorted(src_path.glob("*.safetensors")), first, count)
    if len(found) < count:
        print(f"[mlx_streaming] config.json declares {count} MTP layer(s) but the source "
              "has no weights for them (mlx-lm's converter drops them); --draft mtp will "
              "not be available", file=sys.stderr)
        return None
    modules = mtp_layers.build(model, count)
    specs, rest = [], {}
    for depth, module in enumerate(modules):
        weights = mtp_layers.sanitize(model, found[depth])
        if options["dtype"] is not None:
            weights = {k: v.astype(DTYPES[options["dtype"]])
                       if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
        mtp_layers.load_weights(module, weights, config.get("quantization")
                         if not options["quantize"] else None)
        mtp_layers.check_complete(module, weights, str(src_path))
        if options["quantize"]:
            mtp_layers.quantize(module, options["q_group_size"], options["q_bits"], options["q_mode"])
        ((path, block),) = find_expert_blocks(module)
        spec = convert_layer(block, f"mtp.{depth}.{path}", first + depth,
                              f"mtp{depth:02d}.blob", top_k, dst, bar.update)
        names = {f"{path}.{s.name}" for s in spec.segments}
        rest.update({f"mtp.{depth}.{k}": v for k, v in tree_flatten(module.parameters())
                     if k not in names})
        specs.append(spec)
    tmp = dst / (mtp_layers.MTP_FILE + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), rest, metadata={"format": "mlx"})
    fsync_path(tmp)
    os.replace(tmp, dst / mtp_layers.MTP_FILE)
    spine = SpineFile(mtp_layers.MTP_FILE, (dst / mtp_layers.MTP_FILE).stat().st_size,
                      file_crc32(dst / mtp_layers.MTP_FILE))
    return MtpSpec(spine, tuple(specs))


class _NoBar:
    def update(self, n=1):
        pass

    def set_description(self, s):
        pass

    def close(self):
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="expert", file=sys.stderr)
