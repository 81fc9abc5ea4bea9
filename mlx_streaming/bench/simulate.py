"""bench simulate: project decode tok/s from a routing trace and a
hardware profile, and check the projection against this machine.

The model of one decode token (one token per MoE call):

    compute                 the token's work with every expert resident: the
                            bytes of weights it touches over the bandwidth the
                            compute reaches (or, on this machine, measured)
    + moe_layers x sync     one paged MoE call's cost: its host sync and
                            bookkeeping, or on this machine's CPU backend
                            without prefetch, the call inside the graph
                            (``bench overhead`` measures both paths)
    + reads                 per call with m missed experts: latency + m x
                            (expert bytes / SSD bandwidth + the host's work
                            per missed record), after the sync; on the synced
                            path (``overlap``) less the compute of the call's
                            resident experts, which runs meanwhile

With prefetch, the previous layer's prediction (recorded in the trace) is
read while that layer computes: the part of its read time that fits in one
layer's compute is hidden, the rest and the misses it did not predict stall.
Misses come from replaying the trace through the eviction policy at the
pool size.

Two modes:

  --validate   this machine: measure its profile (resident decode, a
               paged call's cost on each path, throttled disk rate), project
               each pool x policy x prefetch case of a model with the path it
               ran, run those cases with ``bench decode`` in the same run and
               report the error of each projection.
  --project    Apple Silicon profiles (published figures, sources in
               PROFILES) x large MoE models at 4 bits: projected tok/s at the
               largest pool each machine's memory allows. Hit rates come from
               the given trace at the same pool fraction: a proxy, since no
               trace of those models was recorded here.
"""

import argparse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List

import numpy as np

from ..block import OVERLAP_MIN_READ_S
from ..config import DEFAULT_POLICY
from ..format import read_manifest
from ..policy import make_policy
from .cache import Call, decode_records, replay_misses
from .case import WARMUP_TOKENS
from .common import BenchError, figure, finish, paired_ratio, run_case


@dataclass(frozen=True)
class Profile:
    """What the projection needs of a machine."""

    name: str
    ssd_gbps: float  # sustained random reads of expert-sized records
    ssd_latency_s: float  # added once per call that reads
    weight_gbps: float  # bandwidth the compute reaches on weights (decode)
    sync_s: float  # one host sync of a paged MoE call, with its bookkeeping
    miss_s: float = 0.0  # host work per missed record beyond the read (tables, checks)
    memory_gb: float = 0.0
    sources: Dict[str, str] = field(default_factory=dict)


# Published figures. Memory bandwidth: Apple's product pages; MLX decode on
# these machines reaches roughly 60-70% of it on 4-bit weights (an
# assumption we apply as weight_gbps = 0.65 x peak). SSD: sequential read
# speeds reported by reviews of each machine (Blackmagic/AmorphousDiskMark,
# ~4-7 GB/s); we take 4 MiB+ random reads at that rate. Sync: the cost of one
# command buffer commit-and-wait plus our bookkeeping, ~100 us, an estimate
# (this machine's CPU backend measures ~50-80 us; Metal adds the GPU round
# trip).
_APPLE_SOURCES = {
    "weight_gbps": "0.65 x Apple's published unified memory bandwidth (apple.com tech specs)",
    "ssd_gbps": "reviewers' disk-speed tests of the internal SSD (1-2 TB configurations)",
    "ssd_latency_s": "NVMe queue + first byte, ~100 us (assumption)",
    "sync_s": "Metal commit + wait + bookkeeping, ~100 us (assumption)",
    "miss_s": "host work per missed record with the native step, 10 us (assumption; "
              "this 2-core x86 VM measured 2.1-6.5 us on 16 KiB records in bench simulate "
              "--validate; an expert's first-read checksum is paid once, not per miss)",
}
PROFILES = {
    "m4-pro-48gb": Profile("MacBook Pro M4 Pro 48 GB", 5.0, 1e-4, 0.65 * 273, 1e-4, 1e-5, 48,
                           _APPLE_SOURCES),
    "m4-max-128gb": Profile("MacBook Pro M4 Max 128 GB", 6.0, 1e-4, 0.65 * 546, 1e-4, 1e-5, 128,
                            _APPLE_SOURCES),
    "m3-ultra-256gb": Profile("Mac Studio M3 Ultra 256 GB", 6.5, 1e-4, 0.65 * 819, 1e-4, 1e-5, 256,
                              _APPLE_SOURCES),
    "m2-air-24gb": Profile("MacBook Air M2 24 GB", 3.0, 1e-4, 0.65 * 100, 1e-4, 1e-5, 24,
                           _APPLE_SOURCES),
}


