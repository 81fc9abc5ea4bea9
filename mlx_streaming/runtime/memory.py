"""The memory plan: how one budget is split between the resident spine,
one token's experts, the spine layers, the expert slots and prefetch's
staging area, and the refusals (with the number that fits) when it
cannot be.
"""

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

from ..config import DEFAULT_SPINE_RING, StreamConfig
from ..errors import BudgetError
from ..format import DenseSpec, Manifest
from ..system import available_memory_bytes
from .prefill import MIN_PREFILL_STEP, PREFILL_STEP, bytes_per_token, prefill_step, room_for

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
    """Records of prefetch's staging area for layers ``specs``: room for
    one layer's predictions in flight beside those staged a layer earlier
    (``prefetch_depth`` 2) or still being dropped; a layer stages its
    successor's before the layer after next's."""
    return 2 * max(prefetch_width(cfg, s) for s in specs)


def staging_shape(manifest: Manifest, cfg: StreamConfig) -> Tuple[int, int]:
    """(records, bytes per record) of prefetch's staging area, each record
    the size of the largest."""
    return staging_records(cfg, manifest.layers), max(s.stride for s in manifest.layers)


def staging_bytes(manifest: Manifest, cfg: StreamConfig) -> int:
    """Bytes of the staging area; 0 without prefetch."""
    if cfg.prefetch == "off":
        return 0
    records, stride = staging_shape(manifest, cfg)
    return records * stride


@dataclass(frozen=True)
class MemoryPlan:
    """How one memory budget is split (``stats(model)["memory"]``).

    Per token, a spine layer that is not pinned is read whole, while an
    expert slot saves a read only when a token routes to its expert (at
    most ``top_k`` of ``num_experts`` per layer): a byte of pinned spine
    saves at least as much as a byte of pool. So after the always-resident
    spine (embeddings, head, norms, routers) and one token's experts per
    layer, the spine layers are pinned first (leaving a ring of layer
    buffers for the rest), and the pools get what remains.
    """

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
    """``(pinned layers, streamed layers, ring buffers, ring bytes, pinned
    bytes)`` for ``room`` bytes of spine memory: everything pinned when it
    fits, else a ring and as many pins as the rest holds (``_spread`` says
    which). ``room`` may come out short: the caller checks."""
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
    """The ``count`` layers to pin: the largest records first (a smaller
    largest streamed record makes a smaller ring), and among records of one
    size, layers spread over the depth (bit-reversed order), so that pinned
    layers' compute time falls between streamed ones."""
    bits = max(1, (len(dense) - 1).bit_length())
    spread = lambda i: int(f"{i:0{bits}b}"[::-1], 2)  # noqa: E731
    order = sorted(range(len(dense)), key=lambda i: (-dense[i].nbytes, spread(i)))
    return {dense[i].layer for i in order[:count]}


def plan_memory(manifest: Manifest, cfg: StreamConfig, base_bytes: int,
                available=available_memory_bytes, model_config: Optional[dict] = None,
                ) -> MemoryPlan:
    """Split the budget between the spine and the expert pools.

    ``base_bytes`` is the always-resident spine. A headroom stays free for
    the rest of the process (its activations, caches, the libraries):
    ``reserve_gb``, or a quarter of what is available where that is less.
    The budget is ``cache_gb``, or what is available less the headroom; with
    an explicit ``slots_per_layer`` the pools are that size and the spine
    gets what is available besides. No size is accepted that would eat into
    the headroom: a plan that loads, runs. The headroom also decides how
    many prompt tokens go through the model at once (``prefill_step``,
    from ``model_config``'s sizes): mlx-lm's step, or fewer where the
    headroom would not hold its activations; it grows to hold the least
    step. With prefetch on, its staging
    area comes out of the budget (with an explicit ``slots_per_layer``, it
    is added to what the pools need), unless every expert is resident and
    no trace is asked for (a trace keeps the pools paged). Without an
    explicit ``spine_ring``, a ring of one buffer is tried before refusing.

    Raises:
        BudgetError: the budget holds less than the resident spine, one
            token's experts, the ring and the staging area, or a size
            needs more memory than is available besides the headroom: the
            message names the number that fits, refused here rather than
            killed by the OS later.
    """
    avail = available()
    headroom = min(int(cfg.reserve_gb * GB), avail // 4)
    per_token = bytes_per_token(model_config, manifest)
    step = prefill_step(headroom, per_token)
    if step == MIN_PREFILL_STEP:
        # Whatever reserve_gb says: a headroom below the least step's
        # activations is one the process is killed in, not refused.
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
    """What a plan is made in: memory available now, the headroom kept
    free of it, and the spine ring's buffers."""

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
    # The least the spine can run in: base and a ring of the largest record
    # (or every record pinned, when that is less).
    least_spine = base_bytes + (min(min(room.ring, len(dense)) * max(d.nbytes for d in dense),
                                    sum(d.nbytes for d in dense)) if dense else 0)
    if dense and cfg.pinned_layers is not None:
        pins = _split_spine(dense, 0, room.ring, cfg.pinned_layers)
        least_spine = base_bytes + pins[3] + pins[4]
    everything = max_slots(manifest)

    def staging_of(slots: int) -> int:
        # Prefetch stages outside the pools where there are pools to miss
        # in (a trace keeps every pool paged).
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
    """The plan of an explicit ``slots_per_layer``: the pools as asked, the
    spine pinned as far as the memory left allows."""
    need, per_slot, dense = min_slots(manifest), bytes_per_slot(manifest), manifest.dense
    slots = cfg.slots_per_layer
    if slots < need:
        raise BudgetError(f"slots_per_layer={slots} is below the minimum of {need} "
                          "(the experts one token routes to); use at least that")
    slots = min(slots, max_slots(manifest))
    asked = least_spine + slots * per_slot + staging_of(slots)
    if asked > room.usable:
        # The advice keeps the spine resident when it can be: streaming it
        # costs more reads than the slots it would make room for save.
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
    """``plan`` keeping ``nbytes`` of its room for ``what`` (a batch's KV
    caches): the pools give up the slots the room left does not hold.

    Raises:
        BudgetError: even pools of one token's experts leave too little;
            the message says how much the model and ``what`` need.
    """
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
    # 1% under the room where that still fits: available memory moves between
    # this run and the next.
    margin = int(room.usable * 0.99)
    value = _gb_in(least, margin if margin >= least else room.usable, high_end=True)
    return f"use --cache-gb {value} or less" if value is not None else _no_room(least, room)


def _gb_in(low: int, high: int, high_end: bool = False) -> Optional[str]:
    """The shortest GB figure (4 to 12 significant digits) whose bytes lie
    in ``[low, high]``, near ``high`` or near ``low``; None if none."""
    if high < low or high <= 0:
        return None
    for digits in range(4, 13):
        text = _gb(high if high_end else low, up=not high_end, digits=digits)
        if low <= float(text) * GB <= high:
            return text
    return None


def _gb(n: int, up: bool = False, digits: int = 4) -> str:
    """``n`` bytes in GB to ``digits`` significant digits, rounded down (or
    up), so that advice to use at most (or at least) that is right."""
    x = n / GB
    if x <= 0:
        return "0"
    e = math.floor(math.log10(x)) - (digits - 1)
    r = (math.ceil if up else math.floor)(x / 10**e) * 10**e
    return f"{r:.{max(0, -e)}f}"
