"""Low-bit miss reads (``StreamConfig.miss_bits``, approximate): a paged
layer may compute a missed expert from its low-bit copy (``convert
--miss-bits``), read into a small pool of its own, instead of reading the
full record into the main pool. Hits always compute with the full weights.
"""

import copy
from typing import Optional
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from ..errors import ConfigError
from ..format import LayerSpec
from ..models.discover import projections
from .pool import SlotPool


def low_inner(inner: nn.Module, spec: LayerSpec, pool: SlotPool, bind) -> nn.Module:
    """A copy of the expert module ``inner`` whose projections compute
    with the low-bit pool: mlx-lm's own ``QuantizedSwitchLinear`` at the
    copies' width, bound to ``pool`` by ``bind`` (``residency.bind_pool``)."""
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
    """One paged layer's low-bit copies: their store (a pool of ``slots``
    copies, LRU), the expert module that computes with them, and which
    misses of a call take them (``choose``)."""

    def __init__(self, store, inner: nn.Module, weight: Optional[float]):
        self.store = store
        self.inner = inner
        self.weight = weight

    def choose(self, missing: np.ndarray, probs: Optional[np.ndarray]) -> np.ndarray:
        """The missed experts of a call that take their low-bit copy, the
        least likely first, as many as the copies' pool holds: those whose
        router probability stays below ``weight`` for every token of the
        call; without a weight, all but any token's most probable expert
        (all, where the router's probabilities are not known). The others
        are read in full and join the pool."""
        if probs is not None:
            top = probs[:, missing].max(axis=0)
            order = np.argsort(top, kind="stable")
            if self.weight is not None:
                keep = top[order] < self.weight
            else:
                keep = ~np.isin(missing[order], probs.argmax(axis=-1))
            missing = missing[order][keep]
        return np.sort(missing[: self.store.pool.slots])

    def slot_ids(self, experts: np.ndarray) -> mx.array:
        return mx.array(self.store.pool.slot_of_expert[experts].astype(np.int32))


def check_low_bits(manifest, config, runtime):
    """The low-bit copies ``config.miss_bits`` asks for, or None (none
    asked, or every expert resident).

    Raises:
        ConfigError: the directory holds no copies of that width, or the
            run cannot use them.
    """
    if config.miss_bits is None:
        return None
    copies = manifest.low_copies(config.miss_bits)
    if copies is None:
        have = ", ".join(str(c.bits) for c in manifest.low_bits) or "none"
        raise ConfigError(
            f"miss_bits={config.miss_bits}: this directory holds no {config.miss_bits}-bit "
            f"copies (it holds: {have}); add them with `python -m mlx_streaming.convert "
            f"--model SRC --out DIR --miss-bits {config.miss_bits}`")
    if runtime.sharding is not None or not runtime.reader.local:
        raise ConfigError(f"miss_bits={config.miss_bits}: low-bit miss reads run on one "
                          "machine from a local directory (not split runs, not Hub repos)")
    if not runtime.paged:
        return None  # every expert resident: nothing is ever missed
    return copies
