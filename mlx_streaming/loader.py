"""``load()``: a stream directory becomes a normal mlx-lm model whose routed
experts are streamed from SSD through per-layer slot pools."""

import json
from concurrent.futures import ThreadPoolExecutor
import threading
from contextlib import contextmanager
import warnings
from dataclasses import replace
import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.utils import load_model, load_tokenizer

from . import budget, hub, mtp, spine
from .block import NativePaged, Paged, Resident, StreamingExperts, calls_in_graph
from .config import StreamConfig, config_fields, renamed_options
from .discover import (
    find_expert_blocks,
    find_router,
    get_module,
    input_dims_of,
    num_experts,
    projections,
    set_module,
)
from .errors import ConfigError, FormatError, StreamingError, first_line
from .format import (
    LayerSpec,
    Manifest,
    blob_path,
    check_safetensors,
    check_spine_files,
    file_crc32,
    has_vocabulary,
    read_manifest,
    spine_files,
)
from .native import NativeReader, load_extension
from .policy import make_policy
from .pressure import NoWatch, PressureWatch
from .pool import SlotPool
from .prefetch import (
    Affinity,
    AlwaysOn,
    NextLayerPrefetch,
    PrefetchBudget,
    PrefetchCalibration,
    PrefetchControl,
    PrefetchSwitch,
    ReadEveryPrediction,
    scores_calibrated,
)
from .readers import PythonReader, direct_io_works
from .speculative import SpecStats
from .stats import Events, Stats, TraceWriter
from .store import ExpertStore, NativeStore, native_store_fits