@dataclass(frozen=True)
class ModelShape:
    """A MoE model's sizes at 4 bits (group 64: ~4.5 bits per weight)."""

    name: str
    moe_layers: int
    experts: int
    top_k: int
    expert_params: float
    dense_active_params: float  # per token: attention, shared experts, dense layers, head
    total_params: float

    def expert_bytes(self) -> float:
        return self.expert_params * 4.5 / 8

    def spine_bytes(self) -> float:
        return (self.total_params - self.moe_layers * self.experts * self.expert_params) * 4.5 / 8


# From each model's config.json on the Hub (layers, experts, top-k, widths).
SHAPES = {
    "qwen3-30b-a3b": ModelShape("Qwen3-30B-A3B", 48, 128, 8, 3 * 2048 * 768, 1.6e9, 30.5e9),
    "qwen3-235b-a22b": ModelShape("Qwen3-235B-A22B", 94, 128, 8, 3 * 4096 * 1536, 7.8e9,
                                  235e9),
    "deepseek-v3": ModelShape("DeepSeek-V3 (671B)", 58, 256, 8, 3 * 7168 * 2048, 16.5e9, 671e9),
}


def project_case(calls: Dict[int, List[Call]], fraction: float, policy: str, prefetch: bool,
                 compute_s: float, sync_s: float, moe_layers: int, expert_bytes: float,
                 top_k: int, ssd_gbps: float, ssd_latency_s: float, skip: int = 0,
                 miss_s: float = 0.0, hit_compute_s: float = 0.0) -> dict:
    """Projected seconds per token and its parts, replaying each traced
    layer at ``fraction`` of its experts; the traced layers stand for all
    ``moe_layers`` (their mean per call). The first ``skip`` calls warm the
    pool and are not counted (as decode's warm-up tokens are not).
    ``hit_compute_s``: the compute of one resident expert, which hides as
    much of its call's demand reads (``Paged``'s overlap; 0 for none)."""
    per_call_read, per_call_stall, hits, lookups = [], [], 0, 0
    layer_compute = compute_s / moe_layers
    # The records the disk reads in one layer's compute: prefetch's budget.
    budget = layer_compute * ssd_gbps * 1e9 // expert_bytes
    for seq in calls.values():
        experts = 1 + max(int(c.experts.max()) for c in seq)
        slots = max(len(seq[0].experts), round(fraction * experts))
        misses = replay_misses(seq, slots, make_policy(policy, experts))
        scale = top_k / seq[0].ids.shape[-1]  # the model's k against the trace's
        for call, missed in list(zip(seq, misses))[skip:]:
            hits += call.ids.size - len(missed)
            lookups += call.ids.size
            m = len(missed) * scale
            read = (m > 0) * ssd_latency_s + m * (expert_bytes / ssd_gbps / 1e9 + miss_s)
            per_call_read.append(read)
            # Paged overlaps only calls whose reads take OVERLAP_MIN_READ_S or more.
            hidden = ((call.ids.size - len(missed)) * scale * hit_compute_s
                      if read >= OVERLAP_MIN_READ_S else 0.0)
            if prefetch and call.predicted is not None:
                caught = len(set(missed.tolist()) & set(call.predicted.tolist())) * scale
                staged = len(call.predicted) * scale * (len(missed) / max(1, len(call.experts)))
                if staged > budget:
                    # Prefetch reads no more than its budget (PrefetchBudget);
                    # what it reads catches misses in proportion.
                    caught *= budget / staged
                    staged = budget
                t_pf = (staged > 0) * ssd_latency_s + staged * expert_bytes / ssd_gbps / 1e9
                rest = m - caught
                t_demand = (rest > 0) * ssd_latency_s + rest * expert_bytes / ssd_gbps / 1e9 \
                    + m * miss_s
                per_call_stall.append(max(0.0, t_pf - layer_compute)
                                      + max(0.0, t_demand - hidden))
            else:
                per_call_stall.append(max(0.0, read - hidden))
    reads = float(np.mean(per_call_stall)) * moe_layers
    seconds = compute_s + moe_layers * sync_s + reads
    return dict(seconds=seconds, tps=1 / seconds, stall_s=reads, hit_rate=hits / lookups,
                read_s=float(np.mean(per_call_read)) * moe_layers)


