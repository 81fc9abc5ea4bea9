"""``load()``: a stream directory becomes a normal mlx-lm model whose routed
experts are streamed from SSD through per-layer slot pools."""

import glob
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.utils import load_model, load_tokenizer

from . import budget
from .block import Paged, Resident, StreamingExperts
from .config import StreamConfig
from .discover import find_expert_blocks, find_router, input_dims_of, projections, set_module
from .errors import FormatError, StreamingError
from .format import LayerSpec, Manifest, blob_path, read_manifest
from .native import NativeReader, load_extension
from .pool import SlotPool
from .prefetch import (
    AlwaysOn,
    NativeLauncher,
    NextLayerPrefetch,
    PrefetchSwitch,
    PythonLauncher,
)
from .readers import PythonReader, direct_io_works
from .stats import Events, Stats, TraceWriter
from .store import ExpertStore


class Runtime:
    """What a streaming model carries besides its modules: the config, the
    reader, the stores and the observers. ``model.streaming`` holds it."""

    def __init__(self, config: StreamConfig, manifest: Manifest, reader, io_reason: str,
                 slots: int, direct_io_reason: str):
        self.config = config
        self.manifest = manifest
        self.reader = reader
        self.io_reason = io_reason
        self.direct_io_reason = direct_io_reason
        self.slots = slots
        # A trace needs each call's ids, which only paged blocks sync for.
        self.paged = slots < budget.max_slots(manifest) or config.trace is not None
        self.stores: List[ExpertStore] = []
        self.stats = Stats([l.layer for l in manifest.layers])
        self.trace = TraceWriter(config.trace) if config.trace else None
        observers = [self.stats] + ([self.trace] if self.trace else [])
        if config.prefetch == "auto":
            first = manifest.layers[0].layer
            self.prefetch_switch = PrefetchSwitch(first, config.prefetch_max_tokens)
            observers.append(self.prefetch_switch)
        else:
            self.prefetch_switch = AlwaysOn()
        self.events = Events(observers)

    @property
    def cache_bytes(self) -> int:
        return sum(s.pool.nbytes for s in self.stores)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        self.reader.close()


def load(
    path,
    *,
    cache_gb: Optional[float] = None,
    slots_per_layer: Optional[int] = None,
    io: str = "auto",
    direct_io: Optional[bool] = None,
    io_threads: Optional[int] = None,
    prefetch: str = "off",
    prefetch_width: Optional[int] = None,
    verify: str = "first-read",
    trace: Optional[str] = None,
    tokenizer_config: Optional[dict] = None,
    config: Optional[StreamConfig] = None,
):
    """Load a stream directory (made by ``mlx_streaming.convert``).

    Args:
        path: the stream directory.
        cache_gb: expert slot memory for all layers, in GB; default: from
            memory that is free now, less a reserve.
        slots_per_layer: experts resident per layer; overrides ``cache_gb``.
        io: ``"auto"``, ``"native"`` or ``"python"`` expert reads.
        direct_io: uncached reads (O_DIRECT / F_NOCACHE); None (default)
            picks them when the experts cannot stay in the page cache.
        io_threads: reader threads (default: from the CPU count).
        prefetch: ``"off"``, ``"next-layer"`` or ``"auto"``.
        prefetch_width: experts predicted per token (default 2 x top-k).
        verify: ``"first-read"`` or ``"off"`` checksum checks.
        trace: write the routing of every MoE call to this file.
        tokenizer_config: passed to mlx-lm's tokenizer loader.
        config: a ready ``StreamConfig``; the keyword arguments are ignored.

    Returns:
        ``(model, tokenizer)``: an mlx-lm model that works with
        ``mlx_lm.generate``, ``stream_generate`` and ``make_prompt_cache``.

    Raises:
        FormatError: not a complete stream directory of a known version.
        BudgetError: the budget holds less than one call's experts.
    """
    if config is None:
        options = dict(
            cache_gb=cache_gb,
            slots_per_layer=slots_per_layer,
            io=io,
            direct_io=direct_io,
            prefetch=prefetch,
            prefetch_width=prefetch_width,
            verify=verify,
            trace=trace,
        )
        if io_threads is not None:
            options["io_threads"] = io_threads
        config = StreamConfig(**options)
    path = Path(path)
    manifest = read_manifest(path)
    model, model_config = _load_spine(path, manifest)
    runtime = _build_runtime(path, manifest, config)
    _install_blocks(model, path, manifest, runtime)
    mx.eval(model.parameters())
    runtime.stats.reset()
    model.streaming = runtime
    tokenizer = load_tokenizer(
        path, tokenizer_config, eos_token_ids=model_config.get("eos_token_id")
    )
    return model, tokenizer


