"""The memory plan: one budget split between the spine, the expert pools and
prefetch's staging, or refused naming what fits (docs/design.md, "runtime/memory.py")."""

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

from ..config import DEFAULT_SPINE_RING, StreamConfig
from ..errors import BudgetError
from ..format import DenseSpec, Manifest
from ..system import available_memory_bytes
from .prefill_step import MIN_PREFILL_STEP, PREFILL_STEP, bytes_per_token, prefill_step, room_for

GB = 1e9


def bytes_per_slot(manifest: Manifest) -> int:
    """Bytes one slot costs summed over all layers (uniform slots)."""
    return sum(spec.expert_nbytes for spec in manifest.layers)


def min_slots(manifest: Manifest) -> int:
    """Slots one call needs: a decode token's experts in every layer."""
    return max(spec.top_k for spec in manifest.layers)


def max_slots(manifest: Manifest) -> int:
    return max(spec.num_experts for spec in manifest.layers)


def prefetch_width(cfg: StreamConfig, spec) -> int:
    """Experts prefetch predicts per token for layer ``spec``."""
    return min(cfg.prefetch_width or 2 * spec.top_k, spec.num_experts)


def staging_records(cfg: StreamConfig, specs) -> int:
    """Records of prefetch's staging for ``specs``: one layer's predictions in
    flight beside those staged a layer earlier or still being dropped."""
    return 2 * max(prefetch_width(cfg, s) for s in specs)


def staging_shape(manifest: Manifest, cfg: StreamConfig) -> Tuple[int, int]:
    """(records, bytes per record) of prefetch's staging, each the largest's size."""
    return staging_records(cfg, manifest.layers), max(s.stride for s in manifest.layers)


def staging_bytes(manifest: Manifest, cfg: StreamConfig) -> int:
    """Bytes of the staging area; 0 without prefetch."""
    if cfg.prefetch == "off":
        return 0
    records, stride = staging_shape(manifest, cfg)
    return records * stride


@dataclass(frozen=True)
class MemoryPlan:
    """How one memory budget is split (``stats(model)["memory"]``)."""

    budget: int  # bytes the split may use
    source: str  # where the budget came from
    base: int  # always-resident spine (safetensors)
    slots: int  # expert slots per layer
    pool: int  # bytes of all expert pools
    pinned: Tuple[int, ...]  # layers whose dense record stays resident
    streamed: Tuple[int, ...]  # layers read into the ring on every pass
    ring_buffers: int
    ring: int  # bytes of the ring
    pinned_bytes: int
    staging: int = 0  # bytes of prefetch's staging area (paged pools only)
    headroom: int = 0  # left free for the rest of the process (and the pressure bar)
    usable: int = 0  # what was available at load less the headroom
    reserved: int = 0  # kept for what the process holds besides the weights (KV caches)
    prefill_step: int = PREFILL_STEP  # prompt tokens per model call that the headroom holds

    @property
    def total(self) -> int:
        return self.base + self.pinned_bytes + self.ring + self.pool + self.staging

    def report(self) -> dict:
        return {
            "budget_gb": self.budget / GB, "source": self.source,
            "base_gb": self.base / GB, "pinned_layers": len(self.pinned),
            "pinned_gb": self.pinned_bytes / GB, "streamed_layers": list(self.streamed),
            "ring_buffers": self.ring_buffers, "ring_gb": self.ring / GB,
            "pool_gb": self.pool / GB, "slots_per_layer": self.slots,
            "staging_gb": self.staging / GB, "total_gb": self.total / GB,
            "headroom_gb": self.headroom / GB, "reserved_gb": self.reserved / GB,
            "prefill_step": self.prefill_step,
        }


def _split_spine(dense: Sequence[DenseSpec], room: int, buffers: int,
                 pinned_layers: Optional[int]):
    """(pinned, streamed, ring buffers, ring bytes, pinned bytes) for ``room``
    bytes of spine: all pinned if it fits, else a ring and pins; the caller checks."""
    total = sum(d.nbytes for d in dense)
    if not dense or (pinned_layers is None and total <= room):
        return tuple(d.layer for d in dense), (), 0, 0, total
    count = len(dense) if pinned_layers is None else min(pinned_layers, len(dense))
    ring_of = lambda pins: min(buffers, len(dense) - len(pins)) * max(  # noqa: E731
        (d.nbytes for d in dense if d.layer not in pins), default=0)
    while count > 0:
        pins = _spread(dense, count)
        pinned = sum(d.nbytes for d in dense if d.layer in pins)
        if pinned_layers is not None or pinned + ring_of(pins) <= room:
            break
        count -= 1
    pins = _spread(dense, count) if count > 0 else set()
    streamed = tuple(d.layer for d in dense if d.layer not in pins)
    ring_buffers = min(buffers, len(streamed))
    return (tuple(d.layer for d in dense if d.layer in pins), streamed, ring_buffers,
            ring_of(pins), sum(d.nbytes for d in dense if d.layer in pins))


