"""The memory plan: how one budget is split between the resident spine,
one token's experts, the spine layers, the expert slots and prefetch's
staging area, and the refusals (with the number that fits) when it
cannot be.
"""

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple
from ..config import StreamConfig
from ..errors import BudgetError
from ..format import DenseSpec, Manifest
from ..system import available_memory_bytes


GB = 1e9


def bytes_per_slot(manifest: Manifest) -> int:
    """Bytes one slot costs summed over all layers (uniform slots)."""
    return sum(l.expert_nbytes for l in manifest.layers)


def min_slots(manifest: Manifest) -> int:
    """Slots one call needs: a decode token's experts in every layer."""
    return max(l.top_k for l in manifest.layers)


def max_slots(manifest: Manifest) -> int:
    return max(l.num_experts for l in manifest.layers)


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
                available=available_memory_bytes) -> MemoryPlan:
    """Split the budget between the spine and the expert pools.

    ``base_bytes`` is the always-resident spine. The budget is ``cache_gb``,
    or what the OS says is available less ``reserve_gb``; with an explicit
    ``slots_per_layer`` the pools are that size and the spine gets what is
    available besides. With prefetch on, its staging area comes out of the
    budget (with an explicit ``slots_per_layer``, it is added to what the
    pools need), unless every expert is resident and no trace is asked
    for (a trace keeps the pools paged).

    Raises:
        BudgetError: the budget holds less than the resident spine, one
            token's experts, the ring and the staging area (the message
            names the minimum),
            or an explicit size needs more memory than is available (it
            names the most that fits): refused here rather than killed by
            the OS later.
    """
    need = min_slots(manifest)
    per_slot = bytes_per_slot(manifest)
    dense = manifest.dense
    buffers = cfg.spine_ring
    # The least the spine can run in: base and a ring of the largest record
    # (or every record pinned, when that is less).
    least_spine = base_bytes + (min(min(buffers, len(dense)) * max(d.nbytes for d in dense),
                                    sum(d.nbytes for d in dense)) if dense else 0)
    if dense and cfg.pinned_layers is not None:
        pins = _split_spine(dense, 0, buffers, cfg.pinned_layers)
        least_spine = base_bytes + pins[3] + pins[4]
    avail = available()
    # What advice leaves free for the KV cache, activations and the rest of
    # the process: the reserve, or a quarter of what is available if less.
    headroom = min(int(cfg.reserve_gb * GB), avail // 4)
    # Prefetch stages its reads outside the pools, when there are pools to
    # miss in (a trace keeps every pool paged).
    everything = max_slots(manifest)

    def staging_of(slots: int) -> int:
        return (staging_bytes(manifest, cfg)
                if slots < everything or cfg.trace is not None else 0)

    least = least_spine + need * per_slot + staging_of(need)

    if cfg.slots_per_layer is not None:
        slots = cfg.slots_per_layer
        if slots < need:
            raise BudgetError(
                f"slots_per_layer={slots} is below the minimum of {need} "
                "(the experts one token routes to); use at least that")
        slots = min(slots, everything)
        asked = least_spine + slots * per_slot + staging_of(slots)
        # What the spine may pin keeps the headroom free; the pools are as asked.
        budget = max(avail - headroom, asked)
        source = f"available memory ({_gb(avail)} GB, less {_gb(headroom)} GB headroom)"
        if asked > avail:
            # The advice keeps the spine resident when it can be: streaming
            # it costs more reads than the slots it would make room for save.
            whole = base_bytes + sum(d.nbytes for d in dense)
            spine = (whole if whole + need * per_slot + staging_of(need) <= avail - headroom
                     else least_spine)
            most = min(int((avail - headroom - spine - staging_of(need)) // per_slot),
                       everything)
            if most >= need:
                advice = (f"use --slots-per-layer {most} or less (with "
                          f"{_gb(spine, up=True)} GB of spine resident)")
            elif least <= avail:
                advice = (f"use --slots-per-layer {need} (the least that loads, leaving "
                          f"{_gb(avail - least)} GB for the rest of the process)")
            else:
                advice = _no_room(least, avail)
            raise BudgetError(
                f"slots_per_layer={cfg.slots_per_layer} needs at least "
                f"{_gb(asked, up=True)} GB, but only {_gb(avail)} GB "
                f"of memory is available: {advice}")
    else:
        if cfg.cache_gb is not None:
            budget, source = int(cfg.cache_gb * GB), f"cache budget {cfg.cache_gb:g} GB"
        else:
            # What the OS says this process can take (available, not just
            # free: reclaimable page cache counts), less a reserve.
            budget = int(avail - cfg.reserve_gb * GB)
            source = f"available memory ({_gb(avail)} GB, less {cfg.reserve_gb:g} GB reserve)"
        if budget < least:
            value = _gb_in(least, avail)
            advice = (f"use --cache-gb {value} or more" if value is not None
                      else _no_room(least, avail))
            raise BudgetError(
                f"{source} holds less than one token's experts (the minimum of {need} per "
                f"layer, {_gb(need * per_slot)} GB) and the {_gb(least_spine)} GB the spine "
                f"needs at least{_staging_note(staging_of(need))}: {advice}"
                + ("" if dense else "; this directory keeps its whole spine in safetensors, "
                   "while one converted by `mlx_streaming convert` (format version 2) "
                   "streams its spine layers too"))
        slots = need

    spine_room = budget - base_bytes - slots * per_slot - staging_of(slots)
    pinned, streamed, ring_buffers, ring, pinned_bytes = _split_spine(
        dense, spine_room, buffers, cfg.pinned_layers)
    if cfg.slots_per_layer is None:
        left = budget - base_bytes - pinned_bytes - ring
        if left // per_slot < everything or cfg.trace is not None:
            # Short of every expert resident, the staging comes out of the pools.
            left -= staging_of(need)
        slots = max(need, min(int(left // per_slot), everything))
        total = base_bytes + pinned_bytes + ring + slots * per_slot + staging_of(slots)
        if cfg.cache_gb is not None and total > avail:
            raise BudgetError(
                f"cache_gb={cfg.cache_gb:g} needs {_gb(total, up=True)} GB, but only "
                f"{_gb(avail)} GB of memory is available: "
                + _cache_advice(least, avail, headroom))
    return MemoryPlan(budget, source, base_bytes, slots, slots * per_slot, pinned, streamed,
                      ring_buffers, ring, pinned_bytes, staging_of(slots))


def _staging_note(staging: int) -> str:
    if not staging:
        return ""
    return (f" and prefetch's {_gb(staging, up=True)} GB staging area (less with "
            "--prefetch off or a smaller --prefetch-width)")


def _no_room(least: int, avail: int) -> str:
    return (f"the model needs at least {_gb(least, up=True)} GB and only {_gb(avail)} GB "
            "is available; free memory or use a machine with more")


def _cache_advice(least: int, avail: int, headroom: int) -> str:
    """A ``--cache-gb`` that loads and leaves the headroom free when there
    is room for it, else the least that loads, else none."""
    value = _gb_in(least, avail - headroom, high_end=True)
    if value is not None:
        return f"use --cache-gb {value} or less"
    value = _gb_in(least, avail)
    if value is not None:
        return (f"use --cache-gb {value} (the least that loads, leaving "
                f"{_gb(avail - least)} GB for the rest of the process)")
    return _no_room(least, avail)


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