class Runtime:
    """What a streaming model carries besides its modules: the config, the
    reader, the stores and the observers. ``model.streaming`` holds it."""

    def __init__(self, config: StreamConfig, manifest: Manifest, reader, io_reason: str,
                 plan: budget.MemoryPlan, direct_io_reason: str):
        self.config = config
        self.manifest = manifest
        self.reader = reader
        self.io_reason = io_reason
        self.direct_io_reason = direct_io_reason
        self.plan = plan
        self.slots = slots = plan.slots
        self.ring: Optional[spine.SpineRing] = None  # streamed spine layers (spine.py)
        self.spine_reader = None  # the ring's own reader, when the experts' is remote
        # Paged pools are rewritten in place: one forward pass at a time.
        self.lock = threading.RLock()
        self.closed = False
        # A trace needs each call's ids, which only paged blocks sync for.
        self.paged = slots < budget.max_slots(manifest) or config.trace is not None
        self.stores: List[ExpertStore] = []
        self.residencies: List[Paged] = []
        self.staging = None  # prefetch's staging area, when prefetch is on
        self._overlap = None  # the thread that reads misses while experts compute
        self.cancelled_at_reset = 0
        self.stats = Stats([l.layer for l in manifest.layers])
        self.speculative = SpecStats()  # drafts through this model (speculative.py)
        self.trace = TraceWriter(config.trace) if config.trace else None
        observers = [self.stats] + ([self.trace] if self.trace else [])
        learners = []
        first = manifest.layers[0].layer
        if config.prefetch == "auto":
            self.prefetch_switch = PrefetchSwitch(first, config.prefetch_max_tokens)
            learners.append(self.prefetch_switch)
        else:
            self.prefetch_switch = AlwaysOn()
        self.prefetch_budget = None
        # Every prediction read (precision 0, and the layers a sigmoid router
        # predicts), with the chance of use counted by rank.
        self.prefetch_calibration = self.prefetch_ranks = ReadEveryPrediction()
        self.prefetch_affinity = None
        if config.prefetch != "off" and self.paged:
            self.prefetch_budget = PrefetchBudget(
                first, len(manifest.layers), max(l.stride for l in manifest.layers),
                config.prefetch_max_tokens, self.reader.busy, fixed=config.prefetch_budget)
            if config.prefetch_budget is None:
                learners.append(self.prefetch_budget)
            if config.prefetch_affinity:
                layers = [l for l in manifest.layers if not _is_mtp(l)]
                self.prefetch_affinity = Affinity(
                    [(a.layer, a.num_experts, b.layer, b.num_experts)
                     for a, b in _prefetch_pairs(layers)])
                learners.append(self.prefetch_affinity)
            learners.append(self.prefetch_ranks)
            if config.prefetch_precision > 0:
                self.prefetch_calibration = PrefetchCalibration(
                    [l.layer for l in manifest.layers if not _is_mtp(l)],
                    config.prefetch_precision)
                learners.append(self.prefetch_calibration)
        # What prefetch learns comes straight from the calls and the stores,
        # not over the telemetry of ``events``.
        self.prefetch_control = PrefetchControl(learners)
        self.events = Events(observers)
        self.pressure = NoWatch()  # a PressureWatch once the pools exist (paged only)

    def overlap_reads(self) -> Optional[ThreadPoolExecutor]:
        """The paged blocks' worker for reads overlapped with compute (one
        thread for every layer: calls run one at a time), or None when
        ``overlap`` is off."""
        if self.config.overlap and self._overlap is None:
            self._overlap = ThreadPoolExecutor(1, thread_name_prefix="mlx_streaming-reads")
        return self._overlap

    @property
    def cache_bytes(self) -> int:
        return sum(s.pool.nbytes for s in self.stores)

    def close(self) -> None:
        """Release the model's files, reader threads and staging; waits for
        prefetch reads in flight. Idempotent; also runs when the model is
        garbage collected."""
        with self.lock:  # never under a forward pass of another thread
            if self.closed:
                return
            self.closed = True
            if self.trace is not None:
                self.trace.close()
            if self.ring is not None:
                self.ring.close()
            if self.spine_reader is not None:
                self.spine_reader.close()
            if self._overlap is not None:
                for residency in self.residencies:
                    residency.overlap = None  # later calls fail as a closed model's do
                self._overlap.shutdown(wait=True)
            for store in self.stores:
                if isinstance(store, NativeStore):
                    store.index.unbind()  # a lazy graph left behind reads nothing
            self.reader.close()

    @contextmanager
    def call(self):
        """One forward pass over the pools, from any thread: under the lock,
        after the pressure watch, and with every pool reader evaluated at
        the end (the model's ``__call__``, and MTP and hidden-state calls
        that bypass it, run in this)."""
        with self.lock:
            self.pressure.between_calls()
            try:
                yield
            except BaseException:
                # A pass that raised may leave pool readers (and remaps) in
                # its graph: finish them now, so nothing later runs them out
                # of order; their own failures are not the one to report.
                self.finish_pending(report=False)
                raise
            self.finish_pending()

    def resize(self, slots: int) -> None:
        """Give every paged pool ``slots`` slots (``pressure.py``)."""
        with self.lock:  # the native step writes the tables without the GIL
            self._resize(slots)

    def _resize(self, slots: int) -> None:
        self.finish_pending()
        if self.staging is not None:
            for store in self.stores:
                store.drop_staged()
        for store in self.stores:
            store.resize(slots)
        self.slots = slots
        mx.clear_cache()  # hand the freed buffers back to the OS

    def finish_pending(self, report: bool = True) -> None:
        """Evaluate every computation that still reads a pool, so that the
        next call, from any thread, may overwrite slots; then report the
        calls made inside the graph and raise the first failure of any
        (``report=False``: drop them)."""
        pending = [y for p in self.residencies for y in p.pending]
        for p in self.residencies:
            p.pending = []
        try:
            mx.eval(pending)
        except Exception:
            if report:
                raise
        if self.ring is not None:
            self.ring.finish()
        failure = None
        for store in self.stores:
            if isinstance(store, NativeStore):
                # Every store, even after a failure: none may keep an error
                # or counters for a later pass.
                try:
                    store.flush()
                except Exception as e:
                    failure = failure or e
        if failure is not None and report:
            raise failure


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
        does garbage collection of the model).

    Raises:
        FormatError: not a complete stream directory of a known version.
        BudgetError: the budget holds less than one call's experts, or more
            than the memory that is available.
        ConfigError: an option is unknown or out of range.
    """
    config = _make_config(config, options)
    for name, value in (("tokenizer_config", tokenizer_config), ("model_config", model_config)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{name} must be a dict, got {type(value).__name__}")
    if adapter_path is not None:
        raise ConfigError(
            "adapter_path is not supported on streamed models: fuse the adapters with "
            "`mlx_lm.fuse` and convert the fused model"
        )
    path, repo = _locate(str(path_or_hf_repo), revision, config)
    if config.trace is not None and Path(config.trace).resolve().is_relative_to(path.resolve()):
        raise ConfigError(f"the trace {config.trace} would be written into the model's own "
                          "directory; write it elsewhere")
    manifest = read_manifest(path, blobs=repo is None)
    if repo is not None:
        hub.check_remote_blobs(repo, manifest)
    check_spine_files(path, manifest, checksums=config.checksums == "always")
    model, model_config = _load_spine(path, manifest, model_config, trust_remote_code)
    # Before the runtime and the weights: a broken tokenizer is known
    # without waiting for a large model to load.
    tokenizer = _load_tokenizer(path, tokenizer_config, model_config)
    if config.mtp:
        manifest = _attach_mtp(model, path, manifest, model_config, config)
    runtime = _build_runtime(path, manifest, config, repo)
    try:
        _install_spine(model, path, manifest, runtime)
        _install_blocks(model, path, manifest, runtime)
        mx.eval(model.parameters() if not lazy else [s.pool.arrays for s in runtime.stores])
    except BaseException:
        runtime.close()
        raise
    runtime.stats.reset()
    model.streaming = runtime
    weakref.finalize(model, runtime.close)
    if runtime.paged and config.pressure_gb > 0:
        runtime.pressure = PressureWatch(runtime, int(config.pressure_gb * budget.GB),
                                         budget.bytes_per_slot(manifest),
                                         budget.min_slots(manifest))
    if runtime.paged or runtime.ring is not None:
        _serialize_calls(model)
    if return_config:
        return model, tokenizer, model_config
    return model, tokenizer


def _load_tokenizer(path: Path, tokenizer_config, model_config: dict):
    try:
        return load_tokenizer(path, tokenizer_config,
                              eos_token_ids=model_config.get("eos_token_id"))
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        hint = "" if has_vocabulary(path) else ("; copy the source model's tokenizer files "
                                                "(tokenizer.json, ...) into it")
        raise FormatError(f"cannot load the tokenizer in {path} ({first_line(e)}){hint}") \
            from None


def _locate(name: str, revision: Optional[str], config: StreamConfig):
    """``(stream directory, Hub repo whose blobs are fetched, or None)``."""
    if hub.is_repo_id(name):
        return hub.open_model(name, revision, config)
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


_SERIALIZED: Dict[type, type] = {}


def _serialize_calls(model: nn.Module) -> None:
    """Make calls of ``model`` from several threads run one at a time.

    A paged pool is rewritten in place between calls, so two forward passes
    must not interleave. Each call holds the model's lock until the layers'
    pool readers are evaluated (not the output: mlx-lm discards prefill
    logits and overlaps the next step with this one's head): then no
    computation still reads a pool when the next call, maybe another
    thread's, starts overwriting slots.
    """
    base = type(model)
    if base in _SERIALIZED.values():
        return  # already
    cls = _SERIALIZED.get(base)
    if cls is None:

        def __call__(self, *args, **kwargs):
            with self.streaming.call():
                out = base.__call__(self, *args, **kwargs)
            return out

        cls = type(base.__name__, (base,), {"__call__": __call__,
                                            "__module__": base.__module__})
        _SERIALIZED[base] = cls
    model.__class__ = cls


def _load_spine(path: Path, manifest: Manifest, model_config=None, trust_remote_code=False):
    """Build the mlx-lm model lazily and load everything but the experts
    and the dense records. The config returned is the model's own (without
    the per-module quantization handed to mlx-lm for the records)."""
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
    """``model_config`` with a per-module quantization entry (mlx-lm's own
    per-layer mechanism) for each quantized module of the dense records:
    mlx-lm quantizes a module only when the safetensors hold its scales,
    and theirs are in the records. Also returns the keys it added."""
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
    streamed = {f"{l.module}.{s.name}" for l in manifest.layers for s in l.segments}
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


def _attach_mtp(model: nn.Module, path: Path, manifest: Manifest, model_config: dict,
                config: StreamConfig) -> Manifest:
    """Build the MTP layers (``mtp.py``) as ``model.mtp`` with their
    non-expert weights; returns the manifest with their expert layers, which
    then stream like the others."""
    if manifest.mtp is None:
        raise ConfigError(
            f"{path} has no MTP layers: the model declares none, or it was converted "
            "from weights without them (mlx-lm's converter drops them); convert from the "
            "original checkpoint, or draft with --draft ngram or --draft-model")
    unsupported = mtp.supports(model)
    if unsupported:
        raise ConfigError(f"MTP drafting needs a DeepSeek-V3-style model, and "
                          f"{model_config.get('model_type')}'s is not: {unsupported}")
    f = path / manifest.mtp.spine.name
    if not f.is_file() or f.stat().st_size != manifest.mtp.spine.nbytes:
        raise FormatError(f"{f} is missing or not the size the manifest records; re-convert")
    if config.checksums == "always" and file_crc32(f) != manifest.mtp.spine.crc32:
        raise FormatError(f"{f} fails its checksum; re-convert the model")
    layers = mtp.build(model, len(manifest.mtp.layers))
    weights = mx.load(str(f))
    for depth, layer in enumerate(layers):
        prefix = f"mtp.{depth}."
        mine = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        mtp.load_weights(layer, mine, model_config.get("quantization") or
                         {"group_size": 64, "bits": 4})
    model.mtp = layers
    return replace(manifest, layers=manifest.layers + manifest.mtp.layers)


def spine_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in spine_files(path))


def _make_reader(config: StreamConfig, direct: bool) -> Tuple[object, str]:
    ext, why = load_extension()
    if config.io == "native" and ext is None:
        raise StreamingError(
            f"io='native' was asked for but the native extension is {why}; "
            "use io='python' or reinstall with `pip install -e .`"
        )
    if config.io == "python" or ext is None:
        reason = "asked for" if config.io == "python" else f"native extension {why}"
        if config.io == "auto":
            warnings.warn(
                f"mlx_streaming: the native extension is {why}; reading experts with the "
                "slower Python reader, without its paged calls inside the graph. Reinstall "
                "with a C++ compiler and CMake (`pip install -e .`) to build it.",
                RuntimeWarning, stacklevel=4)
        return PythonReader(config.io_threads, direct, config.read_pace_mbps), reason
    return NativeReader(ext, config.io_threads, direct, config.read_pace_mbps), \
        "native extension"


def choose_direct_io(config: StreamConfig, path: Path, manifest: Manifest,
                     resident_bytes: int) -> Tuple[bool, str]:
    """Uncached reads or not, and why.

    Measured (bench io): uncached reads are as fast or faster than cached
    ones when the page cache is cold, but a warm page cache serves experts
    3-7x faster. So cached reads win while the blobs fit in the memory the
    pools and the spine leave; beyond that they would only be read twice.
    """
    if config.direct_io is not None:
        return config.direct_io, "asked for"
    room = budget.total_memory_bytes() - resident_bytes
    if manifest.expert_nbytes <= room:
        return False, (f"experts ({manifest.expert_nbytes / 1e9:.2f} GB) fit in the "
                       f"{room / 1e9:.2f} GB the page cache can use")
    if not direct_io_works(blob_path(path, manifest.layers[0])):
        return False, "this file system refuses uncached reads"
    return True, (f"experts ({manifest.expert_nbytes / 1e9:.2f} GB) exceed the "
                  f"{room / 1e9:.2f} GB the page cache can use")


def _build_runtime(path: Path, manifest: Manifest, config: StreamConfig,
                   repo: Optional["hub.HubRepo"] = None) -> Runtime:
    plan = budget.plan_memory(manifest, config, spine_bytes(path))
    if repo is not None:
        reader = hub.make_remote_reader(repo, path, manifest, config)
        return Runtime(config, manifest, reader, f"HTTP range requests to {repo.repo_id}",
                       plan, "records come from the network and the disk cache")
    direct, direct_reason = choose_direct_io(config, path, manifest, plan.total)
    reader, reason = _make_reader(config, direct)
    return Runtime(config, manifest, reader, reason, plan, direct_reason)


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
    if reader.name == "remote":  # the dense records were downloaded with the spine
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


def _install_blocks(model: nn.Module, path: Path, manifest: Manifest, runtime: Runtime):
    config = runtime.config
    blocks = dict(find_expert_blocks(model))
    staging = None
    if runtime.paged and config.prefetch != "off":
        # The memory plan (budget.plan_memory) counted these bytes.
        staging = runtime.reader.staging(*budget.staging_shape(manifest, config))
        runtime.staging = staging
    for spec in manifest.layers:
        pool = SlotPool(spec, min(runtime.slots, spec.num_experts))
        _bind_pool(blocks[spec.module], spec, pool)
        blob = blob_path(path, spec)
        file = runtime.reader.open(str(blob))
        if runtime.reader.name == "remote":
            blob = None  # fetched records are checked by the reader, not watched
        policy = make_policy(config.policy, spec.num_experts)
        # The native step where it can run; the trace wants the router's
        # probabilities, which only the Python route gathers.
        native = (runtime.paged and config.trace is None
                  and native_store_fits(runtime.reader, policy, staging))
        store_class = NativeStore if native else ExpertStore
        runtime.stores.append(store_class(spec, pool, runtime.reader, file, runtime.events,
                                          config.checksums, staging, blob, policy,
                                          runtime.prefetch_control))
    prefetchers = _make_prefetchers(model, runtime, blocks) if staging else {}
    for store in runtime.stores:
        if runtime.paged:
            router = None
            if store.policy.router or config.trace:
                router = find_router(model, store.spec.module, store.spec.num_experts,
                                     input_dims_of(blocks[store.spec.module]))
            args = (store, runtime.events, prefetchers.get(store.layer), router,
                    runtime.overlap_reads())
            if isinstance(store, NativeStore):
                # Calls inside the graph need the CPU backend (block.NativePaged).
                residency = NativePaged(*args, in_graph=calls_in_graph())
            else:
                residency = Paged(*args)
            runtime.residencies.append(residency)
        else:
            store.preload()
            residency = Resident(store.layer, runtime.events)
        block = StreamingExperts(blocks[store.spec.module], residency)
        set_module(model, store.spec.module, block)


def _make_prefetchers(model, runtime: Runtime, blocks) -> Dict[int, NextLayerPrefetch]:
    """One prefetcher per layer whose successor's router takes its input."""
    config = runtime.config
    stores = [s for s in runtime.stores if not _is_mtp(s.spec)]  # MTP runs only to draft
    pairs = []
    for i, (store, nxt) in enumerate(zip(stores, stores[1:])):
        dims = input_dims_of(blocks[store.spec.module])
        scorer = find_router(model, nxt.spec.module, nxt.spec.num_experts, dims)
        if scorer is not None:
            after = None
            if config.prefetch_depth > 1 and i + 2 < len(stores):
                after = _ahead(model, runtime, stores[i + 2], dims)
            pairs.append((store, nxt, scorer, after))
    affinity = runtime.prefetch_affinity
    if affinity is not None:
        # The last layer predicts the first one's experts for the next token.
        pairs += [(a, b, None, None) for a, b in _prefetch_pairs(stores)[len(stores) - 1:]]
    return {
        store.layer: NextLayerPrefetch(
            store.layer, scorer, nxt, budget.prefetch_width(config, nxt.spec),
            config.prefetch_max_tokens, runtime.prefetch_budget, affinity, runtime.events,
            runtime.prefetch_switch, _calibration(runtime, nxt.layer, scorer), after)
        for store, nxt, scorer, after in pairs
    }


