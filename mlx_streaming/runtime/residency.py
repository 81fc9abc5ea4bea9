"""The one place where each MoE block's residency is chosen: every expert
resident, paged through Python, or paged with the native step."""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from ..errors import ConfigError, FormatError
from ..format import LayerSpec, Manifest, blob_path
from ..models.discover import (
    find_expert_blocks,
    find_router,
    input_dims_of,
    projections,
    set_module,
)
from .block import NativePaged, Paged, Resident, StreamingExperts, calls_in_graph
from .cache_aware import install_routers
from .low_bits import LowBitMisses, check_low_bits, copy_slots, low_inner
from .policy import LRU, make_policy
from .pool import SlotPool
from .prefetch.factory import make_prefetchers
from .rank_routing import misses_of, routing_check
from .store import NATIVE_POLICIES, ExpertStore, NativeStore, RecordSource


@dataclass(frozen=True)
class HotPath:
    """How a model's MoE calls run, chosen once at load and reported by ``stats()``:
    ``kind`` ("resident", "native in graph", "native synced", "python"), ``why``."""

    kind: str
    why: str


def choose_path(runtime) -> HotPath:
    """The path of every MoE call. On "native in graph", a call still syncs when it
    holds more ids than slots, runs on another stream, or its layer's reads are
    slow enough to overlap (``NativePaged.__call__``)."""
    config = runtime.config
    if not runtime.paged:
        return HotPath("resident", "every expert fits in its layer's pool")
    policy = make_policy(config.policy, runtime.manifest.layers[0].num_experts)
    python = [why for why, applies in (
        ("a trace wants the router's probabilities", config.trace is not None),
        ("low-bit copies are chosen per call in Python", config.miss_bits is not None),
        (f"the {runtime.reader.name} reader has no native step",
         runtime.reader.native_handle is None),
        (f"the native step has no {config.policy} policy",
         type(policy) not in NATIVE_POLICIES),
        ("prefetch's staged records are taken one by one in Python",
         runtime.prefetch.staging is not None),
    ) if applies]
    if python:
        return HotPath("python", "; ".join(python))
    if calls_in_graph():
        return HotPath("native in graph", "the remap primitive runs on the CPU stream")
    return HotPath("native synced", "the remap primitive has no GPU kernel: calls sync")


def install_blocks(model: nn.Module, path: Path, manifest: Manifest, runtime) -> None:
    """Replace every expert block by a ``StreamingExperts`` on ``choose_path``'s path."""
    config = runtime.config
    runtime.path = choose_path(runtime)
    blocks = dict(find_expert_blocks(model))
    prefetch = runtime.prefetch
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
    found = check_low_bits(manifest, config, runtime)
    copies = {} if found is None else {spec.module: spec for spec in found.layers}
    # The routers' own scorers, found before cache-aware routing wraps them.
    scorers = {store.layer: _scorer(model, store, blocks, config, bool(copies))
               for store in runtime.stores if runtime.paged}
    restore = _install_routers(model, blocks, runtime)
    for store in runtime.stores:
        module = store.spec.module
        if runtime.paged:
            copy_spec = copies.get(module)  # MTP layers have no copies
            low_bit = (make_copies(path, copy_spec, blocks[module], runtime)
                       if copy_spec else None)
            residency = make_paged(store, runtime, prefetchers.get(store.layer),
                                   scorers[store.layer], low_bit)
        else:
            store.preload()
            residency = Resident(store.layer, runtime.events)
        set_module(model, module, StreamingExperts(blocks[module], residency,
                                                   restore.get(store.layer)))
    if copies:
        runtime.reserve(sum(r.copies.store.pool.nbytes for r in runtime.residencies
                            if r.copies is not None),
                        f"the pools of {config.miss_bits}-bit copies")


def _scorer(model: nn.Module, store: ExpertStore, blocks: dict, config, copies: bool):
    """The layer's router scorer where its probabilities are wanted (the
    policy, a trace, low-bit copies' weights), else None."""
    spec = store.spec
    if not (store.policy.router or config.trace or copies):
        return None
    router = find_router(model, spec.module, spec.num_experts, input_dims_of(blocks[spec.module]))
    if copies and config.miss_bits_weight is not None and router is None:
        raise ConfigError(
            f"miss_bits_weight: the router of {spec.module} was not found to weigh its "
            "misses by; leave miss_bits_weight unset (every miss)")
    return router


def _install_routers(model: nn.Module, blocks: dict, runtime) -> dict:
    """Cache-aware (or cut) routing where ``routing`` asks: the wrappers in
    ``runtime.routers``, and per layer what its block calls first (``restore``)."""
    config = runtime.config
    split = runtime.sharding
    tensor = split.tensor if split is not None else None
    if not (config.routing == "top-k-cut" or
            ((runtime.paged or tensor is not None) and config.routing != "exact")):
        return {}
    runtime.routing_check = routing_check(config, tensor)
    runtime.routers = install_routers(model, runtime.stores, blocks, config, tensor,
                                      runtime.routing_check)
    return {store.layer: router.restore
            for store, router in zip(runtime.stores, runtime.routers)}


def make_copies(path: Path, spec: LayerSpec, inner: nn.Module, runtime) -> LowBitMisses:
    """A paged layer's low-bit copies: a pool of as many as a decode call misses,
    their store (checked as records are) and the module computing with them."""
    pool = SlotPool(spec, copy_slots(spec))
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
    """One layer's store: the native step on a native path, else the Python reference."""
    native = runtime.path.kind.startswith("native")
    store_class = NativeStore if native else ExpertStore
    return store_class(spec, pool, source, policy, runtime.config.checksums, runtime.events)


def make_paged(store: ExpertStore, runtime, prefetcher=None, router=None,
               copies: Optional[LowBitMisses] = None) -> Paged:
    """A paged residency over ``store``: in the graph on that path, else host-synced."""
    args = (store, runtime.events, prefetcher, router, runtime.overlap_reads(), copies)
    if isinstance(store, NativeStore):
        residency = NativePaged(*args, in_graph=runtime.path.kind == "native in graph")
    else:
        residency = Paged(*args)
    runtime.residencies.append(residency)
    return residency


def bind_pool(inner: nn.Module, spec: LayerSpec, pool: SlotPool) -> None:
    """Point the projections of ``inner`` at the pool arrays, quantized first
    (lazily) with mlx-lm's ``to_quantized`` where the manifest says so."""
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
            # Floats may be stored as another float type; integers (packed) must match.
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