def _spread(dense: Sequence[DenseSpec], count: int) -> set:
    """The ``count`` layers to pin: the largest records first (a smaller ring),
    then spread over the depth (docs/design.md, "runtime/memory.py")."""
    bits = max(1, (len(dense) - 1).bit_length())
    spread = lambda i: int(f"{i:0{bits}b}"[::-1], 2)  # noqa: E731
    order = sorted(range(len(dense)), key=lambda i: (-dense[i].nbytes, spread(i)))
    return {dense[i].layer for i in order[:count]}


def plan_memory(manifest: Manifest, cfg: StreamConfig, base_bytes: int,
                available=available_memory_bytes, model_config: Optional[dict] = None,
                ) -> MemoryPlan:
    """Split the budget between the spine and the expert pools, keeping a
    headroom free for the rest of the process and choosing the prefill step
    it holds (docs/design.md, "The memory plan: one budget").

    Raises:
        BudgetError: the budget or a size does not fit; the message names
            the number that does.
    """
    avail = available()
    headroom = min(int(cfg.reserve_gb * GB), avail // 4)
    per_token = bytes_per_token(model_config, manifest)
    step = prefill_step(headroom, per_token)
    if step == MIN_PREFILL_STEP:
        # A headroom below the least step's activations would get the process killed.
        headroom = max(headroom, min(room_for(step, per_token), avail // 2))
    rings = (cfg.spine_ring,) if cfg.spine_ring is not None else (DEFAULT_SPINE_RING, 1)
    for ring in rings:
        try:
            plan = _plan(manifest, cfg, base_bytes, _Room(avail, headroom, ring))
            return replace(plan, prefill_step=step)
        except BudgetError:
            if ring == rings[-1]:
                raise
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class _Room:
    """Memory available now, the headroom kept free of it, the ring's buffers."""

    avail: int
    headroom: int
    ring: int

    @property
    def usable(self) -> int:
        return self.avail - self.headroom


def _plan(manifest: Manifest, cfg: StreamConfig, base_bytes: int, room: _Room) -> MemoryPlan:
    need = min_slots(manifest)
    per_slot = bytes_per_slot(manifest)
    dense = manifest.dense
    # The least the spine runs in: base and a ring of the largest record (or all).
    least_spine = base_bytes + (min(min(room.ring, len(dense)) * max(d.nbytes for d in dense),
                                    sum(d.nbytes for d in dense)) if dense else 0)
    if dense and cfg.pinned_layers is not None:
        pins = _split_spine(dense, 0, room.ring, cfg.pinned_layers)
        least_spine = base_bytes + pins[3] + pins[4]
    everything = max_slots(manifest)

    def staging_of(slots: int) -> int:
        # Staging only where there are pools to miss in (a trace keeps them paged).
        return (staging_bytes(manifest, cfg)
                if slots < everything or cfg.trace is not None else 0)

    least = least_spine + need * per_slot + staging_of(need)
    if cfg.slots_per_layer is not None:
        return _plan_slots(manifest, cfg, base_bytes, room, least_spine, least, staging_of)
    if cfg.cache_gb is not None:
        budget, source = int(cfg.cache_gb * GB), f"cache budget {cfg.cache_gb:g} GB"
    else:
        budget = room.usable
        source = (f"available memory ({_gb(room.avail)} GB, less {_gb(room.headroom)} GB "
                  "headroom)")
    if budget < least:
        advice = (_no_room(least, room) if cfg.cache_gb is None or least > room.usable
                  else f"use --cache-gb {_gb_in(least, room.usable)} or more")
        raise BudgetError(
            f"{source} holds less than one token's experts (the minimum of {need} per "
            f"layer, {_gb(need * per_slot)} GB) and the {_gb(least_spine)} GB the spine "
            f"needs at least{_staging_note(staging_of(need))}: {advice}"
            + ("" if dense or manifest.version >= 2 else
               "; this directory keeps its whole spine in safetensors, "
               "while one converted by `mlx_streaming convert` (format version 2) "
               "streams its spine layers too"))
    spine_room = budget - base_bytes - need * per_slot - staging_of(need)
    pinned, streamed, ring_buffers, ring, pinned_bytes = _split_spine(
        dense, spine_room, room.ring, cfg.pinned_layers)
    left = budget - base_bytes - pinned_bytes - ring
    if left // per_slot < everything or cfg.trace is not None:
        # Short of every expert resident, the staging comes out of the pools.
        left -= staging_of(need)
    slots = max(need, min(int(left // per_slot), everything))
    total = base_bytes + pinned_bytes + ring + slots * per_slot + staging_of(slots)
    if cfg.cache_gb is not None and total > room.usable:
        raise BudgetError(
            f"cache_gb={cfg.cache_gb:g} needs {_gb(total, up=True)} GB, but only "
            f"{_gb(room.usable)} GB of the {_gb(room.avail)} GB available can go to the "
            f"model (the rest of the process needs {_gb(room.headroom)} GB): "
            + _cache_advice(least, room))
    return MemoryPlan(budget, source, base_bytes, slots, slots * per_slot, pinned, streamed,
                      ring_buffers, ring, pinned_bytes, staging_of(slots), room.headroom,
                      room.usable)


def _plan_slots(manifest, cfg, base_bytes, room: _Room, least_spine: int, least: int,
                staging_of) -> MemoryPlan:
    """An explicit ``slots_per_layer``: the pools as asked, the spine pinned as room allows."""
    need, per_slot, dense = min_slots(manifest), bytes_per_slot(manifest), manifest.dense
    slots = cfg.slots_per_layer
    if slots < need:
        raise BudgetError(f"slots_per_layer={slots} is below the minimum of {need} "
                          "(the experts one token routes to); use at least that")
    slots = min(slots, max_slots(manifest))
    asked = least_spine + slots * per_slot + staging_of(slots)
    if asked > room.usable:
        # The advice keeps the spine resident where it can (docs/design.md, "runtime/memory.py").
        whole = base_bytes + sum(d.nbytes for d in dense)
        spine = whole if whole + need * per_slot + staging_of(need) <= room.usable \
            else least_spine
        most = min(int((room.usable - spine - staging_of(need)) // per_slot),
                   max_slots(manifest))
        advice = (f"use --slots-per-layer {most} or less (with {_gb(spine, up=True)} GB of "
                  "spine resident)" if most >= need else _no_room(least, room))
        raise BudgetError(
            f"slots_per_layer={cfg.slots_per_layer} needs at least {_gb(asked, up=True)} GB, "
            f"but only {_gb(room.usable)} GB of the {_gb(room.avail)} GB available can go "
            f"to the model (the rest of the process needs {_gb(room.headroom)} GB): {advice}")
    # What the spine may pin keeps the headroom free; the pools are as asked.
    budget = room.usable
    source = f"available memory ({_gb(room.avail)} GB, less {_gb(room.headroom)} GB headroom)"
    spine_room = budget - base_bytes - slots * per_slot - staging_of(slots)
    pinned, streamed, ring_buffers, ring, pinned_bytes = _split_spine(
        dense, spine_room, room.ring, cfg.pinned_layers)
    return MemoryPlan(budget, source, base_bytes, slots, slots * per_slot, pinned, streamed,
                      ring_buffers, ring, pinned_bytes, staging_of(slots), room.headroom,
                      room.usable)


def reserved_plan(plan: MemoryPlan, manifest: Manifest, nbytes: int, what: str) -> MemoryPlan:
    """``plan`` keeping ``nbytes`` of its room for ``what`` (a batch's KV caches),
    the pools giving up slots; BudgetError when even the smallest leave too little."""
    per_slot = bytes_per_slot(manifest)
    # What earlier reservations keep stays theirs.
    short = nbytes - (plan.usable - plan.total - plan.reserved)
    slots = plan.slots - max(0, math.ceil(short / per_slot))
    if slots < min_slots(manifest):
        raise BudgetError(
            f"{what} needs {_gb(nbytes, up=True)} GB, and the model at its smallest "
            f"{_gb(plan.total - (plan.slots - min_slots(manifest)) * per_slot, up=True)} GB, "
            f"but only {_gb(plan.usable)} GB can go to the two")
    return replace(plan, slots=slots, pool=slots * per_slot, reserved=plan.reserved + nbytes)


def _staging_note(staging: int) -> str:
    if not staging:
        return ""
    return (f" and prefetch's {_gb(staging, up=True)} GB staging area (less with "
            "--prefetch off or a smaller --prefetch-width)")


def _no_room(least: int, room: _Room) -> str:
    return (f"the model needs at least {_gb(least, up=True)} GB besides the "
            f"{_gb(room.headroom, up=True)} GB the rest of the process needs, and only "
            f"{_gb(room.avail)} GB is available; free memory or use a machine with more"
            + (" (or lower --reserve-gb, at the risk of the process being killed)"
               if room.headroom else ""))


def _cache_advice(least: int, room: _Room) -> str:
    """A ``--cache-gb`` that loads and leaves the headroom free, or none."""
    # 1% under the room where that fits: available memory moves between runs.
    margin = int(room.usable * 0.99)
    value = _gb_in(least, margin if margin >= least else room.usable, high_end=True)
    return f"use --cache-gb {value} or less" if value is not None else _no_room(least, room)


def _gb_in(low: int, high: int, high_end: bool = False) -> Optional[str]:
    """The shortest GB figure (4 to 12 digits) within ``[low, high]``, or None."""
    if high < low or high <= 0:
        return None
    for digits in range(4, 13):
        text = _gb(high if high_end else low, up=not high_end, digits=digits)
        if low <= float(text) * GB <= high:
            return text
    return None


def _gb(n: int, up: bool = False, digits: int = 4) -> str:
    """``n`` bytes in GB to ``digits`` digits, rounded down (or up), for advice."""
    x = n / GB
    if x <= 0:
        return "0"
    e = math.floor(math.log10(x)) - (digits - 1)
    r = (math.ceil if up else math.floor)(x / 10**e) * 10**e
    return f"{r:.{max(0, -e)}f}"