def add_arguments(p) -> None:
    p.add_argument("--validate", action="store_true",
                   help="measure this machine and check projections against bench decode")
    p.add_argument("--project", action="store_true",
                   help="project Apple Silicon machines x large MoE models (needs --trace "
                        "or --model for hit rates)")
    p.add_argument("--model", help="stream directory (validate: the model run)")
    p.add_argument("--mlx-model", help="the same model as an mlx-lm directory (validate)")
    p.add_argument("--trace", type=Path, help="routing trace for --project hit rates")
    p.add_argument("--pools", default="0.25,0.5")
    p.add_argument("--policies", default=DEFAULT_POLICY)
    p.add_argument("--prefetch", default="off", help="off, next-layer, or both comma-separated")
    p.add_argument("--prefetch-precision", type=float, default=None,
                   help="validate: the decode and overhead cases' prefetch_precision (default: "
                        "load()'s)")
    p.add_argument("--read-mbps", type=float, default=None,
                   help="validate with reads throttled (cgroup blkio), as bench decode")
    p.add_argument("--pace-mbps", type=float, default=None,
                   help="validate with the reader emulating a disk of this rate "
                        "(read_pace_mbps), as bench decode")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench-results/simulate"))


def run(args) -> dict:
    if args.validate == args.project:
        raise BenchError("bench simulate needs exactly one of --validate or --project")
    args.out.mkdir(parents=True, exist_ok=True)
    return validate(args) if args.validate else project(args)


# The partial pool bench overhead measures the host's per-record work on.
OVERHEAD_POOL = 0.25
# The two paths of a paged call on this machine.
IN_GRAPH, SYNCED = "calls in the graph", "a host sync per call"


def validate(args) -> dict:
    from . import decode, overhead

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
            args.prefetch_precision),
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
                         load.get("prefetch", "off") != "off", 1 / resident_tps, here.sync_s,
                         len(manifest.layers), spec.expert_nbytes, spec.top_k, here.ssd_gbps,
                         here.ssd_latency_s, skip=WARMUP_TOKENS, miss_s=here.miss_s,
                         hit_compute_s=hit_compute if overlap else 0.0)
        # Judged as ratios to mlx-lm resident, paired round by round: the
        # machine's speed drifts between rounds by more than the error allowed.
        measured_ratio = paired_ratio(row["runs_tps"], resident["runs_tps"])
        projected_ratio = p["tps"] / resident_tps
        rows.append(dict(case=row["case"], pool=row["pool"], path=path,
                         measured_tps=row.get("decode_tps"),
                         projected_tps=p["tps"], measured_ratio=measured_ratio,
                         projected_ratio=projected_ratio, projected_hit=p["hit_rate"],
                         measured_hit=row.get("hit_rate"),
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
            ("measured_hit", "hit", ".0%"), ("projected_hit", "proj. hit", ".0%")]
    return finish(args.out, "simulate", result, rows, cols, title, _plot_validate)


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
                       load=dict(slots_per_layer=spec.top_k, verify="off", direct_io=False)))
    if rd["status"] != "ok":
        raise BenchError(f"measuring the reader failed: {rd.get('error', rd['status'])}")
    return rd