def _ahead(model, runtime: Runtime, store, dims: int):
    """(scorer, store, calibration) of ``store``'s layer predicted two
    layers early, or None when its router does not take ``dims`` inputs."""
    scorer = find_router(model, store.spec.module, store.spec.num_experts, dims)
    if scorer is None:
        return None
    return scorer, store, _calibration(runtime, store.layer, scorer)


def _calibration(runtime: Runtime, layer: int, scorer):
    """The calibration of ``layer``, predicted by ``scorer``
    (``scores_calibrated``)."""
    if scores_calibrated(scorer):
        return runtime.prefetch_calibration
    runtime.prefetch_calibration.forget(layer)
    return runtime.prefetch_ranks


def _is_mtp(spec: LayerSpec) -> bool:
    """An MTP layer: it runs only when drafting, after the model."""
    return spec.module.startswith("mtp.")


def _prefetch_pairs(layers: list) -> list:
    """(layer, its successor) for prefetch: each MoE layer and the next, then
    the last and the first, which runs next, one token later (two layers or
    more: one layer's prediction of itself would be dropped by its own call)."""
    pairs = list(zip(layers, layers[1:]))
    return pairs + [(layers[-1], layers[0])] if len(layers) > 1 else pairs


def _bind_pool(inner: nn.Module, spec: LayerSpec, pool: SlotPool) -> None:
    """Point the projections of ``inner`` at the pool arrays.

    A projection the manifest records as quantized is first turned into a
    quantized one with mlx-lm's own ``to_quantized`` (lazily: its random
    init is never evaluated), so the gather arguments are mlx-lm's.
    """
    for name in projections(inner):
        proj = inner[name]
        q = spec.quantization.get(name)
        if q is not None and not isinstance(proj, QuantizedSwitchLinear):
            kwargs = {"global_scale": True} if q.get("global_scale") else {}
            try:
                proj = proj.to_quantized(
                    group_size=q["group_size"], bits=q["bits"], mode=q["mode"], **kwargs
                )
            except (ValueError, TypeError) as e:
                raise FormatError(
                    f"layer {spec.layer}: {name} cannot be quantized as the manifest says "
                    f"({e}); re-convert the model"
                ) from None
        record = {
            seg.name.split(".", 1)[1]
            for seg in spec.segments
            if seg.name.startswith(name + ".")
        }
        have = {k for k, _ in tree_flatten(proj.parameters()) if "." not in k}
        if have != record:
            raise FormatError(
                f"layer {spec.layer}: {name} has tensors {sorted(have)} but the "
                f"record holds {sorted(record)}; re-convert the model"
            )
        for key in record:
            array, want = pool.arrays[f"{name}.{key}"], proj[key]
            floating = mx.issubdtype(array.dtype, mx.floating)
            # Floating tensors may be stored in another float type than the
            # model's init; integer ones (packed weights) must match exactly.
            same_kind = (floating and mx.issubdtype(want.dtype, mx.floating)) or \
                array.dtype == want.dtype
            if array.shape[1:] != want.shape[1:] or not same_kind:
                raise FormatError(
                    f"layer {spec.layer}: {name}.{key} is {array.dtype} "
                    f"{tuple(array.shape[1:])} per expert in the manifest but {want.dtype} "
                    f"{tuple(want.shape[1:])} in the model; re-convert the model"
                )
            pool.bind(proj, key, f"{name}.{key}")
        setattr(inner, name, proj)
