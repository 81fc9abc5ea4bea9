"""``load()``: a stream directory becomes a normal mlx-lm model whose routed
experts are streamed from SSD through per-layer slot pools."""

import warnings
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load_tokenizer

from .. import hub
from ..config import StreamConfig, config_fields, renamed_options
from ..errors import ConfigError, FormatError, StreamingError, first_line
from ..format import (
    Manifest,
    check_blob_size,
    check_dense_size,
    check_spine_files,
    has_vocabulary,
    read_manifest,
)
from ..io.choice import choose_direct_io, make_reader
from ..io.python import PythonReader
from ..models.discover import get_module
from . import quality_budget, sharding, spine
from .cache_aware import check_keep
from .memory import GB, bytes_per_slot, min_slots, plan_memory
from .model_spine import attach_mtp, check_experts_compute_here, load_spine, spine_bytes
from .residency import install_blocks
from .runtime import PressureWatch, Runtime
from .wrap import one_pass_at_a_time


def approximations(runtime) -> List[str]:
    """What makes ``runtime``'s output approximate, a phrase each (none: exact)."""
    config, found = runtime.config, []
    if runtime.routers and not all(r.exact for r in runtime.routers):
        found.append(f"routing={config.routing!r} ({runtime.routers[0].describe()})")
    if any(r.copies is not None for r in runtime.residencies):
        which = ("misses but each token's top expert" if config.miss_bits_weight is None else
                 f"misses below {config.miss_bits_weight:g} of their token's routed weight")
        found.append(f"miss_bits={config.miss_bits} ({which} computed from "
                     f"{config.miss_bits}-bit copies)")
    return found


def _say_if_approximate(runtime) -> None:
    for what in approximations(runtime):
        warnings.warn(
            f"mlx_streaming: {what}: the output is approximate, not mlx-lm's; "
            "`mlx_streaming bench quality` measures what it costs", UserWarning, stacklevel=4)


