"""What the operating system says this process may still take.
"""

import os
import subprocess
from pathlib import Path


def available_memory_bytes() -> int:
    """Memory this process could still take without being killed: the OS's
    own estimate (Linux MemAvailable, which counts reclaimable page cache;
    macOS free + purgeable, not inactive pages, which the OS only pages out
    under pressure), capped by what the memory cgroup has left (its
    reclaimable inactive file pages counted as available)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
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
            for line in stat.read_text().splitlines():
                name, value = line.split()
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
