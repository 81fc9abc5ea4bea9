"""``predict --here``: this machine's profile, measured once (in well under
30 s) and kept in the user's cache directory: its disk read with
expert-sized uncached reads at the reader's thread count, and the memory
bandwidth a 4-bit matrix-vector product reaches.
"""

import json
import mmap
import os
import platform
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from ..config import default_io_threads
from .machines import Machine
from .speed import BANDWIDTH_SHARE

RECORD = 4 << 20  # an expert record of a large model
FILE_BYTES = 256 << 20
READ_SECONDS = 4.0
COMPUTE_SECONDS = 3.0
MATRIX = (4096, 16384)  # 32 MB at 4 bits: larger than the caches


def cache_file() -> Path:
    base = (Path.home() / "Library" / "Caches" if sys.platform == "darwin"
            else Path.home() / ".cache")
    return base / "mlx_streaming" / "predict-here.json"


def measure_here(path: Optional[Path] = None) -> Machine:
    """This machine's profile, from the cache or measured now."""
    path = path or cache_file()
    try:
        return _machine(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    found = dict(memory_gb=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
                 measured_gbps=_memory_gbps(), **_disk(path.parent),
                 host=platform.node(), at=time.strftime("%Y-%m-%d %H:%M:%S"))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(found, indent=1))
    os.replace(tmp, path)
    return _machine(found)


def _machine(m: dict) -> Machine:
    # The speed model takes the fitted share of the peak; what was measured
    # is what decode reaches.
    return Machine(f"this machine ({m['host']})", m["memory_gb"],
                   m["measured_gbps"] / BANDWIDTH_SHARE, m["ssd_gbps"], {
                       "memory_gbps": f"measured {m['at']}: a 4-bit matrix-vector product read "
                                      f"{m['measured_gbps']:.1f} GB/s",
                       "ssd_gbps": f"measured {m['at']}: {m['disk_note']}"},
                   ssd_latency_s=0.0)


def _disk(where: Path) -> dict:
    """Random uncached reads of expert-sized records from a scratch file,
    at the reader's thread count."""
    scratch = where / "predict-here.scratch"
    threads = default_io_threads()
    try:
        with open(scratch, "wb") as f:
            block = os.urandom(1 << 20)
            for _ in range(FILE_BYTES >> 20):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        fd, uncached = _open_uncached(scratch)
        try:
            done = _read_for(fd, threads)
        finally:
            os.close(fd)
    finally:
        scratch.unlink(missing_ok=True)
    gbps = done / READ_SECONDS / 1e9
    how = "uncached" if uncached else "page cache not bypassed: an upper bound"
    return dict(ssd_gbps=gbps, disk_note=f"{RECORD >> 20} MB random reads, {threads} threads, "
                                          f"{how}: {gbps:.2f} GB/s")


def _open_uncached(path: Path):
    if sys.platform == "darwin":
        import fcntl

        fd = os.open(path, os.O_RDONLY)
        fcntl.fcntl(fd, 48, 1)  # F_NOCACHE
        return fd, True
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except (OSError, AttributeError):  # tmpfs and others refuse O_DIRECT
        return os.open(path, os.O_RDONLY), False


def _read_for(fd: int, threads: int) -> int:
    """Bytes read by ``threads`` threads in ``READ_SECONDS``."""
    records = FILE_BYTES // RECORD
    end = time.perf_counter() + READ_SECONDS

    def worker(seed: int) -> int:
        buf, rng, n = mmap.mmap(-1, RECORD), random.Random(seed), 0
        while time.perf_counter() < end:
            n += os.preadv(fd, [buf], rng.randrange(records) * RECORD)
        buf.close()
        return n

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(worker, range(threads)))


def _memory_gbps() -> float:
    """GB/s a 4-bit matrix-vector product reads: the best run within
    ``COMPUTE_SECONDS`` (float32 activations, which every backend runs fast)."""
    import mlx.core as mx

    rows, cols = MATRIX
    w = mx.zeros((rows, cols // 8), dtype=mx.uint32)
    scales = mx.ones((rows, cols // 64), dtype=mx.float32)
    biases = mx.zeros((rows, cols // 64), dtype=mx.float32)
    x = mx.ones((1, cols), dtype=mx.float32)
    nbytes = w.nbytes + scales.nbytes + biases.nbytes
    mx.eval(w, scales, biases, x)
    best, end = float("inf"), time.perf_counter() + COMPUTE_SECONDS
    while time.perf_counter() < end or best == float("inf"):
        start = time.perf_counter()
        mx.eval(mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=64,
                                    bits=4))
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9
