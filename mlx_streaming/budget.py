"""Sizing the slot pools from a memory budget."""

import os
import subprocess
from pathlib import Path

from .config import StreamConfig
from .errors import BudgetError
from .format import Manifest

GB = 1e9


def available_memory_bytes() -> int:
    """Memory this process could still take without being killed: the OS's
    own estimate (Linux MemAvailable, which counts reclaimable page cache;
    macOS free + purgeable, not inactive pages, which the OS only pages out
    under pressure), capped by what the memory cgroup has left (its
    reclaimable inactive file pages counted as available)."""
    try:
        with open("/proc/meminfo") as f:
            info = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f}
        available = info.get("MemAvailable", info.get("MemFree", 0))
    except FileNotFoundError:
        return _macos_available_bytes()
    cgroup = _cgroup_memory()
    if cgroup is None:
        return available
    limit, usage = cgroup
    return min(available, limit - usage + _cgroup_inactive_file())


def total_memory_bytes() -> int:
    """Physical memory, or the memory cgroup's limit when that is lower."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cgroup = _cgroup_memory()
    return physical if cgroup is None else min(physical, cgroup[0])


def _cgroup_memory(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"):
    """(limit, usage) of this process's memory cgroup (v1 or v2), or None."""
    try:
        lines = Path(proc).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = Path(root) / "memory" / path.lstrip("/")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        elif controllers == "":
            base = Path(root) / path.lstrip("/")
            files = ("memory.max", "memory.current")
        else:
            continue
        try:
            limit, usage = ((base / f).read_text().strip() for f in files)
        except OSError:
            continue
        if limit != "max" and int(limit) < 1 << 60:
            return int(limit), int(usage)
    return None


def _cgroup_inactive_file(proc: str = "/proc/self/cgroup",
                          root: str = "/sys/fs/cgroup") -> int:
    try:
        for line in Path(proc).read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                stat = Path(root) / "memory" / path.lstrip("/") / "memory.stat"
                key = "total_inactive_file"
            elif controllers == "":
                stat = Path(root) / path.lstrip("/") / "memory.stat"
                key = "inactive_file"
            else:
                continue
            for l in stat.read_text().splitlines():
                name, value = l.split()
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _macos_available_bytes() -> int:
    out = subprocess.run(["vm_stat"], capture_output=True, text=True, check=True).stdout
    page = int(out.split("page size of ")[1].split()[0])
    pages = 0
    for line in out.splitlines():
        if line.startswith(("Pages free:", "Pages purgeable:")):
            pages += int(line.split()[-1].rstrip("."))
    return pages * page


def bytes_per_slot(manifest: Manifest) -> int:
    """Bytes one slot costs summed over all layers (uniform slots)."""
    return sum(l.expert_nbytes for l in manifest.layers)


def min_slots(manifest: Manifest) -> int:
    """Slots one call needs: a decode token's experts in every layer."""
    return max(l.top_k for l in manifest.layers)


def max_slots(manifest: Manifest) -> int:
    return max(l.num_experts for l in manifest.layers)


def plan_slots(manifest: Manifest, cfg: StreamConfig, spine_bytes: int,
               available=available_memory_bytes) -> int:
    """Slots per layer for this config.

    Raises:
        BudgetError: the budget holds fewer experts per layer than one call
            needs (the message names the minimum), or an explicit size
            needs more memory than is available (it names the most that
            fits): refused here rather than killed by the OS later.
    """
    need = min_slots(manifest)
    per_slot = bytes_per_slot(manifest)
    if cfg.slots_per_layer is not None:
        slots = cfg.slots_per_layer
        if slots < need:
            raise BudgetError(
                f"slots_per_layer={slots} is below the minimum of {need} "
                "(the experts one token routes to); use at least that"
            )
        slots = min(slots, max_slots(manifest))
        _check_fits(f"slots_per_layer={cfg.slots_per_layer}", slots, per_slot, spine_bytes,
                    available())
        return slots

    if cfg.cache_gb is not None:
        slots = min(int(cfg.cache_gb * GB // per_slot), max_slots(manifest))
        if slots >= need:
            _check_fits(f"cache_gb={cfg.cache_gb:g}", slots, per_slot, spine_bytes, available())
        budget = cfg.cache_gb * GB
        source = f"cache budget {cfg.cache_gb:g} GB"
    else:
        # What the OS says this process can take (available, not just free:
        # reclaimable page cache counts), less a reserve for everything else.
        free = available()
        budget = free - cfg.reserve_gb * GB - spine_bytes
        source = (
            f"available memory ({free / GB:.2f} GB, less {cfg.reserve_gb:g} GB reserve "
            f"and {spine_bytes / GB:.2f} GB spine)"
        )
    slots = int(max(budget, 0) // per_slot)
    if slots < need:
        raise BudgetError(
            f"{source} holds {max(slots, 0)} experts per layer, below the minimum of "
            f"{need}: use --cache-gb {need * per_slot / GB:.3f} or more"
        )
    return min(slots, max_slots(manifest))


def _check_fits(asked: str, slots: int, per_slot: int, spine_bytes: int, available: int) -> None:
    if spine_bytes + slots * per_slot <= available:
        return
    most = max(0, int((available - spine_bytes) // per_slot))
    advice = (f"use --slots-per-layer {most} (--cache-gb {most * per_slot / GB:.3f}) or less"
              if most else "free memory or use a machine with more")
    raise BudgetError(
        f"{asked} needs {(spine_bytes + slots * per_slot) / GB:.2f} GB with the "
        f"{spine_bytes / GB:.2f} GB spine, but only {available / GB:.2f} GB of memory is "
        f"available: {advice}"
    )
