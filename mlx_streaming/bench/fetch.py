"""bench fetch: decode from a Hub repo by HTTP range, against local disk

Serves a stream directory from a local range server (its own process) that
emulates a network link of ``--bandwidth-mbps`` with ``--latency-ms`` per
request, and decodes:

  (a) from the stream directory on local disk (the reference),
  (b) from the server, at each disk-cache size in ``--disk-cache`` (as a
      fraction of the expert records' bytes), the cache empty at the start,
  (c) from the server again with the cache (b) left at its largest size
      (a later run of the same model),

all at one pool size, each case in its own process, the rounds interleaved.
It reports decode tok/s and its ratio to (a), the expert bytes fetched per
decode token, the disk-cache hit rate and the stall share.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..flags import MAX_ROUNDS, MAX_TOKENS, count, listed, number, temperature
from ..format import read_manifest
from ..hub.repo import records_nbytes
from .inputs import BenchError, pool_slots
from .report import figure, finish
from .runs import median_run, run_case

REPO = "bench/model"
COLUMNS = [
    ("case", "case", "s"), ("disk_cache", "disk cache", ".0%"), ("status", "status", "s"),
    ("decode_tps", "tok/s", ".3g"), ("vs_local", "x local", ".2f"),
    ("hit_rate", "pool hit", ".0%"), ("mb_fetched_per_token", "MB fetched/tok", ".3f"),
    ("requests_per_token", "requests/tok", ".2f"), ("disk_hit_rate", "disk hit", ".0%"),
    ("stall_share", "stall", ".0%"), ("load_s", "load s", ".1f"),
]


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="stream directory to serve")
    p.add_argument("--pool", type=number(0, 1, open_low=True), default=0.25,
                   help="pool size as a fraction of each layer's experts")
    p.add_argument("--disk-cache", type=listed(number(0, 1)), default="0,0.25,1",
                   help="disk-cache sizes as fractions of the experts' bytes")
    p.add_argument("--bandwidth-mbps", type=number(0.01, 1e6), default=100.0,
                   help="the emulated link's MB/s (shared by parallel requests)")
    p.add_argument("--latency-ms", type=number(0, 60_000), default=20.0,
                   help="before each answer")
    p.add_argument("--max-tokens", type=count(1, MAX_TOKENS), default=64)
    p.add_argument("--prompt-tokens", type=count(1, MAX_TOKENS), default=32)
    p.add_argument("--temp", type=temperature, default=0.8,
                   help="sampling temperature (seeded; 0: greedy)")
    p.add_argument("--repeats", type=count(1, MAX_ROUNDS), default=1,
                   help="rounds of all cases, interleaved; each case reports its median")
    p.add_argument("--out", type=Path, default=Path("bench-results/fetch"))


class RangeServer:
    """``python -m mlx_streaming.testing.hubserver`` in its own process."""

    def __init__(self, stream_dir: Path, bandwidth_mbps: float, latency_ms: float):
        cmd = [sys.executable, "-m", "mlx_streaming.testing.hubserver", "--repo",
               f"{REPO}={stream_dir}", "--bandwidth-mbps", str(bandwidth_mbps),
               "--latency-ms", str(latency_ms)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http"):
            self.close()
            raise BenchError("the range server did not start")

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _row(name, r, fraction, local_tps):
    row = dict(case=name, disk_cache=fraction, status=r["status"], load_s=r.get("load_s"))
    if r["status"] != "ok":
        row["error"] = r.get("error")
        return row
    n = r["decode_tokens"]
    row["decode_tps"] = r["decode_tps"]
    row["vs_local"] = r["decode_tps"] / local_tps if local_tps else None
    t = r["stats"]["total"]
    row["hit_rate"] = t["hit_rate"]
    row["stall_share"] = t["stall_seconds"] / r["decode_s"]
    remote = r["stats"].get("remote")
    if remote is not None:
        row["mb_fetched_per_token"] = remote["bytes_fetched"] / n / 1e6
        row["requests_per_token"] = remote["requests"] / n
        looked = remote["disk_cache_hits"] + remote["disk_cache_misses"]
        row["disk_hit_rate"] = remote["disk_cache_hits"] / looked if looked else None
    else:
        row["mb_read_per_token"] = t["bytes_read"] / n / 1e6
    return row


def run(args) -> dict:
    stream_dir = Path(args.model).resolve()
    manifest = read_manifest(stream_dir)
    slots = pool_slots(manifest.layers[0], args.pool)
    records = records_nbytes(manifest)
    fractions = args.disk_cache
    common = dict(kind="streaming", op="decode", max_tokens=args.max_tokens,
                  prompt_tokens=args.prompt_tokens, temp=args.temp)
    server = RangeServer(stream_dir, args.bandwidth_mbps, args.latency_ms)
    scratch = Path(tempfile.mkdtemp(prefix="mlxs-fetch-"))
    try:
        remote = dict(endpoint=server.url, slots_per_layer=slots)
        cases = [("(a) local disk", None, dict(common, model=str(stream_dir),
                                               load=dict(slots_per_layer=slots)), False)]
        for f in fractions:
            cache_gb = f * records / 1e9
            cases.append((f"(b) Hub, cache {f:.0%}", f, dict(
                common, model=REPO, load=dict(remote, disk_cache_gb=cache_gb,
                                              disk_cache_dir=str(scratch / f"b{f}"))), True))
        top = max(fractions)
        cases.append((f"(c) Hub, cache {top:.0%} kept", top, dict(
            common, model=REPO, load=dict(remote, disk_cache_gb=top * records
                                          / 1e9, disk_cache_dir=str(scratch / "kept"))), False))
        # (c) measures a later run: its cache is filled by a run first.
        filled = run_case(cases[-1][2])
        if filled["status"] != "ok":
            raise BenchError(f"decoding from the range server failed: {filled.get('error')}")
        runs = [[] for _ in cases]
        for _ in range(args.repeats):
            for i, (_, _, case, fresh) in enumerate(cases):
                cache_dir = case["load"].get("disk_cache_dir")
                if fresh and cache_dir:
                    shutil.rmtree(cache_dir, ignore_errors=True)
                runs[i].append(run_case(case))
    finally:
        server.close()
        shutil.rmtree(scratch, ignore_errors=True)
    local = median_run(runs[0])
    local_tps = local.get("decode_tps") if local["status"] == "ok" else None
    rows = [_row(name, median_run(results), f, local_tps)
            for (name, f, _, _), results in zip(cases, runs)]
    for row, results in zip(rows, runs):
        row["runs_tps"] = [x.get("decode_tps") for x in results]
    title = (f"bench fetch: decode at a {slots}/{manifest.layers[0].num_experts} pool, "
             f"link {args.bandwidth_mbps:g} MB/s + {args.latency_ms:g} ms per request, "
             f"{args.repeats} round(s), median")
    result = dict(rows=rows, pool_slots=slots, bandwidth_mbps=args.bandwidth_mbps,
                  latency_ms=args.latency_ms, expert_gb=records / 1e9,
                  cases=[r for rs in runs for r in rs])
    return finish(args.out, "fetch", result, rows, COLUMNS, title, _plot)


def _plot(rows, path, title):
    plt = figure()
    ok = [r for r in rows if r.get("decode_tps")]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.barh([r["case"] for r in ok], [r["decode_tps"] for r in ok])
    ax.set_xlabel("decode tok/s")
    ax.set_title(title.splitlines()[0], fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
