"""``bench simulate --validate``: predict's speed model (``predict/speed.py``)
checked on this machine. Its costs are measured here in the same run (the
resident decode's time per token, a paged call's cost on each path, the
reader's rate), each case of ``bench decode`` is forecast at the hit rate
it measured, and the error of each forecast is reported.
"""

import argparse

import numpy as np

from ...format import read_manifest
from ...predict.curves import HitCurve
from ...predict.headers import read_model
from ...predict.machines import Machine
from ...predict.shape import model_shape
from ...predict.speed import QUEUE_DEPTH, SpeedModel, forecast
from ..inputs import BenchError
from ..report import figure, finish
from ..runs import paired_ratio, run_case

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
    if args.prefetch_precision is not None:
        ns.prefetch_precision = [args.prefetch_precision]
    vars(ns).update(
        mlx_model=args.mlx_model, pools=args.pools, temp=args.temp,
        max_tokens=args.max_tokens, prefetch=args.prefetch,
        prefetch_depth=args.prefetch_depth,
        direct_io="on" if args.read_mbps or args.read_pace_mbps else "auto",
        policies=args.policies, read_mbps=args.read_mbps, read_pace_mbps=args.read_pace_mbps,
        repeats=args.repeats, out=args.out / "decode")
    measured = decode.run(ns)
    ov = overhead.run(argparse.Namespace(model=args.model, repeats=500, tokens=args.max_tokens,
                                         rounds=max(3, args.repeats), policy="lru",
                                         pool=OVERHEAD_POOL,
                                         prefetch_precision=args.prefetch_precision,
                                         out=args.out / "overhead"))
    shape = model_shape(read_model(str(args.model)))
    resident = measured["rows"][0]
    resident_tps = resident["decode_tps"]
    here = _machine(shape, resident_tps, _disk_gbps(args, spec))
    d, layers = ov["decode"], ov["moe_layers"]
    partial = f"paged, pool {OVERHEAD_POOL:.0%}"
    # A paged call takes one of two paths here, each with its own cost:
    # inside the graph (the CPU backend's native step, no host sync), or a
    # host sync per call (prefetch's path, and every call's on a GPU).
    call_s = {IN_GRAPH: _call_cost(d["paged, all hits"], d["resident"], layers),
              SYNCED: _call_cost(d[f"{partial}, prefetch"], d["resident"], layers)}
    rows = []
    for row in measured["rows"][2:]:
        # The path the case ran, as its own counters say.
        path = SYNCED if (row.get("syncs_per_token") or 0) > 0 else IN_GRAPH
        slots = row.get("slots_per_layer") or max(shape.top_k, round(row["pool"] * shape.experts))
        f = forecast(shape, here, slots, _measured_hits(shape, slots, row.get("hit_rate")),
                     SpeedModel(1.0, call_s[path], QUEUE_DEPTH), paged=True)
        # Judged as ratios to mlx-lm resident, paired round by round: the
        # machine's speed drifts between rounds by more than the error allowed.
        measured_ratio = paired_ratio(row["runs_tps"], resident["runs_tps"])
        projected_ratio = f.tok_s / resident_tps
        rows.append(dict(case=row["case"], pool=row["pool"], path=path,
                         prefetch=(row.get("load") or {}).get("prefetch", "off"),
                         measured_tps=row.get("decode_tps"), projected_tps=f.tok_s,
                         measured_ratio=measured_ratio, projected_ratio=projected_ratio,
                         hit_rate=row.get("hit_rate"), misses_per_token=f.misses_per_token,
                         compute_s=f.compute_s, calls_s=f.calls_s, reads_s=f.reads_s,
                         error=projected_ratio / measured_ratio - 1 if measured_ratio else None))
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    if not errors:
        raise BenchError("no streamed case of bench decode ran: nothing to validate")
    result = dict(rows=rows, machine=dict(memory_gbps=here.memory_gbps, ssd_gbps=here.ssd_gbps,
                                          sources=here.sources),
                  call_s=call_s, resident_tps=resident_tps, max_abs_error=max(errors))
    title = (f"bench simulate --validate: predict's speed model vs measured decode on this "
             f"machine (max error {result['max_abs_error']:.0%})")
    cols = [("case", "case", "s"), ("pool", "pool", ".0%"), ("path", "paged calls", "s"),
            ("measured_tps", "measured", ".3g"), ("projected_tps", "forecast", ".3g"),
            ("measured_ratio", "measured x resident (paired)", ".3f"),
            ("projected_ratio", "forecast x resident", ".3f"), ("error", "error", "+.0%"),
            ("hit_rate", "hit (measured)", ".0%")]
    return finish(args.out, "simulate", result, rows, cols, title, _plot_validate)


def _machine(shape, resident_tps: float, ssd_gbps: float) -> Machine:
    """This machine as predict's model sees it: the bandwidth that gives
    the resident decode's measured time per token (so with a share of 1),
    and the reader's measured rate."""
    return Machine("this machine (measured)", 0.0, shape.active_bytes * resident_tps / 1e9,
                   ssd_gbps, {"memory_gbps": "the resident decode's time per token, measured",
                              "ssd_gbps": "the reader's rate, measured"}, ssd_latency_s=0.0)


def _measured_hits(shape, slots: int, hit_rate) -> HitCurve:
    """A curve through the case's measured hit rate at its pool: the check is
    of the speed model's time per token, not of the hit curves."""
    fraction = min(1.0, slots / shape.experts)
    return HitCurve("measured", "measured", shape.experts, shape.top_k, (fraction,),
                    (hit_rate if hit_rate is not None else 1.0,))


def _disk_gbps(args, spec) -> float:
    """The reader's rate: the throttle's or the pace's where set, else
    measured from the page cache into a pool's slots."""
    if args.read_mbps:
        # A token-bucket throttle lets short bursts through at the disk's own
        # speed, so single reads overstate it; over a token it holds the rate.
        return args.read_mbps / 1e3
    warm = _read_cost(args.model, spec)
    return min(warm["gbps"], args.read_pace_mbps / 1e3) if args.read_pace_mbps else warm["gbps"]


def _call_cost(case: dict, resident: dict, layers: int) -> float:
    """Seconds a paged call adds to a token beyond its stall on reads: each
    round of ``case`` (``bench overhead``'s decode) against the resident
    model's same round, the median."""
    costs = [(1 / a - 1 / r - reads["stall_seconds"] / reads["tokens"]) / layers
             for a, r, reads in zip(case["runs_tps"], resident["runs_tps"], case["runs_reads"])]
    return max(0.0, float(np.median(costs)))


def _read_cost(model, spec) -> dict:
    """The reader's rate from the page cache, read into a pool's slots."""
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
    ax.fill_between([0, hi], [0, hi * 0.75], [0, hi * 1.25], alpha=0.15, label="±25%")
    ax.set_xlabel("measured tok/s")
    ax.set_ylabel("forecast tok/s (predict's speed model)")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
