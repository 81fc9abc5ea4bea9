"""bench decode --ranks N: tensor-parallel ranks on this box against one.

Three cases, interleaved over --repeats rounds:

  1 rank, B        the plain conversion, --cache-gb B
  1 rank, N x B    the plain conversion, N times the budget
  N ranks, B each  the --tp-model conversion, tensor parallel over N local
                   ranks (ring backend on 127.0.0.1), each with budget B,
                   in a memory cgroup of its own and, with --read-mbps, a
                   blkio throttle of its own: N emulated disks
  ... SETTING      the N ranks again with each --settings entry
                   (approximate routing, low-bit miss reads), every rank alike

Reported: decode tok/s (rank 0's; every rank decodes each token), the hit
rate, and the bytes each rank reads per token.
"""

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from ..config import config_options
from ..format import read_manifest
from .inputs import BenchError
from .limits import MemoryLimit, ReadLimit, drop_page_cache
from .report import figure, finish
from .runs import case_outcome, median_run, paired_ratio, run_case

COLUMNS = [
    ("case", "case", "s"), ("status", "status", "s"), ("decode_tps", "tok/s", ".3g"),
    ("vs_one", "x 1 rank B", ".2f"), ("vs_one_paired", "x paired", ".2f"),
    ("hit_rate", "hit", ".1%"), ("mb_per_token_rank", "MB/tok per rank", ".3f"),
    ("slots", "slots/layer", "d"),
]


def check(args) -> None:
    if args.settings and args.ranks == 1:
        raise BenchError("--settings runs the ranks of --ranks N with approximate settings; "
                         "on one machine, bench quality compares them")
    if args.tp_model is None or args.cache_gb is None:
        raise BenchError("--ranks needs --tp-model (the model converted with --tensor-parallel "
                         "N) and --cache-gb (each rank's budget)")
    ranks = read_manifest(args.tp_model).tensor_parallel
    if ranks != args.ranks:
        raise BenchError(f"{args.tp_model} is converted for {ranks} tensor-parallel ranks, "
                         f"not --ranks {args.ranks}")


def run(args) -> dict:
    check(args)
    common = dict(op="decode", max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens,
                  temp=args.temp)
    load = dict(config_options(args, ["io", "direct_io"]), prefetch="off")
    if args.read_pace_mbps:
        load["read_pace_mbps"] = args.read_pace_mbps
    n, budget = args.ranks, args.cache_gb
    cases = [
        (f"1 rank, {budget:g} GB", 1,
         dict(common, kind="streaming", model=str(args.model), load=dict(load, cache_gb=budget))),
        (f"1 rank, {n} x {budget:g} GB", 1,
         dict(common, kind="streaming", model=str(args.model),
              load=dict(load, cache_gb=n * budget))),
        (f"{n} ranks tensor parallel, {budget:g} GB each", n,
         dict(common, kind="sharded", model=str(args.tp_model), load=dict(load, cache_gb=budget))),
    ]
    for name, options in _settings(args):
        cases.append((f"{n} ranks tensor parallel, {budget:g} GB each, {name}", n,
                      dict(common, kind="sharded", model=str(args.tp_model),
                           load=dict(load, cache_gb=budget, **options))))
    runs = [[] for _ in cases]
    for _ in range(args.repeats):
        for i, (_, ranks, case) in enumerate(cases):
            if ranks == 1:
                runs[i].append(run_case(case, args.memory_limit_gb, args.cold,
                                        read_mbps=args.read_mbps))
            else:
                runs[i].append(run_ranks(case, ranks, args.memory_limit_gb, args.cold,
                                         args.read_mbps))
    rows = [_row(name, results) for (name, _, _), results in zip(cases, runs)]
    for row in rows:
        if rows[0].get("decode_tps") and row.get("decode_tps"):
            row["vs_one"] = row["decode_tps"] / rows[0]["decode_tps"]
            row["vs_one_paired"] = paired_ratio(row["runs_tps"], rows[0]["runs_tps"])
    manifest = read_manifest(args.model)
    result = dict(rows=rows, ranks=n, cache_gb=budget, read_mbps=args.read_mbps,
                  pace_mbps=args.read_pace_mbps, memory_limit_gb=args.memory_limit_gb,
                  cold=args.cold, model_expert_gb=manifest.expert_nbytes / 1e9,
                  cases={name: results for (name, _, _), results in zip(cases, runs)})
    disk = (f", reads throttled to {args.read_mbps:g} MB/s per rank" if args.read_mbps else
            f", reads paced at {args.read_pace_mbps:g} MB/s per rank" if args.read_pace_mbps else "")
    title = (f"bench decode --ranks {n}: experts {manifest.expert_nbytes / 1e9:.4f} GB, "
             f"budget {budget:g} GB per rank{disk}")
    return finish(args.out, "decode-ranks", result, rows, COLUMNS, title, _plot)


