"""Low-bit miss reads (``StreamConfig.miss_bits``, approximate): a paged layer
may compute a missed expert from its low-bit copy, read into a small pool of
its own; hits always compute with the full weights."""

import copy
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from ..errors import ConfigError, CorruptExpertError
from ..format import LayerSpec, write_copies_command
from ..models.discover import projections
from .pool import SlotPool
from .rank_routing import OwnMisses


def low_inner(inner: nn.Module, spec: LayerSpec, pool: SlotPool, bind) -> nn.Module:
    """A copy of the expert module ``inner`` computing with the copies' pool:
    mlx-lm's ``QuantizedSwitchLinear`` at their width, bound by ``bind``."""
    low = copy.copy(inner)
    for name in projections(inner):
        q = spec.quantization[name]
        scales = next(s for s in spec.segments if s.name == f"{name}.scales")
        output_dims, groups = scales.shape
        bias = any(s.name == f"{name}.bias" for s in spec.segments)
        # Lazy: its random init is never evaluated, the pool's arrays replace it.
        setattr(low, name, QuantizedSwitchLinear(groups * q["group_size"], output_dims, 1,
                                                 bias=bias, group_size=q["group_size"],
                                                 bits=q["bits"]))
    bind(low, spec, pool)
    return low


class LowBitMisses:
    """One paged layer's low-bit copies: their store, module and ``choose``."""

    def __init__(self, store, inner: nn.Module, weight: Optional[float], misses=OwnMisses()):
        self.store = store
        self.inner = inner
        self.weight = weight
        # Whose misses count: this pool's, or any tensor-parallel rank's (rank_routing).
        self.misses = misses

    def choose(self, missing: np.ndarray, ids: np.ndarray,
               probs: Optional[np.ndarray]) -> np.ndarray:
        """The misses of a call that take their low-bit copy, least weighty first,
        as many as the pool holds: those below ``weight`` of the routed probability
        in every token, else all but each token's weightiest; ``ids`` [tokens, k]."""
        if probs is not None:
            routed = np.take_along_axis(probs, ids, axis=-1)  # [tokens, k]
            shares = routed / np.maximum(routed.sum(axis=-1, keepdims=True), 1e-30)
            top = np.zeros(probs.shape[-1])
            np.maximum.at(top, ids.reshape(-1), shares.reshape(-1))
            top = top[missing]
            order = np.argsort(top, kind="stable")
            if self.weight is not None:
                keep = top[order] < self.weight
            else:
                firsts = np.take_along_axis(ids, shares.argmax(axis=-1)[:, None], axis=-1)
                keep = ~np.isin(missing[order], firsts)
            missing = missing[order][keep]
        return np.sort(missing[: self.store.pool.slots])

    def load(self, experts: np.ndarray) -> float:
        """Bring the copies of ``experts`` into their pool (LRU: a copy needed again
        soon is not read again); this layer's sync evaluated every earlier reader."""
        self.store.policy.observe(experts, None)
        try:
            return self.store.ensure(experts)
        except CorruptExpertError as e:
            spec = self.store.spec
            raise CorruptExpertError(
                e.layer, e.expert, f"its {spec.copy_bits}-bit copy in {spec.file} fails its "
                "checksum", "write the copies again with "
                f"{write_copies_command('DIR', spec.copy_bits, force=True)}") from None

    def slot_ids(self, experts: np.ndarray) -> mx.array:
        return mx.array(self.store.pool.slot_of_expert[experts].astype(np.int32))


def copy_slots(spec: LayerSpec) -> int:
    """Copies a layer's pool of them holds: what one decode call misses."""
    return min(spec.top_k, spec.num_experts)


def check_low_bits(manifest, config, runtime):
    """The low-bit copies ``config.miss_bits`` asks for, or None (none asked, or all
    resident); ConfigError where the directory lacks them or the run cannot use them."""
    if config.miss_bits is None:
        return None
    copies = manifest.low_copies(config.miss_bits)
    if copies is None:
        have = ", ".join(str(c.bits) for c in manifest.low_bits) or "none"
        raise ConfigError(
            f"miss_bits={config.miss_bits}: this directory holds no {config.miss_bits}-bit "
            f"copies (it holds: {have}); add them with `python -m mlx_streaming.convert "
            f"--out DIR --miss-bits {config.miss_bits}`")
    if not runtime.reader.local:
        raise ConfigError(f"miss_bits={config.miss_bits}: low-bit miss reads run from a local "
                          "directory (not a Hub repo): download it, or leave miss_bits off")
    if not runtime.paged:
        return None  # every expert resident: nothing is ever missed
    return copies