def _load_spine(path: Path, manifest: Manifest):
    """Build the mlx-lm model lazily and load everything but the experts."""
    try:
        model, model_config = load_model(path, lazy=True, strict=False)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise FormatError(f"cannot build the model in {path}: {e}") from None
    blocks = dict(find_expert_blocks(model))
    for spec in manifest.layers:
        if spec.module not in blocks:
            raise FormatError(
                f"the manifest names expert block {spec.module}, which the "
                f"{model_config.get('model_type')} model does not have; re-convert"
            )
    _check_spine_complete(path, model, manifest)
    return model, model_config


def _check_spine_complete(path: Path, model: nn.Module, manifest: Manifest) -> None:
    streamed = {f"{l.module}.{s.name}" for l in manifest.layers for s in l.segments}
    weights = {}
    for f in glob.glob(str(path / "model*.safetensors")):
        weights.update(mx.load(f))
    if hasattr(model, "sanitize"):
        # Lazy arrays: whatever sanitize computes is never evaluated.
        weights = model.sanitize(weights)
    loaded = set(weights)
    expected = {k for k, _ in tree_flatten(model.parameters())} - streamed
    missing = sorted(expected - loaded)
    if missing:
        raise FormatError(
            f"{path} lacks {len(missing)} spine weights (first: {missing[0]}); "
            "the conversion is incomplete or damaged, re-convert the model"
        )


def spine_bytes(path: Path) -> int:
    return sum(Path(f).stat().st_size for f in glob.glob(str(path / "model*.safetensors")))


def _make_reader(config: StreamConfig, direct: bool) -> Tuple[object, str]:
    ext, why = load_extension()
    if config.io == "native" and ext is None:
        raise StreamingError(
            f"io='native' was asked for but the native extension is {why}; "
            "use io='python' or reinstall with `pip install -e .`"
        )
    if config.io == "python" or ext is None:
        reason = "asked for" if config.io == "python" else f"native extension {why}"
        return PythonReader(config.io_threads, direct), reason
    return NativeReader(ext, config.io_threads, direct), "native extension"


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


def _build_runtime(path: Path, manifest: Manifest, config: StreamConfig) -> Runtime:
    spine = spine_bytes(path)
    slots = budget.plan_slots(manifest, config, spine)
    resident = spine + slots * budget.bytes_per_slot(manifest)
    direct, direct_reason = choose_direct_io(config, path, manifest, resident)
    reader, reason = _make_reader(config, direct)
    return Runtime(config, manifest, reader, reason, slots, direct_reason)


def _prefetch_width(config: StreamConfig, spec: LayerSpec) -> int:
    width = config.prefetch_width or 2 * spec.top_k
    return min(width, spec.num_experts)


def _install_blocks(model: nn.Module, path: Path, manifest: Manifest, runtime: Runtime):
    config = runtime.config
    blocks = dict(find_expert_blocks(model))
    staging = None
    if runtime.paged and config.prefetch != "off":
        width = max(_prefetch_width(config, s) for s in manifest.layers)
        stride = max(s.stride for s in manifest.layers)
        # Room for one layer's predictions in flight while the previous
        # layer's leftovers are still being dropped.
        staging = runtime.reader.staging(2 * width, stride)
    for spec in manifest.layers:
        pool = SlotPool(spec, min(runtime.slots, spec.num_experts))
        _bind_pool(blocks[spec.module], spec, pool)
        file = runtime.reader.open(str(blob_path(path, spec)))
        verify = config.verify == "first-read"
        runtime.stores.append(
            ExpertStore(spec, pool, runtime.reader, file, runtime.events, verify, staging)
        )
    prefetchers = _make_prefetchers(model, runtime, blocks, staging) if staging else {}
    for store in runtime.stores:
        if runtime.paged:
            residency = Paged(store, runtime.events, prefetchers.get(store.layer))
        else:
            store.preload()
            residency = Resident(store.layer, runtime.events)
        block = StreamingExperts(blocks[store.spec.module], residency)
        set_module(model, store.spec.module, block)


def _make_prefetchers(model, runtime: Runtime, blocks, staging) -> Dict[int, NextLayerPrefetch]:
    """One prefetcher per layer whose successor's router takes its input."""
    config = runtime.config
    native = isinstance(runtime.reader, NativeReader)
    launcher = NativeLauncher(runtime.reader.ext) if native else PythonLauncher()
    prefetchers = {}
    for store, nxt in zip(runtime.stores, runtime.stores[1:]):
        dims = input_dims_of(blocks[store.spec.module])
        scorer = find_router(model, nxt.spec.module, nxt.spec.num_experts, dims)
        if scorer is None:
            continue
        target = staging.target(nxt.layer, nxt.file, nxt.spec.stride) if native else None
        prefetchers[store.layer] = NextLayerPrefetch(
            scorer,
            nxt,
            target,
            _prefetch_width(config, nxt.spec),
            config.prefetch_max_tokens,
            launcher,
            runtime.events,
            runtime.prefetch_switch,
        )
    return prefetchers


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
            proj = proj.to_quantized(
                group_size=q["group_size"], bits=q["bits"], mode=q["mode"], **kwargs
            )
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
            setattr(proj, key, pool.arrays[f"{name}.{key}"])
        setattr(inner, name, proj)