class Loaded(tuple):
    """What ``load`` returns: ``(model, tokenizer[, config])``, which also
    closes the model at the end of a ``with`` block."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self[0].streaming.close()


def load(
    path_or_hf_repo,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    model_config: Optional[Dict[str, Any]] = None,
    adapter_path: Optional[str] = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: Optional[str] = None,
    trust_remote_code: bool = False,
    *,
    config: Optional[StreamConfig] = None,
    **options,
):
    """Load a stream directory (made by ``mlx_streaming.convert``).

    The positional parameters are ``mlx_lm.load``'s, so a tool that calls
    mlx-lm's ``load`` can call this one.

    Args:
        path_or_hf_repo: the stream directory (``~`` is expanded), or a
            Hugging Face repo id: a stream directory uploaded there (its
            experts fetched on first use into a disk cache) or a plain
            mlx-lm model (converted once, shard by shard, into
            ``disk_cache_dir``).
        tokenizer_config: passed to mlx-lm's tokenizer loader.
        model_config: overrides of the model's config.json, as in mlx-lm.
        adapter_path: not supported (LoRA adapters on streamed experts);
            fuse them with ``mlx_lm.fuse`` and convert the fused model.
        lazy: leave the spine's weights to load when first used.
        return_config: also return the model's config dict.
        revision: of a repo id: a branch, tag or commit (default main).
        trust_remote_code: passed to mlx-lm's model loader.
        config: a ready ``StreamConfig`` (then no other options).
        **options: ``StreamConfig`` fields, e.g. ``cache_gb=8``,
            ``slots_per_layer=16``, ``prefetch="next-layer"``,
            ``checksums="always"`` (see ``StreamConfig``).

    Returns:
        ``(model, tokenizer)`` or, with ``return_config``, ``(model,
        tokenizer, config)``: an mlx-lm model that works with
        ``mlx_lm.generate``, ``stream_generate`` and ``make_prompt_cache``.
        ``model.streaming.close()`` releases its files and threads (as
        do garbage collection of the model and the end of ``with
        load(...) as (model, tokenizer):``).

    Raises:
        FormatError: not a complete stream directory of a known version.
        BudgetError: the budget holds less than one call's experts, or more
            than the memory that is available.
        ConfigError: an option is unknown or out of range.
    """
    config = _make_config(config, options)
    _check_arguments(tokenizer_config, model_config, adapter_path)
    model, tokenizer, model_config = _open(path_or_hf_repo, revision, config, tokenizer_config,
                                           model_config, trust_remote_code, lazy)
    if return_config:
        return Loaded((model, tokenizer, model_config))
    return Loaded((model, tokenizer))


def sharded_load(
    path_or_hf_repo,
    pipeline_group: Optional[mx.distributed.Group] = None,
    tensor_group: Optional[mx.distributed.Group] = None,
    return_config: bool = False,
    *,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    trust_remote_code: bool = False,
    config: Optional[StreamConfig] = None,
    **options,
):
    """Load one rank's share of a stream directory split over
    ``mx.distributed`` groups, as ``mlx_lm.sharded_load`` does: the
    family's ``pipeline()`` and ``shard()`` applied, then the rank streams
    only its layers' records and its slices of each expert. Run every rank
    (``mlx.launch``); each loads with the same call.

    Args:
        path_or_hf_repo: as for ``load``; tensor parallelism needs a
            directory converted with ``tensor_parallel`` equal to the
            tensor group's size.
        pipeline_group: split the layers into stages, one per rank.
        tensor_group: split every layer across the ranks. With neither
            group, tensor parallel over all ranks where the family can,
            else a pipeline (mlx-lm's choice).
        return_config, tokenizer_config, trust_remote_code: as for ``load``.
        config, **options: as for ``load``; ``cache_gb`` is per rank.

    Raises:
        ConfigError: the family lacks ``shard()``/``pipeline()`` for the
            groups given, or an option cannot run split.
        FormatError: the conversion is for another number of ranks, or a
            rank's directory differs from rank 0's.
    """
    config = _make_config(config, options)
    _check_arguments(tokenizer_config, None, None)
    sharding.check_options(config, pipeline_group, tensor_group)
    groups = (pipeline_group, tensor_group)
    # All ranks meet once after loading: one that failed is known to the others.
    try:
        model, tokenizer, model_config = _open(path_or_hf_repo, None, config, tokenizer_config,
                                               None, trust_remote_code, False, groups)
        failure = None
    except (StreamingError, OSError, ValueError, RuntimeError) as e:
        model, failure = None, e
    sharding.agree(model, pipeline_group or tensor_group or mx.distributed.init(), failure)
    if return_config:
        return Loaded((model, tokenizer, model_config))
    return Loaded((model, tokenizer))


def _check_arguments(tokenizer_config, model_config, adapter_path) -> None:
    for name, value in (("tokenizer_config", tokenizer_config), ("model_config", model_config)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{name} must be a dict, got {type(value).__name__}")
    if adapter_path is not None:
        raise ConfigError(
            "adapter_path is not supported on streamed models: fuse the adapters with "
            "`mlx_lm.fuse` and convert the fused model"
        )


def _open(name, revision, config: StreamConfig, tokenizer_config, model_config,
          trust_remote_code: bool, lazy: bool, groups=None):
    """``(model, tokenizer, model config)``, sharded over ``groups`` where given."""
    # A split model's rank fetches only its own dense records from a repo.
    path, repo = _locate(str(name), revision, config, dense=groups is None)
    if config.trace is not None and Path(config.trace).resolve().is_relative_to(path.resolve()):
        raise ConfigError(f"the trace {config.trace} would be written into the model's own "
                          "directory; write it elsewhere")
    manifest = read_manifest(path, blobs=False, dense=groups is None)
    if groups is None and manifest.ranks:
        raise FormatError(
            f"{path} was converted for {manifest.tensor_parallel} tensor-parallel ranks: load "
            "it with mlx_streaming.sharded_load (or --tensor-parallel) on as many ranks under "
            "`mlx.launch`, or convert it again without --tensor-parallel")
    check_spine_files(path, manifest, checksums=config.checksums == "always")
    check_experts_compute_here(manifest)
    check_keep(manifest.layers, config)
    model, model_config = load_spine(path, manifest, model_config, trust_remote_code)
    # Before the weights: a broken tokenizer is known without a long load.
    tokenizer = _load_tokenizer(path, tokenizer_config, model_config)
    split = None
    if groups is not None:
        split = sharding.choose(model, *groups, model_config.get("model_type"), manifest, path)
        sharding.apply_pipeline(model, split)
        manifest = sharding.rank_view(manifest, model, split)
    if repo is not None:
        hub.check_remote_blobs(repo, manifest)
        if groups is not None:
            hub.download_dense(repo, config, manifest.dense)
    for spec in manifest.dense if groups is not None else ():
        check_dense_size(path, spec)  # the rank's own records
    if repo is None:
        # The copies of the width in use only: another width may be absent.
        for spec in manifest.expert_layers() + (manifest.low_layers(config.miss_bits)
                                                if config.miss_bits else ()):
            check_blob_size(path, spec)
    if config.mtp:
        manifest = attach_mtp(model, path, manifest, model_config, config)
    base = spine_bytes(path)
    if split is not None and split.tensor is not None:
        base = sharding.shard_spine(model, manifest, split)
    if config.routing_max_ppl is not None:
        config = _within_budget(path, manifest, config, model_config, base, repo, split)
    runtime = _build_runtime(path, manifest, config, model_config, repo, base)
    runtime.sharding = split
    try:
        _install_spine(model, path, manifest, runtime)
        install_blocks(model, path, manifest, runtime)
        _say_if_approximate(runtime)
        mx.eval(model.parameters() if not lazy else [s.pool.arrays for s in runtime.stores])
    except BaseException:
        runtime.close()
        raise
    _start(model, runtime)
    return model, tokenizer, model_config


def _start(model: nn.Module, runtime: Runtime) -> None:
    """The loaded model's runtime attached, watched and released with it."""
    config = runtime.config
    runtime.stats.reset()
    if runtime.plan.headroom != int(config.reserve_gb * GB):
        # A headroom other than reserve_gb: cap MLX's cache of freed buffers.
        runtime.cap_buffer_cache(runtime.plan.headroom // 4)
    model.streaming = runtime
    weakref.finalize(model, runtime.close)
    if runtime.paged and config.pressure_gb > 0:
        # At most half the headroom: a load that leaves it free does not shrink at once.
        threshold = min(int(config.pressure_gb * GB), runtime.plan.headroom // 2)
        runtime.pressure = PressureWatch(runtime, threshold,
                                         bytes_per_slot(runtime.manifest),
                                         min_slots(runtime.manifest))
    if runtime.paged or runtime.ring is not None or runtime.routers:
        # Routers' counts are taken at the end of each pass, too.
        one_pass_at_a_time(model, runtime)


def _load_tokenizer(path: Path, tokenizer_config, model_config: dict):
    try:
        return load_tokenizer(path, tokenizer_config,
                              eos_token_ids=model_config.get("eos_token_id"))
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        hint = "" if has_vocabulary(path) else ("; copy the source model's tokenizer files "
                                                "(tokenizer.json, ...) into it")
        raise FormatError(f"cannot load the tokenizer in {path} ({first_line(e)}){hint}") \
            from None


def _locate(name: str, revision: Optional[str], config: StreamConfig, dense: bool = True):
    """``(stream directory, Hub repo whose blobs are fetched, or None)``;
    a repo's dense records left to fetch without ``dense``."""
    if revision is not None and not isinstance(revision, str):
        raise ConfigError(f"revision must be a branch, tag or commit (a string), got "
                          f"{revision!r}")
    if hub.is_repo_id(name):
        return hub.open_model(name, revision, config, dense)
    if hub.looks_like_repo_id(name):
        warnings.warn(f"mlx_streaming: loading the local directory {name}, not the Hugging "
                      f"Face repo of that name (give ./{name} to say so)", UserWarning,
                      stacklevel=3)
    hub.check_revision_use(name, revision)
    return Path(name).expanduser(), None


def _make_config(config: Optional[StreamConfig], options: dict) -> StreamConfig:
    options = renamed_options(options)
    unknown = sorted(set(options) - set(config_fields()))
    if unknown:
        raise ConfigError(
            f"unknown option {unknown[0]!r}; load() takes {', '.join(config_fields())}"
        )
    if config is not None:
        if options:
            raise ConfigError("pass either config= or options, not both")
        if not isinstance(config, StreamConfig):
            raise ConfigError(f"config must be a StreamConfig, got {type(config).__name__}; "
                              "or pass the options as keywords")
        return config
    # None means "the default" for every option, as on the command line.
    return StreamConfig(**{k: v for k, v in options.items() if v is not None})


def _within_budget(path, manifest, config, model_config, base, repo, split) -> StreamConfig:
    """``config`` with the cache-aware settings ``routing_max_ppl`` allows
    (``quality_budget``); a pool of every expert changes nothing."""
    if repo is not None or split is not None:
        raise ConfigError("routing_max_ppl calibrates a local directory on one machine: run "
                          "it there (or bench quality), then give routing_keep and "
                          "routing_window")
    slots = plan_memory(manifest, config, base, model_config=model_config).slots
    if slots >= min(spec.num_experts for spec in manifest.layers):
        return replace(config, routing_max_ppl=None)
    return quality_budget.resolve(path, manifest, config, slots, sharding.identity(manifest),
                                  hub.cache_root(config))


def _build_runtime(path: Path, manifest: Manifest, config: StreamConfig, model_config: dict,
                   repo: Optional["hub.HubRepo"], base_bytes: int) -> Runtime:
    plan = plan_memory(manifest, config, base_bytes, model_config=model_config)
    if repo is not None:
        reader = hub.make_remote_reader(repo, path, manifest, config)
        reasons = (f"HTTP range requests to {repo.repo_id}",
                   "records come from the network and the disk cache")
        return Runtime(config, manifest, plan, reader, reasons)
    direct, direct_reason = choose_direct_io(config, path, manifest, plan.total)
    reader, reason = make_reader(config, direct)
    return Runtime(config, manifest, plan, reader, (reason, direct_reason))


def _install_spine(model: nn.Module, path: Path, manifest: Manifest, runtime: Runtime) -> None:
    """Pinned spine layers read once into arrays of their own; the others
    streamed through a ring of layer buffers (``spine.py``)."""
    if not manifest.dense:
        if runtime.config.pinned_layers is not None:
            warnings.warn(
                f"mlx_streaming: {path} (format version {manifest.version}) keeps its whole "
                "spine in safetensors, so pinned_layers and spine_ring have no effect; "
                "convert it again with `mlx_streaming convert` to stream its layers",
                RuntimeWarning, stacklevel=3)
        return
    reader = runtime.reader
    if not reader.local:  # the dense records were downloaded with the spine
        reader = runtime.spine_reader = PythonReader(runtime.config.io_threads)
    plan = runtime.plan
    for spec in manifest.dense:
        if spec.layer in plan.pinned:
            spine.load_pinned(model, path, spec, reader, runtime.config.checksums)
    streamed = [d for d in manifest.dense if d.layer not in plan.pinned]
    if not streamed:
        return
    ring = spine.SpineRing(model, path, streamed, plan.ring_buffers, reader,
                           runtime.config.checksums)
    runtime.ring = ring
    for spec in streamed:
        spine.stream_layer(get_module(model, spec.prefix), ring, spec.layer)
