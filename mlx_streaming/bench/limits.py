"""The machine a case runs on: memory and read-rate limits (cgroup v1), a
cold page cache, peak memory, and the disk's own bandwidth."""

import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from .inputs import BenchError

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


BLKIO_ROOT = Path("/sys/fs/cgroup/blkio")


def drop_page_cache() -> None:
    """Empty the page cache so the next reads come from the disk."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        raise BenchError(
            f"--cold needs to drop the page cache ({e.strerror}); run as root on Linux"
        ) from None


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


class MemoryLimit:
    """A cgroup v1 memory limit that emulates a machine with less memory."""

    def __init__(self, gb: float):
        if not CGROUP_ROOT.exists():
            raise BenchError("--memory-limit-gb needs cgroup v1's memory controller "
                             f"at {CGROUP_ROOT}")
        self.path = CGROUP_ROOT / f"mlx_streaming_bench_{os.getpid()}_{time.monotonic_ns()}"
        try:
            self.path.mkdir()
            self._write("memory.limit_in_bytes", int(gb * 1e9))
            if (self.path / "memory.memsw.limit_in_bytes").exists():
                self._write("memory.memsw.limit_in_bytes", int(gb * 1e9))
        except OSError as e:
            raise BenchError(f"cannot create a memory cgroup ({e.strerror}); run as root") from None
        self.gb = gb

    def _write(self, name: str, value) -> None:
        (self.path / name).write_text(f"{value}\n")

    def enter(self) -> None:
        """Move the calling process into the cgroup (called in the child)."""
        self._write("cgroup.procs", os.getpid())

    def max_usage(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def close(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def disk_of(path: Path) -> str:
    """``MAJ:MIN`` of the whole disk holding ``path`` (blkio throttles
    disks, not partitions)."""
    dev = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if (node / "partition").exists():
        return (node.resolve().parent / "dev").read_text().strip()
    if not node.exists():
        raise BenchError(f"{path} is not on a block device (tmpfs or overlay?): "
                         "--read-mbps cannot throttle it")
    return f"{os.major(dev)}:{os.minor(dev)}"


class ReadLimit:
    """A cgroup v1 blkio limit on read bandwidth: emulates a slower disk.
    It slows direct and buffered reads alike, but page-cache hits are not
    reads: measure cold, or with direct I/O."""

    def __init__(self, mbps: float, path: Path):
        if not BLKIO_ROOT.exists():
            raise BenchError(f"--read-mbps needs cgroup v1's blkio controller at {BLKIO_ROOT}")
        self.device = disk_of(path)
        self.path = BLKIO_ROOT / f"mlx_streaming_bench_{os.getpid()}_{time.monotonic_ns()}"
        try:
            self.path.mkdir()
            (self.path / "blkio.throttle.read_bps_device").write_text(
                f"{self.device} {int(mbps * 1e6)}\n")
        except OSError as e:
            raise BenchError(f"cannot create a blkio cgroup ({e.strerror}); run as root") from None
        self.mbps = mbps

    def enter(self) -> None:
        self._was = _blkio_cgroup()
        (self.path / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def close(self) -> None:
        """Remove the cgroup; a process that entered it itself (not a case's
        child, which has exited) goes back to its own first, else the
        cgroup would be busy."""
        try:
            if getattr(self, "_was", None) is not None:
                (self._was / "cgroup.procs").write_text(f"{os.getpid()}\n")
            self.path.rmdir()
        except OSError:
            pass


def _blkio_cgroup() -> Optional[Path]:
    """This process's blkio cgroup directory (cgroup v1), or None."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "blkio" in controllers.split(","):
                return BLKIO_ROOT / path.lstrip("/")
    except (OSError, ValueError):
        pass
    return None


def disk_read_gbps(path: Path, block: int, limit_bytes: int = 1 << 30,
                   read_mbps: Optional[float] = None) -> float:
    """Throughput of ``dd`` reading ``path`` with direct I/O, in GB/s
    (under a ``read_mbps`` throttle if given, for at most ~2 s of reads)."""
    size = min(Path(path).stat().st_size, limit_bytes)
    if read_mbps:
        size = min(size, int(2 * read_mbps * 1e6))
    count = max(1, size // block)
    throttle = ReadLimit(read_mbps, Path(path)) if read_mbps else None
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", f"bs={block}", f"count={count}", "iflag=direct"],
            capture_output=True, text=True, preexec_fn=throttle.enter if throttle else None,
        )
    finally:
        if throttle is not None:
            throttle.close()
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise BenchError(f"dd failed on {path}: {proc.stderr.strip()}")
    return count * block / seconds / 1e9
