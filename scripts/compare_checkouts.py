"""Decode speed of two checkouts of mlx_streaming, in interleaved rounds.

    python scripts/compare_checkouts.py --old /path/to/old/checkout --model STREAM \
        --pools 0.25,1.0 --rounds 3 [--max-tokens 64]

Each round runs `bench decode` once with the old checkout first on
PYTHONPATH, then once with this one, so that a slow spell of a shared
machine hits both alike. The old checkout needs its native extension built
(or copied) beside its package. Prints, per pool, each round's tok/s and the
median of the rounds' new/old ratios; writes JSON into --out.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def run_bench(checkout: Path, args, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    cmd = [sys.executable, "-m", "mlx_streaming.bench", "decode", "--model", str(args.model),
           "--pools", args.pools, "--max-tokens", str(args.max_tokens), "--repeats", "1",
           "--out", str(out)]
    subprocess.run(cmd, env=env, check=True, cwd="/", stdout=subprocess.DEVNULL)
    rows = json.loads((out / "decode.json").read_text())["rows"]
    return {str(r["pool"]): r["decode_tps"] for r in rows if r.get("status") == "ok"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", type=Path, required=True, help="the other checkout")
    p.add_argument("--model", type=Path, required=True, help="stream directory")
    p.add_argument("--pools", default="0.25,1.0")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("bench-results/compare-checkouts"))
    args = p.parse_args()
    runs = {"old": [], "new": []}
    for r in range(args.rounds):
        for name, checkout in (("old", args.old), ("new", HERE)):
            runs[name].append(run_bench(checkout, args, args.out / f"{name}-{r}"))
            print(name, r, runs[name][-1], flush=True)
    ratios = {pool: statistics.median(n[pool] / o[pool] for o, n in zip(runs["old"], runs["new"]))
              for pool in runs["new"][0]}
    result = dict(runs=runs, median_new_over_old=ratios, model=str(args.model),
                  pools=args.pools, rounds=args.rounds, max_tokens=args.max_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.json").write_text(json.dumps(result, indent=1))
    print("median new/old tok/s per pool:", {k: round(v, 3) for k, v in ratios.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
