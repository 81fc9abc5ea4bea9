"""bench decode: decode tok/s and peak memory of

  (a) mlx-lm with the model fully resident (no memory limit: the reference),
  (b) mlx-lm loading the same model lazily under the memory limit (naive),
  (c) mlx_streaming at several pool sizes under the memory limit,

each in its own process, optionally in a cgroup memory limit and with the
page cache dropped first. Each case is reported as a ratio to (a) and to the
bound: per token max(compute time of (a), missed bytes / disk bandwidth)
when I/O overlaps compute perfectly, and their sum when it does not.
"""

import itertools
from pathlib import Path

from ..config import ON_OFF, add_option_flag, config_options
from ..flags import MAX_ROUNDS, MAX_TOKENS, count, number, temperature
from ..format import blob_path, read_manifest
from ..predict.against import against, read_forecast
from . import ranks, routing
from .inputs import BenchError, add_option_list_flag, add_read_rate_flags, pool_slots
from .limits import disk_read_gbps, drop_page_cache
from .report import figure, finish
from .runs import median_run, paired_ratio, run_case

COLUMNS = [
    ("case", "case", "s"), ("pool", "pool", ".0%"), ("status", "status", "s"),
    ("decode_tps", "tok/s", ".3g"), ("vs_resident", "x (a)", ".2f"),
    ("vs_resident_paired", "x (a) paired", ".2f"),
    ("hit_rate", "hit", ".0%"), ("gb_per_token", "GB/tok", ".3f"),
    ("bound_overlap_tps", "bound", ".3g"), ("vs_bound", "x bound", ".2f"),
    ("bound_serial_tps", "no-overlap", ".3g"), ("stall_share", "stall", ".0%"),
    ("spine_wait_share", "spine wait", ".0%"),
    ("prefetch_wasted_share", "pf wasted", ".0%"),
    ("vs_belady", "x MIN", ".2f"), ("peak_gb", "peak RSS GB", ".2f"),
    ("mlx_peak_gb", "MLX peak GB", ".3f"), ("cgroup_peak_gb", "cgroup peak GB", ".3f"),
    ("spine_pool_gb", "planned GB", ".3f"),  # spine, pools and staging
    ("vs_forecast", "x forecast", ".2f"), ("forecast_where", "vs band", "s"),
]


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="stream directory")
    p.add_argument("--mlx-model", help="the same model as an mlx-lm directory, for (a) and (b)")
    p.add_argument("--pools", default="0.25,0.5",
                   help="pool sizes as fractions of each layer's experts")
    p.add_argument("--memory-limit-gb", type=number(0, open_low=True), default=None)
    add_option_flag(p, "cache_gb", note="the streaming cases' budget, instead of --pools")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each case")
    p.add_argument("--temp", type=temperature, default=0.0,
                   help="sampling temperature of the decode runs (0: greedy)")
    p.add_argument("--max-tokens", type=count(1, MAX_TOKENS), default=32)
    p.add_argument("--prompt-tokens", type=count(1, MAX_TOKENS), default=32)
    add_option_flag(p, "io")
    for name in ("prefetch", "prefetch_precision", "prefetch_depth", "prefetch_affinity",
                 "overlap", "checksums"):
        add_option_list_flag(p, name)
    add_option_flag(p, "direct_io")
    add_option_list_flag(p, "policy", "--policies")
    add_read_rate_flags(p, "the cases'", pace=True)
    p.add_argument("--routing-tokens", type=count(1, MAX_TOKENS), default=64)
    p.add_argument("--repeats", type=count(1, MAX_ROUNDS), default=1,
                   help="rounds of all cases, interleaved; each case reports its median")
    p.add_argument("--ranks", type=count(1, 8), default=1,
                   help="compare N tensor-parallel local ranks, --cache-gb each, against 1 "
                        "rank with --cache-gb and with N times it (needs --tp-model; prefetch "
                        "off, the default policy)")
    p.add_argument("--tp-model", default=None,
                   help="with --ranks: the model converted with --tensor-parallel N")
    p.add_argument("--forecast", default=None,
                   help="`mlx_streaming predict --json` output: where each case's speed fell "
                        "against its band")
    p.add_argument("--settings", default=None,
                   help="with --ranks: approximate settings (bench quality's forms, e.g. "
                        "cache-aware:1:16,miss-bits:2), comma-separated: the N ranks also "
                        "decode with each, every rank alike")
    p.add_argument("--out", type=Path, default=Path("bench-results/decode"))


