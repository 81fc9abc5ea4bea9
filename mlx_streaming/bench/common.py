"""What the benchmarks share: results on disk, tables, plots, cases run in a
subprocess under a memory limit with a cold page cache, the disk's own
bandwidth, and the routing statistics every number is reported with."""

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..config import ON_OFF
from ..errors import StreamingError
from ..runtime.trace import read_trace

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
BLKIO_ROOT = Path("/sys/fs/cgroup/blkio")


class BenchError(StreamingError):
    """A benchmark cannot run as asked (permissions, platform, input)."""


def on_off(flag: str, text) -> list:
    """An on/off flag's values to compare (``[None]``: load()'s default)."""
    values = text.split(",") if text else [None]
    bad = [v for v in values if v is not None and v not in ON_OFF]
    if bad:
        raise BenchError(f"{flag} takes on, off or on,off, got {bad[0]!r}")
    return values


def save_json(path: Path, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=_jsonable))
    return path


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"cannot write {type(x).__name__} as JSON")


def fmt(value, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return format(value, spec)


def print_table(rows: List[dict], columns: Sequence[tuple], title: str = "") -> str:
    """Print ``rows`` with ``columns`` = (key, header[, format spec])."""
    cells = [[h for _, h, *_ in columns]]
    for r in rows:
        cells.append([fmt(r.get(c[0]), *(c[2:] or [".3g"])) for c in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    text = (title + "\n" if title else "") + "\n".join(lines)
    print(text, flush=True)
    return text


def finish(out: Path, name: str, result: dict, rows, columns, title: str, plot) -> dict:
    """Print the table, write ``name``.json and ``name``.png into ``out``."""
    result["table"] = print_table(rows, columns, title)
    save_json(Path(out) / f"{name}.json", result)
    plot(rows, Path(out) / f"{name}.png", title)
    return result


def figure():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("plots need matplotlib: pip install 'mlx_streaming[bench]'") from None
    return plt


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


def run_case(case: dict, memory_limit_gb: Optional[float] = None, cold: bool = False,
             timeout: float = 3600, read_mbps: Optional[float] = None) -> dict:
    """Run one measurement (``mlx_streaming.bench.case``) in a fresh process,
    optionally in a memory cgroup, with its disk reads throttled to
    ``read_mbps`` MB/s, and after dropping the page cache."""
    start = time.perf_counter()
    result = _run_case(case, memory_limit_gb, cold, timeout, read_mbps)
    _progress(case, result, time.perf_counter() - start)
    return result


def _run_case(case, memory_limit_gb, cold, timeout, read_mbps) -> dict:
    if cold:
        drop_page_cache()
    limit = MemoryLimit(memory_limit_gb) if memory_limit_gb else None
    throttle = ReadLimit(read_mbps, Path(case["model"])) if read_mbps else None
    cgroups = [c for c in (limit, throttle) if c is not None]

    def enter():
        for c in cgroups:
            c.enter()

    cmd = [sys.executable, "-m", "mlx_streaming.bench.case", json.dumps(case)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=enter if cgroups else None)
    except subprocess.TimeoutExpired:
        if limit is not None:
            limit.close()
        return dict(case, status="timeout")
    finally:
        if throttle is not None:
            throttle.close()
    result = dict(case, wall_s=time.perf_counter() - start, returncode=proc.returncode)
    if limit is not None:
        result["cgroup_max_usage_bytes"] = limit.max_usage()
        oom = limit.oom_kills() > 0
        limit.close()
    else:
        oom = False
    result.update(case_outcome(proc.returncode, proc.stdout, proc.stderr, oom))
    return result


def case_outcome(returncode: int, stdout: str, stderr: str, oom: bool = False) -> dict:
    """What a case's process printed (its last JSON line) with ``status``
    ok, or ``status`` oom or error (with the last line it wrote to stderr)."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if returncode == 0 and lines:
        return dict(json.loads(lines[-1]), status="ok")
    if oom or returncode in (-9, 137):
        return dict(status="oom")
    return dict(status="error", error=(stderr.strip().splitlines() or ["?"])[-1])


def _progress(case: dict, result: dict, seconds: float) -> None:
    """One line per finished case on stderr: a bench of many rounds runs
    for many minutes, and its table comes only at the end."""
    what = " ".join([case.get("op", "?"), case.get("kind", ""),
                     *(f"{k}={v}" for k, v in case.get("load", {}).items())])
    status = result["status"] + (f" ({result['error']})" if "error" in result else "")
    print(f"bench: {what}: {status} in {seconds:.0f} s", file=sys.stderr, flush=True)


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


def pool_slots(spec, fraction: float) -> int:
    """Slots per layer for a pool of ``fraction`` of a layer's experts (at
    least one call's top-k)."""
    return max(spec.top_k, round(fraction * spec.num_experts))


def paired_ratio(runs: List[Optional[float]], baseline: List[Optional[float]]) -> Optional[float]:
    """The median over rounds of each round's value over the baseline's in
    the same round: interleaved rounds share the machine's slow and fast
    spells, which this cancels (a ratio of medians does not)."""
    pairs = [a / b for a, b in zip(runs, baseline) if a and b]
    return float(np.median(pairs)) if pairs else None


def median_run(results: List[dict]) -> dict:
    """The run of median decode speed among those that succeeded, else the
    first (failed) one."""
    ok = sorted((r for r in results if r["status"] == "ok"), key=lambda r: r["decode_tps"])
    return ok[len(ok) // 2] if ok else results[0]


def decode_calls(trace_path: Path) -> Dict[int, List[np.ndarray]]:
    """Each layer's decode calls (one token) in a routing trace: the sorted
    distinct experts of each."""
    calls: Dict[int, List[np.ndarray]] = {}
    for layer, ids in read_trace(str(trace_path)):
        if ids.shape[0] == 1:
            calls.setdefault(layer, []).append(np.unique(ids[0]))
    return calls


def routing_stats(trace_path: Path, top: int = 8) -> dict:
    """Temporal reuse and traffic concentration of decode calls in a trace.

    temporal_reuse: share of a token's experts the previous token also used.
    top8_share: share of routing traffic that goes to a layer's ``top`` most
    used experts.
    """
    layers = {}
    for layer, seq in decode_calls(trace_path).items():
        reuse = [len(np.intersect1d(a, b)) / len(b) for a, b in zip(seq, seq[1:])]
        counts = np.bincount(np.concatenate(seq))
        share = np.sort(counts)[::-1][:top].sum() / counts.sum()
        layers[layer] = {"temporal_reuse": float(np.mean(reuse)) if reuse else None,
                         "top8_share": float(share), "decode_calls": len(seq)}
    values = [v for v in layers.values() if v["temporal_reuse"] is not None]
    return {
        "temporal_reuse": float(np.mean([v["temporal_reuse"] for v in values])) if values else None,
        "top8_share": float(np.mean([v["top8_share"] for v in values])) if values else None,
        "layers": layers,
    }


def prompt_tokens(tokenizer, n: int, seed: int = 0) -> List[int]:
    """``n`` tokens of real text (the Python standard library) as a prompt."""
    from ..testing.tiny import corpus_text

    text = corpus_text(max(4 * n, 20_000) * 4)
    ids = tokenizer.encode(text)
    start = (seed * 997) % max(1, len(ids) - n)
    if len(ids) < n:
        raise BenchError(f"not enough local text for a {n}-token prompt")
    return ids[start : start + n]
