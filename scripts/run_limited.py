"""Run a command inside a cgroup v1 memory limit and report its peak.

    python scripts/run_limited.py --memory-limit-gb 1.5 -- \
        python -m mlx_streaming.convert --model SRC --out DST

Emulates a machine with less memory than the model (Linux, root). Prints the
command's exit status, wall time, its peak resident set and the cgroup's
peak usage (which counts page cache too) as JSON on the last line.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_streaming.bench.limits import MemoryLimit  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory-limit-gb", type=float, required=True)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    limit = MemoryLimit(args.memory_limit_gb)
    start = time.perf_counter()
    proc = subprocess.run(command, preexec_fn=limit.enter)
    # The cgroup's peak counts page cache, which the kernel reclaims at the
    # limit; the command's own peak is its resident set.
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    result = dict(returncode=proc.returncode, seconds=round(time.perf_counter() - start, 1),
                  memory_limit_gb=args.memory_limit_gb,
                  cgroup_peak_gb=round(limit.max_usage() / 1e9, 3),
                  peak_rss_gb=round(rss / 1e9, 3),
                  oom_kills=limit.oom_kills())
    limit.close()
    print(json.dumps(result))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