def _summary(name, r, pool=None):
    row = dict(case=name, pool=pool, status=r["status"], peak_gb=r.get("peak_rss_bytes", 0) / 1e9,
               mlx_peak_gb=r.get("mlx_peak_bytes", 0) / 1e9,
               cgroup_peak_gb=r.get("cgroup_max_usage_bytes", 0) / 1e9 or None)
    if r["status"] == "ok":
        row["decode_tps"] = r["decode_tps"]
        s = r.get("stats")
        if s:
            t = s["total"]
            row["hit_rate"] = t["hit_rate"]
            # Streamed spine layers are read on every pass, as misses are.
            spine_read = (s.get("spine") or {}).get("read_gb", 0.0)
            row["gb_per_token"] = (t["bytes_read"] / 1e9 + spine_read) / r["decode_tokens"]
            row["spine_gb_per_token"] = spine_read / r["decode_tokens"]
            row["stall_share"] = t["stall_seconds"] / r["decode_s"]
            # The spine ring's wait overlaps the compute of earlier layers.
            row["spine_wait_share"] = (s.get("spine") or {}).get("wait_s", 0) / r["decode_s"]
            row["syncs_per_token"] = t["syncs"] / r["decode_tokens"]
            row["prefetch_wasted_share"] = t.get("prefetch_wasted_read_share")
            row["pool_gb"] = s["pool_bytes"] / 1e9
            row["slots_per_layer"] = s.get("slots_per_layer")
            row["spine_pool_gb"] = s["memory"]["total_gb"]
            row["memory"] = s["memory"]
            row["io"] = s["io"]
    return row


def _check_choices(args) -> None:
    """Refuse what no case could run before any case runs (the options
    compared are checked as they are parsed)."""
    if args.read_pace_mbps is not None and args.read_mbps:
        raise BenchError("--pace-mbps and --read-mbps are two ways to emulate a slower "
                         "disk: give one")


def _pools(text: str) -> list:
    """--pools as fractions of each layer's experts, each in (0, 1] (a pool
    of 0 would run the top-k slots the smallest pool has, under another
    label)."""
    try:
        pools = [float(p) for p in text.split(",")]
    except ValueError:
        pools = []
    if not pools or not all(0 < p <= 1 for p in pools):
        raise BenchError(f"--pools takes fractions of each layer's experts in (0, 1], "
                         f"comma-separated, got {text!r}")
    return pools


