"""The one place where each MoE block's residency is chosen: every expert
resident, paged through Python, or paged with the native step.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from ..errors import ConfigError, FormatError
from ..format import LayerSpec, Manifest, blob_path
from ..models.discover import (
    find_expert_blocks,
    find_router,
    get_module,
    input_dims_of,
    projections,
    set_module,
)
from .block import NativePaged, Paged, Resident, StreamingExperts, calls_in_graph
from .low_bits import LowBitMisses, check_low_bits, low_inner, scratch_slots
from .memory import staging_shape
from .policy import LRU, make_policy
from .pool import SlotPool
from .prefetch.factory import make_prefetchers
from .rank_routing import misses_of, routing_check
from .routing import install_routers
from .store import ExpertStore, NativeStore, RecordSource, native_store_fits


def install_blocks(model: nn.Module, path: Path, manifest: Manifest, runtime) -> None:
    """Replace every expert block of ``model`` by a ``StreamingExperts``
    over a slot pool of ``runtime.slots`` slots, with the store and the
    residency that the runtime's config and reader allow."""
    config = runtime.config
    blocks = dict(find_expert_blocks(model))
    prefetch = runtime.prefetch
    if prefetch.on:
        # The memory plan (plan_memory) counted these bytes.
        prefetch.staging = runtime.reader.staging(*staging_shape(manifest, config))
    for spec in manifest.layers:
        pool = SlotPool(spec, min(runtime.slots, spec.num_experts))
        bind_pool(blocks[spec.module], spec, pool)
        blob = blob_path(path, spec)
        file = runtime.reader.open(str(blob))
        # Fetched records are checked by their reader, not watched on disk.
        source = RecordSource(runtime.reader, file, prefetch.staging,
                              blob if runtime.reader.local else None)
        policy = make_policy(config.policy, spec.num_experts)
        runtime.stores.append(make_store(spec, pool, source, policy, runtime))
    prefetchers = {}
    if prefetch.on:
        prefetchers = make_prefetchers(model, config, prefetch, runtime.stores, blocks,
                                       runtime.events)
    copies = check_low_bits(manifest, config, runtime)
    if copies is not None:
        copies = {spec.module: spec for spec in copies.layers}
    for store in runtime.stores:
        if runtime.paged:
            router = None
            if store.policy.router or config.trace or copies is not None:
                router = find_router(model, store.spec.module, store.spec.num_experts,
                                     input_dims_of(blocks[store.spec.module]))
            if copies is not None and config.miss_bits_weight is not None and router is None:
                raise ConfigError(
                    f"miss_bits_weight: the router of {store.spec.module} was not found to "
                    "weigh its misses by; leave miss_bits_weight unset (every miss)")
            residency = make_paged(store, runtime, prefetchers.get(store.layer), router)
            low_spec = copies.get(store.spec.module) if copies is not None else None
            if low_spec is not None:  # MTP layers have no copies
                residency.low = make_low(path, low_spec, blocks[store.spec.module], runtime)
        else:
            store.preload()
            residency = Resident(store.layer, runtime.events)
        set_module(model, store.spec.module, StreamingExperts(blocks[store.spec.module],
                                                              residency))
    if copies is not None:
        runtime.reserve(sum(r.low.store.pool.nbytes for r in runtime.residencies
                            if r.low is not None),
                        f"the scratch pools of {config.miss_bits}-bit copies")
    # A static cut changes the routing at any pool size, a full one too;
    # the other modes only steer around missing experts. A tensor-parallel
    # rank holding every expert still routes with the others (and meets them).
    split = runtime.sharding
    tensor = split.tensor if split is not None else None
    if config.routing == "top-k-cut" or \
            ((runtime.paged or tensor is not None) and config.routing != "exact"):
        # After the routers' scorers above were found: they score the
        # router's own choice (prefetch, policies).
        runtime.routing_check = routing_check(config, tensor)
        runtime.routers = install_routers(model, runtime.stores, blocks, config, tensor,
                                          runtime.routing_check)
        for store, router in zip(runtime.stores, runtime.routers):
            # A router whose MoE module holds the selection bias gets it
            # back once the block is called, before prefetch reads it.
            get_module(model, store.spec.module).after_routing = router.restore


def make_low(path: Path, spec: LayerSpec, inner: nn.Module, runtime) -> LowBitMisses:
    """A paged layer's low-bit copies: a scratch pool of as many as a
    decode call misses, their store (checked as the records are) and the
    expert module that computes with them."""
    pool = SlotPool(spec, scratch_slots(spec))
    blob = blob_path(path, spec)
    source = RecordSource(runtime.reader, runtime.reader.open(str(blob)), None, blob)
    store = ExpertStore(spec, pool, source, LRU(spec.num_experts), runtime.config.checksums,
                        runtime.events)
    split = runtime.sharding
    misses = misses_of(spec.num_experts, split.tensor if split is not None else None)
    return LowBitMisses(store, low_inner(inner, spec, pool, bind_pool),
                        runtime.config.miss_bits_weight, misses)


def make_store(spec: LayerSpec, pool: SlotPool, source: RecordSource, policy,
               runtime) -> ExpertStore:
    """The store of one layer: the native step where it can run (a paged
    pool, the C++ reader, a policy it implements, no staging; the trace
    wants the router's probabilities, which only the Python route gathers),
    else the Python reference."""
    native = (runtime.paged and runtime.config.trace is None
              and runtime.config.miss_bits is None
              and native_store_fits(source.reader, policy, source.staging))
    store_class = NativeStore if native else ExpertStore
    return store_class(spec, pool, source, policy, runtime.config.checksums, runtime.events,
                       runtime.prefetch.control)


def make_paged(store: ExpertStore, runtime, prefetcher=None, router=None) -> Paged:
    """A paged residency over ``store``: calls inside the graph where the
    store is native and the backend is the CPU, else host-synced calls."""
    args = (store, runtime.events, prefetcher, router, runtime.overlap_reads())
    if isinstance(store, NativeStore):
        residency = NativePaged(*args, in_graph=calls_in_graph())
    else:
        residency = Paged(*args)
    runtime.residencies.append(residency)
    return residency


def bind_pool(inner: nn.Module, spec: LayerSpec, pool: SlotPool) -> None:
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