def _settings(args) -> List[tuple]:
    """``(name, load() options)`` of each --settings entry (none without it)."""
    from .quality import setting_options

    if not args.settings:
        return []
    spec = read_manifest(args.tp_model).layers[0]
    names = [n.strip() for n in args.settings.split(",")]
    return [(name, setting_options(name, spec.top_k, spec.num_experts)) for name in names
            if name != "exact"]


def _plot(rows, path, title):
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 3))
    ok = [r for r in rows if r.get("decode_tps")]
    ax.barh(range(len(ok)), [r["decode_tps"] for r in ok])
    ax.set_yticks(range(len(ok)), [r["case"] for r in ok], fontsize=8)
    ax.set_xlabel("decode tok/s (this machine)")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _row(name: str, results: List[dict]) -> dict:
    r = median_run(results)
    row = dict(case=name, status=r.get("status"), runs_tps=[x.get("decode_tps") for x in results])
    if r.get("status") != "ok":
        row["error"] = r.get("error")
        return row
    total = r["stats"]["total"]
    row.update(decode_tps=r["decode_tps"], hit_rate=total["hit_rate"],
               slots=r["stats"]["slots_per_layer"],
               mb_per_token_rank=total["bytes_read"] / 1e6 / max(1, r["decode_tokens"]))
    return row


def free_ports(n: int) -> List[int]:
    """``n`` TCP ports on 127.0.0.1 free a moment ago, below the ephemeral
    range (where the system hands out the ports of outgoing connections)."""
    ports: List[int] = []
    while len(ports) < n:
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def run_ranks(case: dict, n: int, memory_limit_gb: Optional[float], cold: bool,
              read_mbps: Optional[float], timeout: float = 3600) -> dict:
    """Run ``case`` on ``n`` local ranks (ring backend), each in cgroups of
    its own; rank 0's result, its status the worst rank's."""
    if cold:
        drop_page_cache()
    with tempfile.TemporaryDirectory(prefix="mlx-streaming-ranks-") as tmp:
        hosts = Path(tmp) / "hosts.json"
        hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
        procs, cgroups, limits = [], [], []
        start = time.perf_counter()
        try:
            for rank in range(n):
                limit = MemoryLimit(memory_limit_gb) if memory_limit_gb else None
                limits.append(limit)
                mine = [c for c in (limit, ReadLimit(read_mbps, Path(case["model"]))
                                    if read_mbps else None) if c is not None]
                cgroups += mine
                env = dict(os.environ, MLX_HOSTFILE=str(hosts), MLX_RANK=str(rank))
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "mlx_streaming.bench.case", json.dumps(case)],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    preexec_fn=(lambda cs=mine: [c.enter() for c in cs]) if mine else None))
            outputs = [p.communicate(timeout=timeout) for p in procs]
            ooms = [limit is not None and limit.oom_kills() > 0 for limit in limits]
        except subprocess.TimeoutExpired:
            return dict(case, status="timeout")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
            for c in cgroups:
                c.close()
    results = [case_outcome(p.returncode, out, err, oom)
               for p, (out, err), oom in zip(procs, outputs, ooms)]
    failed = [r for r in results if r["status"] != "ok"]
    first = dict(case, **results[0], wall_s=time.perf_counter() - start)
    if failed:
        first.update(status=failed[0]["status"], error=failed[0].get("error"))
    first["ranks"] = results
    print(f"bench: decode sharded on {n} ranks: {first['status']}", file=sys.stderr, flush=True)
    return first
