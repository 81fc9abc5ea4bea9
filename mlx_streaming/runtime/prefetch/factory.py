"""Prefetch's parts, chosen at load and wired to the stores and blocks."""

from dataclasses import dataclass
from typing import Dict, List, Optional

from ...config import StreamConfig
from ...format import LayerSpec, Manifest
from ...models.discover import find_router, input_dims_of
from ..events import Events
from ..memory import prefetch_width, staging_shape
from .learn import (
    Affinity,
    AlwaysOn,
    PrefetchBandwidth,
    PrefetchCalibration,
    PrefetchControl,
    ReadEveryPrediction,
)
from .predict import NextLayerPrefetch, Shared, Target, scores_calibrated
from .trial import PrefetchTrial


@dataclass
class Prefetch:
    """The parts of a model's prefetch its layers share; ``on`` False (off, or all
    resident): only the trial and the count by position, nothing read ahead."""

    on: bool
    trial: object  # PrefetchTrial, or AlwaysOn
    bandwidth: Optional[PrefetchBandwidth]
    calibration: object  # PrefetchCalibration, or ReadEveryPrediction
    by_position: ReadEveryPrediction  # the layers a sigmoid router predicts
    affinity: Optional[Affinity]
    control: PrefetchControl
    staging: object = None  # the reader's staging area (the memory plan counted it)
    cancelled_at_reset: int = 0  # the staging's count when stats were last reset

    def cancelled(self) -> int:
        """Reads ahead cancelled before they started, since the last reset."""
        return self.staging.cancelled() - self.cancelled_at_reset


def make_prefetch(config: StreamConfig, manifest: Manifest, reader, paged: bool) -> Prefetch:
    """The shared parts of prefetch ``config`` asks for, and the control that feeds them."""
    first = manifest.layers[0].layer
    on_call, on_route, on_stall = [], [], []
    trial = AlwaysOn()
    if config.prefetch == "auto":
        trial = PrefetchTrial(first, config.prefetch_max_tokens)
        on_call.append(trial.on_call)
        on_stall.append(trial.on_stall)
    by_position = ReadEveryPrediction()
    on = config.prefetch != "off" and paged
    parts = Prefetch(on=on, trial=trial, bandwidth=None, calibration=by_position,
                     by_position=by_position, affinity=None, control=PrefetchControl(),
                     staging=reader.staging(*staging_shape(manifest, config)) if on else None)
    if parts.on:
        parts.bandwidth = PrefetchBandwidth(
            first, len(manifest.layers), max(spec.stride for spec in manifest.layers),
            config.prefetch_max_tokens, reader.busy, fixed=config.prefetch_records)
        if config.prefetch_records is None:
            on_call.append(parts.bandwidth.on_call)
            on_stall.append(parts.bandwidth.on_stall)
        layers = [spec for spec in manifest.layers if not is_mtp(spec)]
        if config.prefetch_affinity:
            parts.affinity = Affinity([(a.layer, a.num_experts, b.layer, b.num_experts)
                                       for a, b in prefetch_pairs(layers)])
            on_route.append(parts.affinity.on_route)
        on_route.append(by_position.on_route)
        if config.prefetch_precision > 0:
            parts.calibration = PrefetchCalibration([spec.layer for spec in layers],
                                                    config.prefetch_precision)
            on_route.append(parts.calibration.on_route)
    parts.control = PrefetchControl(on_call, on_route, on_stall)
    return parts


def make_prefetchers(model, config: StreamConfig, parts: Prefetch, stores: List,
                     blocks: Dict, events: Events) -> Dict[int, NextLayerPrefetch]:
    """One prefetcher per layer whose successor's router takes its input (with
    affinity, the last layer's too, for the next token's first), keyed by layer."""
    stores = [s for s in stores if not is_mtp(s.spec)]  # MTP runs only to draft
    shared = Shared(parts.trial, parts.bandwidth, parts.affinity, events,
                    config.prefetch_max_tokens)
    out = {}
    for i, (store, nxt) in enumerate(zip(stores, stores[1:])):
        dims = input_dims_of(blocks[store.spec.module])
        target = _target(model, parts, nxt, dims)
        if target is None:
            continue
        ahead = None
        if config.prefetch_depth > 1 and i + 2 < len(stores):
            ahead = _target(model, parts, stores[i + 2], dims)
        out[store.layer] = NextLayerPrefetch(store.layer, target,
                                             prefetch_width(config, nxt.spec), shared, ahead)
    if parts.affinity is not None:
        for store, nxt in prefetch_pairs(stores)[len(stores) - 1:]:
            target = Target(None, nxt, _calibration(parts, nxt.layer, None))
            out[store.layer] = NextLayerPrefetch(store.layer, target,
                                                 prefetch_width(config, nxt.spec), shared)
    return out


def _target(model, parts: Prefetch, store, dims: int) -> Optional[Target]:
    """``store``'s layer as predicted by its router on an input of
    ``dims``, or None when its router does not take such inputs."""
    scorer = find_router(model, store.spec.module, store.spec.num_experts, dims)
    if scorer is None:
        return None
    return Target(scorer, store, _calibration(parts, store.layer, scorer))


def _calibration(parts: Prefetch, layer: int, scorer):
    """The calibration of ``layer`` as predicted by ``scorer`` (``scores_calibrated``)."""
    if scores_calibrated(scorer):
        return parts.calibration
    parts.calibration.forget(layer)
    return parts.by_position


def is_mtp(spec: LayerSpec) -> bool:
    """An MTP layer: it runs only when drafting, after the model."""
    return spec.module.startswith("mtp.")


def prefetch_pairs(layers: list) -> list:
    """(layer, successor) pairs: each MoE layer and the next, then the last and
    the first (two layers or more: a layer's prediction of itself is useless)."""
    pairs = list(zip(layers, layers[1:]))
    return pairs + [(layers[-1], layers[0])] if len(layers) > 1 else pairs