def run(args) -> dict:
    _check_choices(args)
    if args.ranks > 1 or args.tp_model:
        return ranks.run(args)
    forecast = read_forecast(args.forecast) if args.forecast else None
    affinities, overlaps = args.prefetch_affinity, args.overlap
    # A cache size in GB sizes the pools instead of --pools.
    pools = _pools(args.pools) if args.cache_gb is None else [None]
    stream_dir = Path(args.model)
    manifest = read_manifest(stream_dir)
    num_experts = manifest.layers[0].num_experts
    common = dict(op="decode", max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens,
                  temp=args.temp)
    cases = []
    if args.mlx_model:
        cases.append(("(a) mlx-lm resident", None,
                      dict(common, kind="mlx-lm", model=args.mlx_model), None))
        cases.append(("(b) mlx-lm lazy", None,
                      dict(common, kind="mlx-lm-lazy", model=args.mlx_model), args.memory_limit_gb))
    elif args.cache_gb is not None:
        # The compute reference: the same model with everything resident,
        # no memory limit, the page cache warm.
        cases.append(("(a) mlx_streaming all resident", None,
                      dict(common, kind="streaming", model=str(stream_dir),
                           load=dict(config_options(args, ["io"]),
                                     slots_per_layer=num_experts)), None))
    modes, policies, prefetches = args.checksums, args.policies, args.prefetch
    precisions, depths = args.prefetch_precision, args.prefetch_depth
    for pool, overlap in itertools.product(pools, overlaps):
        size = dict(cache_gb=args.cache_gb)
        if pool is not None:
            size = dict(slots_per_layer=pool_slots(manifest.layers[0], pool))
        for checksums, policy, prefetch, precision, affinity, depth in _variants(
                modes, policies, prefetches, precisions, affinities, depths):
            load = dict(size, **config_options(args, ["io", "direct_io"]), prefetch=prefetch,
                        checksums=checksums, policy=policy, overlap=ON_OFF[overlap])
            if prefetch != "off":
                load.update(prefetch_precision=precision, prefetch_affinity=ON_OFF[affinity],
                            prefetch_depth=depth)
            if args.read_pace_mbps:
                load["read_pace_mbps"] = args.read_pace_mbps
            name = "(c) mlx_streaming" + "".join(
                f" {label}={value}" for label, value, choices in
                [("checksums", checksums, modes), ("policy", policy, policies),
                 ("prefetch", prefetch, prefetches), ("precision", precision, precisions),
                 ("affinity", affinity, affinities), ("depth", depth, depths),
                 ("overlap", overlap, overlaps)]
                if len(choices) > 1 and value is not None)
            cases.append((name, pool and size["slots_per_layer"] / num_experts,
                          dict(common, kind="streaming", model=str(stream_dir), load=load),
                          args.memory_limit_gb))
    # Rounds interleave the cases, so slow spells of a shared machine hit
    # every case alike; each case keeps its median round.
    runs = [[] for _ in cases]
    for _ in range(args.repeats):
        for i, (_, _, case, limit) in enumerate(cases):
            throttle = args.read_mbps if case["kind"] == "streaming" else None
            runs[i].append(run_case(case, memory_limit_gb=limit, cold=args.cold,
                                    read_mbps=throttle))
    rows, raw = [], {}
    for (name, pool, _, _), results in zip(cases, runs):
        raw[f"{name} {pool or ''}".strip()] = results
        row = _summary(name, median_run(results), pool)
        row["load"] = results[0].get("load")
        row["runs_tps"] = [x.get("decode_tps") for x in results]
        rows.append(row)

    if args.cold:
        drop_page_cache()
    blob = blob_path(stream_dir, manifest.layers[0])
    disk_gbps = disk_read_gbps(blob, manifest.layers[0].stride, read_mbps=args.read_mbps)
    # The bounds' rate: the paced disk's, when the reader emulates one.
    rate_gbps = min(disk_gbps, args.read_pace_mbps / 1e3) if args.read_pace_mbps else disk_gbps
    reference = args.mlx_model or args.cache_gb is not None
    resident_tps = rows[0].get("decode_tps") if reference else None
    belady = _belady_gb_per_token(common, stream_dir, manifest, args) if args.mlx_model else {}
    for row in rows:
        if resident_tps and row.get("decode_tps"):
            row["vs_resident"] = row["decode_tps"] / resident_tps
            row["vs_resident_paired"] = paired_ratio(row["runs_tps"], rows[0]["runs_tps"])
        if resident_tps and row.get("gb_per_token") is not None:
            compute = 1 / resident_tps
            io = row["gb_per_token"] / rate_gbps
            row["bound_overlap_tps"] = 1 / max(compute, io)
            row["bound_serial_tps"] = 1 / (compute + io)
            row["vs_bound"] = row["decode_tps"] / row["bound_overlap_tps"]
            if row["pool"] in belady:
                # Belady's misses read at this disk's rate, serial with compute:
                # what the best possible eviction would take without prefetch.
                row["belady_gb_per_token"] = belady[row["pool"]]
                row["belady_serial_tps"] = 1 / (compute + belady[row["pool"]] / rate_gbps)
                row["vs_belady"] = row["decode_tps"] / row["belady_serial_tps"]
        if forecast is not None and row.get("decode_tps"):
            a = against(forecast, row["decode_tps"], row.get("slots_per_layer"))
            row.update(vs_forecast=a["ratio"], forecast_where=a["where"], forecast=a)

    stats = routing.measure(stream_dir, args.out, tokens=args.routing_tokens)
    result = dict(rows=rows, disk_direct_read_gbps=disk_gbps, routing=stats,
                  read_mbps=args.read_mbps, pace_mbps=args.read_pace_mbps,
                  memory_limit_gb=args.memory_limit_gb, cold=args.cold,
                  model_expert_gb=manifest.expert_nbytes / 1e9, cases=raw)
    throttled = (f", reads throttled to {args.read_mbps:g} MB/s" if args.read_mbps else
                 f", reads paced at {args.read_pace_mbps:g} MB/s" if args.read_pace_mbps else "")
    title = (f"bench decode: experts {manifest.expert_nbytes / 1e9:.2f} GB, memory limit "
             f"{args.memory_limit_gb or 'none'} GB, {'cold' if args.cold else 'warm'} page cache, "
             f"disk {disk_gbps:.3g} GB/s (dd, direct){throttled}\n{routing.describe(stats)}")
    return finish(args.out, "decode", result, rows, COLUMNS, title, _plot)