def project(args) -> dict:
    trace = args.trace or (Path(args.model) / "routing-trace.jsonl" if args.model else None)
    if trace is None:
        raise BenchError("--project needs --trace (a routing trace of a learned-routing model)")
    if not Path(trace).exists():
        raise BenchError(f"no routing trace at {trace}: bench cache --model STREAM records one "
                         "(routing-trace-w*.jsonl in its --out)")
    calls = decode_records(trace)
    rows = []
    for key, prof in PROFILES.items():
        for shape in SHAPES.values():
            spine = shape.spine_bytes()
            # Leave 25% of memory to the OS and apps; the rest holds the
            # spine and the pools.
            room = prof.memory_gb * 0.75e9 - spine
            slots = room / shape.expert_bytes() / shape.moe_layers
            fraction = min(1.0, slots / shape.experts)
            row = dict(machine=prof.name, model=shape.name, spine_gb=spine / 1e9,
                       experts_gb=shape.moe_layers * shape.experts * shape.expert_bytes() / 1e9)
            if fraction < shape.top_k / shape.experts:
                row.update(pool=max(0.0, fraction), note="pool below one token's experts")
                rows.append(row)
                continue
            active = shape.dense_active_params * 4.5 / 8 + \
                shape.moe_layers * shape.top_k * shape.expert_bytes()
            compute = active / (prof.weight_gbps * 1e9)
            # Every call syncs on a GPU; its resident experts compute while
            # its misses are read (Paged's overlap).
            hit_compute = shape.expert_bytes() / (prof.weight_gbps * 1e9)
            for policy in args.policies.split(","):
                if fraction >= 1:  # every expert resident: mlx-lm's own decode
                    rows.append(dict(row, policy=policy, pool=1.0, hit_rate=1.0,
                                     projected_tps=1 / compute, read_share=0.0))
                    continue
                p = project_case(calls, fraction, policy, False, compute, prof.sync_s,
                                 shape.moe_layers, shape.expert_bytes(), shape.top_k,
                                 prof.ssd_gbps, prof.ssd_latency_s, skip=WARMUP_TOKENS,
                                 miss_s=prof.miss_s, hit_compute_s=hit_compute)
                rows.append(dict(row, policy=policy, pool=fraction, hit_rate=p["hit_rate"],
                                 projected_tps=p["tps"], read_share=p["stall_s"] / p["seconds"]))
    result = dict(rows=rows, profiles={k: asdict(v) for k, v in PROFILES.items()},
                  shapes={k: asdict(v) for k, v in SHAPES.items()}, trace=str(trace))
    cols = [("machine", "machine", "s"), ("model", "model", "s"), ("policy", "policy", "s"),
            ("spine_gb", "spine GB", ".1f"), ("experts_gb", "experts GB", ".0f"),
            ("pool", "pool", ".0%"), ("hit_rate", "hit", ".0%"),
            ("projected_tps", "projected tok/s", ".3g"), ("read_share", "reads", ".0%")]
    title = "bench simulate --project: PROJECTED decode tok/s (not measured), 4-bit models"
    return finish(args.out, "projection", result, rows, cols, title, _plot_project)


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


def _plot_project(rows, path, title):
    plt = figure()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ok = [r for r in rows if r.get("projected_tps")]
    labels = [f"{r['machine']}\n{r['model']}" for r in ok]
    ax.barh(range(len(ok)), [r["projected_tps"] for r in ok])
    ax.set_yticks(range(len(ok)), labels, fontsize=6)
    ax.set_xlabel("projected decode tok/s (a projection, not a measurement)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
