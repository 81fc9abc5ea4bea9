"""mlx_streaming bench: measuring instruments. Each subcommand measures its
cases side by side in one run, prints a short table and writes JSON and a
PNG plot into --out.

    python -m mlx_streaming.bench decode  --model STREAM --mlx-model MLX [--memory-limit-gb G --cold]
    python -m mlx_streaming.bench cache   --model STREAM [--tokens N]
    python -m mlx_streaming.bench overhead --model STREAM
    python -m mlx_streaming.bench simulate --validate --model STREAM --mlx-model MLX
    python -m mlx_streaming.bench simulate --project --trace TRACE
    python -m mlx_streaming.bench speculative --model STREAM [--mlx-model MLX]
    python -m mlx_streaming.bench prefill --model STREAM [--mlx-model MLX]
    python -m mlx_streaming.bench io      [--model STREAM]
    python -m mlx_streaming.bench serve   --model STREAM --mlx-model MLX [--clients 1,4]
    python -m mlx_streaming.bench fetch   --model STREAM [--bandwidth-mbps 100 --latency-ms 20]
    python -m mlx_streaming.bench quality --model STREAM [--text FILE --pace-mbps 50]
"""

import argparse
import importlib

from ..cli import run_main
from ..flags import Parser
from .inputs import BenchError

SUBCOMMANDS = ("decode", "cache", "overhead", "simulate", "speculative", "prefill", "io", "serve",
               "fetch", "quality")


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(prog="mlx_streaming bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"mlx_streaming.bench.{name}")
        sp = sub.add_parser(name, help=module.__doc__.strip().splitlines()[0],
                            description=module.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sp)
        sp.set_defaults(module=module)
    return p


def main(argv=None) -> int:
    return run_main(lambda: _run(setup_arg_parser().parse_args(argv)))


def _run(args) -> int:
    """Run the subcommand; a run whose every case failed is an error."""
    result = args.module.run(args) or {}
    statuses = [r["status"] for r in result.get("rows", []) if "status" in r]
    if statuses and "ok" not in statuses:
        raise BenchError(f"every case failed ({', '.join(sorted(set(statuses)))}); "
                         "see the table above")
    return 0


if __name__ == "__main__":
    from ..cli import leave

    leave(main())
