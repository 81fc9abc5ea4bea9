"""``bench simulate --validate``: this machine's profile measured, each case
projected and run with ``bench decode`` in the same run, and the error
of each projection.
"""

import argparse
from dataclasses import asdict
import numpy as np
from ...config import (DEFAULT_POLICY, DEFAULT_PREFETCH_DEPTH, DEFAULT_PREFETCH_PRECISION)
from ...format import read_manifest
from ..cache import decode_records
from ..case import WARMUP_TOKENS
from ..common import BenchError, figure, finish, paired_ratio, run_case
from .machines import Profile
from .model import project_case


# The partial pool bench overhead measures the host's per-record work on.
OVERHEAD_POOL = 0.25
IN_GRAPH, SYNCED = "calls in the graph", "a host sync per call"


def validate(args) -> dict:
    from .. import decode, overhead

    if not (args.model and args.mlx_model):
        raise BenchError("--validate needs --model and --mlx-model")
    manifest = read_manifest(args.model)
    spec = manifest.layers[0]
    # bench decode's own defaults, then what this validation sets.
    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    ns = parser.parse_args(["--model", str(args.model)])
    vars(ns).update(
        mlx_model=args.mlx_model, pools=args.pools, temp=args.temp,
        max_tokens=args.max_tokens, prefetch=args.prefetch,
        prefetch_precision=None if args.prefetch_precision is None else str(
            args.prefetch_precision), prefetch_depth=args.prefetch_depth,
        direct_io="on" if args.read_mbps or args.pace_mbps else "auto",
        policies=args.policies, read_mbps=args.read_mbps, pace_mbps=args.pace_mbps,
        repeats=args.repeats, out=args.out / "decode")
    measured = decode.run(ns)
    ov = overhead.run(argparse.Namespace(model=args.model, repeats=500, tokens=args.max_tokens,
                                         rounds=max(3, args.repeats), policy="lru",
                                         pool=OVERHEAD_POOL,
                                         prefetch_precision=args.prefetch_precision,
                                         out=args.out / "overhead"))
    warm = _read_cost(args.model, spec)
    seconds = {int(n): t for n, t in warm["seconds"].items()}
    batch = max(seconds)
    iso = seconds[batch] / batch  # one record read in isolation
    gbps, latency = warm["gbps"], warm["latency_s"]
    if args.read_mbps:
        # A token-bucket throttle lets short bursts through at the disk's own
        # speed, so single reads overstate it; over a token it holds the rate.
        gbps, latency = args.read_mbps / 1e3, 0.0
    elif args.pace_mbps:
        # The paced reader's device: its rate, one read after another.
        gbps, latency = min(gbps, args.pace_mbps / 1e3), 0.0
    d, layers = ov["decode"], ov["moe_layers"]
    partial = f"paged, pool {OVERHEAD_POOL:.0%}"

    def profile(path, calls_case, misses_case):
        return Profile(f"this machine, {path}", gbps, latency, 0.0,
                       _call_cost(d[calls_case], d["resident"], layers),
                       _host_per_miss(d[misses_case], iso))

    # A resident expert's compute, from the isolated expert call (top-k of them).
    hit_compute = ov["pieces"]["resident_call"] / 1e6 / spec.top_k

    # A paged call takes one of two paths here, each with its own costs:
    # inside the graph (the CPU backend's native step, no host sync), or a
    # host sync per call (prefetch's path, and every call's on a GPU).
    in_graph = profile(IN_GRAPH, "paged, all hits", partial)
    synced = profile(SYNCED, f"{partial}, prefetch", f"{partial}, prefetch")
    resident = measured["rows"][0]
    resident_tps = resident["decode_tps"]
    calls = decode_records(args.out / "decode" / "decode-trace.jsonl")
    rows = []
    for row in measured["rows"][2:]:
        load = row.get("load") or {}
        # The path the case ran, as its own counters say.
        path = SYNCED if (row.get("syncs_per_token") or 0) > 0 else IN_GRAPH
        here = synced if path == SYNCED else in_graph
        overlap = path == SYNCED and load.get("overlap", True)
        p = project_case(calls, row["pool"], load.get("policy") or DEFAULT_POLICY,
                         _depth(load), 1 / resident_tps, here.sync_s,
                         len(manifest.layers), spec.expert_nbytes, spec.top_k, here.ssd_gbps,
                         here.ssd_latency_s, skip=WARMUP_TOKENS, miss_s=here.miss_s,
                         hit_compute_s=hit_compute if overlap else 0.0,
                         precision=load.get("prefetch_precision", DEFAULT_PREFETCH_PRECISION),
                         width=load.get("prefetch_width") or 0)
        # Judged as ratios to mlx-lm resident, paired round by round: the
        # machine's speed drifts between rounds by more than the error allowed.
        measured_ratio = paired_ratio(row["runs_tps"], resident["runs_tps"])
        projected_ratio = p["tps"] / resident_tps
        rows.append(dict(case=row["case"], pool=row["pool"], path=path,
                         measured_tps=row.get("decode_tps"),
                         projected_tps=p["tps"], measured_ratio=measured_ratio,
                         projected_ratio=projected_ratio, projected_hit=p["hit_rate"],
                         measured_hit=row.get("hit_rate"),
                         measured_wasted=row.get("prefetch_wasted_share"),
                         projected_wasted=p["wasted"],
                         error=projected_ratio / measured_ratio - 1 if measured_ratio else None))
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    if not errors:
        raise BenchError("no streamed case of bench decode ran: nothing to validate")
    result = dict(rows=rows, profiles=[asdict(in_graph), asdict(synced)],
                  resident_tps=resident_tps, hit_compute_s=hit_compute,
                  max_abs_error=max(errors))
    title = (f"bench simulate --validate: projected vs measured decode on this machine "
             f"(max error {result['max_abs_error']:.0%})")
    cols = [("case", "case", "s"), ("pool", "pool", ".0%"), ("path", "paged calls", "s"),
            ("measured_tps", "measured", ".3g"),
            ("projected_tps", "projected", ".3g"),
            ("measured_ratio", "measured x resident (paired)", ".3f"),
            ("projected_ratio", "projected x resident", ".3f"), ("error", "error", "+.0%"),
            ("measured_hit", "hit", ".0%"), ("projected_hit", "proj. hit", ".0%"),
            ("measured_wasted", "read ahead wasted", ".0%"),
            ("projected_wasted", "proj. wasted", ".0%")]
    return finish(args.out, "simulate", result, rows, cols, title, _plot_validate)


