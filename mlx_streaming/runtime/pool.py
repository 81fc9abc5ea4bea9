"""The slot pool of one MoE layer: a ``[slots, ...]`` array per tensor of an
expert record, written in place through numpy views, and the expert-to-slot
table (docs/design.md, "runtime/pool.py")."""

import mlx.core as mx
import numpy as np

from ..format import LayerSpec, dtype_from_name


def distinct(ids: np.ndarray) -> np.ndarray:
    """The sorted distinct expert ids of a call, as int64."""
    if ids.size <= 64:
        # A set is far cheaper than np.unique on a few ids.
        return np.array(sorted(set(ids.ravel().tolist())), dtype=np.int64)
    return np.unique(ids).astype(np.int64)


class SlotPool:
    """Slot arrays and residency tables of one layer."""

    def __init__(self, spec: LayerSpec, slots: int):
        self.spec = spec
        # (module, attribute, array name) bound to this pool, again after a resize.
        self.bindings = []
        self._allocate(slots)
        self.expert_of_slot = np.full(slots, -1, dtype=np.int64)
        # [experts] slot of each expert (-1: none), written through a numpy view.
        self.table = mx.array(np.full(spec.num_experts, -1, dtype=np.int32))
        mx.eval(self.table)
        self.slot_of_expert = np.array(self.table, copy=False)
        assert self.slot_of_expert.flags.c_contiguous and self.slot_of_expert.flags.writeable

    def _allocate(self, slots: int) -> None:
        spec = self.spec
        self.slots = slots
        raw = [mx.zeros((slots, s.nbytes), dtype=mx.uint8) for s in spec.segments]
        mx.eval(raw)
        # Typed views share the raw buffers; the model computes with these.
        self.arrays = {
            s.name: r.view(dtype_from_name(s.dtype)).reshape(slots, *s.shape)
            for s, r in zip(spec.segments, raw)
        }
        mx.eval(list(self.arrays.values()))
        self._raw = raw
        self.views = [np.array(r, copy=False) for r in raw]
        for v, s in zip(self.views, spec.segments):
            # A broadcast or copied buffer would silently drop our writes.
            assert v.flags.c_contiguous and v.flags.writeable
            assert v.shape == (slots, s.nbytes)
        # [slots, segments]: the address of each (slot, segment), for the readers.
        self.addresses = np.stack(
            [v.ctypes.data + np.arange(slots, dtype=np.int64) * s.nbytes
             for v, s in zip(self.views, spec.segments)],
            axis=1,
        ).astype(np.int64)
        self.segments = np.array(
            [(s.offset, s.nbytes) for s in spec.segments], dtype=np.int64
        )

    def bind(self, module, key: str, name: str) -> None:
        """Make ``module.key`` this pool's array ``name``, now and after every resize."""
        self.bindings.append((module, key, name))
        setattr(module, key, self.arrays[name])

    def resize(self, slots: int, keep: np.ndarray) -> None:
        """Reallocate to ``slots`` slots holding the experts of slots ``keep``;
        the caller guarantees that nothing pending reads the pool."""
        keep = np.asarray(keep, dtype=np.int64)[:slots]
        old_views, old_experts = self.views, self.expert_of_slot
        self._allocate(slots)
        for new, old in zip(self.views, old_views):
            new[: len(keep)] = old[keep]
        self.expert_of_slot = np.full(slots, -1, dtype=np.int64)
        self.expert_of_slot[: len(keep)] = old_experts[keep]
        self.slot_of_expert[:] = -1
        held = self.expert_of_slot >= 0
        self.slot_of_expert[self.expert_of_slot[held]] = np.nonzero(held)[0]
        for module, key, name in self.bindings:
            setattr(module, key, self.arrays[name])

    @property
    def nbytes(self) -> int:
        return self.slots * self.spec.expert_nbytes

    def assign(self, experts: np.ndarray, slots: np.ndarray) -> None:
        """``experts`` now live in ``slots`` (emptied by ``evict``), in both tables."""
        self.expert_of_slot[slots] = experts
        self.slot_of_expert[experts] = slots

    def evict(self, slots: np.ndarray) -> None:
        """Forget the content of ``slots``."""
        old = self.expert_of_slot[slots]
        self.slot_of_expert[old[old >= 0]] = -1
        self.expert_of_slot[slots] = -1
