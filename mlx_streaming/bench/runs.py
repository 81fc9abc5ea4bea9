"""Cases run in a fresh process each (``bench.case``), under the limits
asked, their outcome, and how interleaved runs are compared."""

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import numpy as np

from .limits import MemoryLimit, ReadLimit, drop_page_cache


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