def _variants(modes, policies, prefetches, precisions, affinities, depths):
    """The load options of the streaming cases; prefetch's own options vary
    only where prefetch is on."""
    for checksums, policy, prefetch in itertools.product(modes, policies, prefetches):
        if prefetch == "off":
            yield checksums, policy, prefetch, None, None, None
            continue
        for option in itertools.product(precisions, affinities, depths):
            yield (checksums, policy, prefetch) + option


def _belady_gb_per_token(common, stream_dir, manifest, args) -> dict:
    """GB per decode token that Belady's MIN would read at each pool size,
    replayed on the routing of these very decode runs (every case decodes
    the same tokens: the output is exact), recorded in one more run."""
    from .cache import Belady, decode_records, replay_misses
    from .case import WARMUP_TOKENS

    Path(args.out).mkdir(parents=True, exist_ok=True)
    trace = Path(args.out) / "decode-trace.jsonl"
    spec = manifest.layers[0]
    # With prefetch on, the trace also holds each layer's predictions of the
    # next two (nothing is read ahead: every expert is resident), for offline
    # replays of prefetch; the fixed budget leaves room for the second.
    case = dict(common, kind="streaming", model=str(stream_dir),
                load=dict(slots_per_layer=spec.num_experts, trace=str(trace),
                          prefetch="next-layer", prefetch_depth=2,
                          prefetch_records=spec.num_experts))
    r = run_case(case)
    if r["status"] != "ok":
        raise BenchError(f"recording the decode routing failed: {r.get('error', r['status'])}")
    calls = decode_records(trace)
    # The decode case's warm-up tokens fill the pool and are not counted.
    skip = WARMUP_TOKENS
    tokens = len(next(iter(calls.values()))) - skip
    out = {}
    for pool in _pools(args.pools):
        slots = pool_slots(spec, pool)
        misses = sum(sum(len(m) for m in replay_misses(seq, slots,
                                                       Belady(seq, spec.num_experts))[skip:])
                     for seq in calls.values())
        out[slots / spec.num_experts] = misses * spec.expert_nbytes / max(1, tokens) / 1e9
    return out


def _plot(rows, path, title):
    plt = figure()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{r['case']}" + (f"\npool {r['pool']:.0%}" if r.get("pool") else "") for r in rows]
    values = [r.get("decode_tps") or 0 for r in rows]
    ax.bar(range(len(rows)), values, color="tab:blue", label="measured")
    for i, r in enumerate(rows):
        if r.get("bound_overlap_tps"):
            ax.plot([i - 0.4, i + 0.4], [r["bound_overlap_tps"]] * 2, color="tab:green",
                    label="bound (perfect overlap)" if i == len(rows) - 1 else None)
            ax.plot([i - 0.4, i + 0.4], [r["bound_serial_tps"]] * 2, color="tab:red", ls="--",
                    label="bound (no overlap)" if i == len(rows) - 1 else None)
        if r["status"] != "ok":
            ax.text(i, 0, r["status"], ha="center", va="bottom")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title.splitlines()[0], fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