def _depth(load: dict) -> int:
    """MoE layers ahead a case read (0: prefetch off). ``auto`` is replayed
    as on: its trial is not modelled."""
    if load.get("prefetch", "off") == "off":
        return 0
    return load.get("prefetch_depth") or DEFAULT_PREFETCH_DEPTH


def _call_cost(case: dict, resident: dict, layers: int) -> float:
    """Seconds a paged call adds to a token beyond its stall on reads: each
    round of ``case`` (``bench overhead``'s decode) against the resident
    model's same round, the median."""
    costs = [(1 / a - 1 / r - reads["stall_seconds"] / reads["tokens"]) / layers
             for a, r, reads in zip(case["runs_tps"], resident["runs_tps"], case["runs_reads"])]
    return max(0.0, float(np.median(costs)))


def _host_per_miss(case: dict, iso_s: float) -> float:
    """What a missed record costs beyond its disk read: the stall of
    ``case``'s rounds less its disk reads, each at ``iso_s`` (a read in
    isolation), per miss: the host's work (tables, copies, the checksum
    of an expert's first read), and what makes a read in decode slower
    than one in isolation (on 3.9 MB records, most of it). Misses served
    from prefetch's staging are not read from disk, but the wait for a
    read ahead still in flight is in the stall, so on prefetch's path this
    counts some disk time that ``project_case`` also charges: small where
    reads are fast."""
    reads = case["runs_reads"]
    misses = sum(r["misses"] for r in reads)
    stall = sum(r["stall_seconds"] - r["records_read"] * iso_s for r in reads)
    return max(0.0, stall / misses) if misses else 0.0


def _read_cost(model, spec) -> dict:
    """The reader's latency per call and rate from the page cache, read
    into a pool's slots."""
    rd = run_case(dict(op="reads", kind="streaming", model=model, batch=spec.top_k,
                       load=dict(slots_per_layer=spec.top_k, checksums="off", direct_io=False)))
    if rd["status"] != "ok":
        raise BenchError(f"measuring the reader failed: {rd.get('error', rd['status'])}")
    return rd


def _plot_validate(rows, path, title):
    plt = figure()
    fig, ax = plt.subplots(figsize=(6, 5))
    m = [r["measured_tps"] or 0 for r in rows]
    p = [r["projected_tps"] for r in rows]
    ax.scatter(m, p)
    hi = max(m + p) * 1.1
    ax.plot([0, hi], [0, hi], "k--", lw=1)
    ax.fill_between([0, hi], [0, hi * 0.85], [0, hi * 1.15], alpha=0.15, label="±15%")
    ax.set_xlabel("measured tok/s")
    ax.set_ylabel("projected tok/s")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
