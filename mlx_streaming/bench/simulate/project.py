"""``bench simulate --project``: Apple Silicon machines x large MoE models,
projected from a trace's hit rates (projections, not measurements).
"""

import itertools
from dataclasses import asdict, replace
from pathlib import Path
from typing import Dict, List
from ...runtime.memory import staging_records
from ...config import (DEFAULT_PREFETCH_DEPTH, DEFAULT_PREFETCH_PRECISION,
                      StreamConfig)
from ..cache import Call, decode_records
from ..case import WARMUP_TOKENS
from ..common import BenchError, figure, finish
from .machines import ModelShape, PROFILES, Profile, SHAPES
from .model import project_pool


def project(args) -> dict:
    trace = args.trace or (Path(args.model) / "routing-trace.jsonl" if args.model else None)
    if trace is None:
        raise BenchError("--project needs --trace (a routing trace of a learned-routing model)")
    if not Path(trace).is_file():
        raise BenchError(f"no routing trace at {trace}: bench cache --model STREAM records one "
                         "(routing-trace-w*.jsonl in its --out)")
    calls = _read_trace(Path(trace))
    from ..decode import config_values

    policies = config_values("--policies", args.policies, "policy", str)
    settings = _project_prefetch(args, calls)
    rows = []
    for (key, prof), whole, ranks in itertools.product(PROFILES.items(), SHAPES.values(),
                                                       _ranks(args)):
        shape = split_shape(whole, ranks)
        row = dict(machine=prof.name, model=whole.name, ranks=ranks,
                   spine_gb=shape.spine_bytes() / 1e9,
                   experts_gb=shape.moe_layers * shape.experts * shape.expert_bytes() / 1e9)
        fraction = _pool_fraction(prof, shape, prefetch=False)
        if fraction < shape.top_k / shape.experts:
            row.update(pool=max(0.0, fraction), note="pool below one token's experts")
            rows.append(row)
            continue
        active = shape.dense_active_params * 4.5 / 8 + \
            shape.moe_layers * shape.top_k * shape.expert_bytes()
        compute = active / (prof.weight_gbps * 1e9) + all_reduces_s(shape, ranks)
        # Every call syncs on a GPU; its resident experts compute while
        # its misses are read (Paged's overlap).
        hit_compute = shape.expert_bytes() / (prof.weight_gbps * 1e9)
        for policy, (prefetch, depth, precision) in itertools.product(policies, settings):
            case = dict(row, policy=policy, prefetch=prefetch)
            fraction = _pool_fraction(prof, shape, prefetch=bool(depth))
            if fraction >= 1:  # every expert resident: mlx-lm's own decode
                if prefetch == "off":
                    rows.append(dict(case, pool=1.0, hit_rate=1.0,
                                     projected_tps=1 / compute, read_share=0.0))
                continue
            p = project_pool(calls, fraction, policy=policy, prefetch=depth,
                              compute_s=compute, sync_s=prof.sync_s,
                              moe_layers=shape.moe_layers, expert_bytes=shape.expert_bytes(),
                              top_k=shape.top_k, ssd_gbps=prof.ssd_gbps,
                              ssd_latency_s=prof.ssd_latency_s, skip=WARMUP_TOKENS,
                              miss_s=prof.miss_s, hit_compute_s=hit_compute,
                              precision=precision)
            rows.append(dict(case, pool=fraction, hit_rate=p["hit_rate"],
                             projected_tps=p["tps"], read_share=p["stall_s"] / p["seconds"],
                             read_ahead=p["read_ahead_per_token"],
                             cover=p["cover"] if depth else None))
    rows = _with_settings(rows, _quality_settings(args.quality))
    result = dict(rows=rows, profiles={k: asdict(v) for k, v in PROFILES.items()},
                  shapes={k: asdict(v) for k, v in SHAPES.items()}, trace=str(trace))
    cols = [("machine", "machine", "s"), ("model", "model", "s"), ("ranks", "Macs", "d"),
            ("policy", "policy", "s"),
            ("setting", "routing", "s"),
            ("spine_gb", "spine GB", ".1f"), ("experts_gb", "experts GB", ".0f"),
            ("pool", "pool", ".0%"), ("hit_rate", "hit", ".0%"),
            ("prefetch", "prefetch", "s"), ("projected_tps", "projected tok/s", ".3g"),
            ("read_share", "reads", ".0%"), ("read_ahead", "read ahead / token", ".1f"),
            ("cover", "records a layer's compute reads", ".2f")]
    title = "bench simulate --project: PROJECTED decode tok/s (not measured), 4-bit models"
    return finish(args.out, "projection", result, rows, cols, title, _plot_project)


# One all-reduce of a token's hidden state between Macs (JACCL over
# Thunderbolt 5 RDMA): ~50 us, an assumption; two per layer (attention, MoE).
ALL_REDUCE_S = 50e-6


def _ranks(args) -> List[int]:
    text = getattr(args, "ranks", None) or "1"
    try:
        ranks = [int(x) for x in text.split(",")]
    except ValueError:
        raise BenchError(f"--ranks takes numbers of Macs, comma-separated; got {text!r}") from None
    if not all(1 <= n <= 64 for n in ranks):
        raise BenchError(f"--ranks takes 1 to 64 Macs each; got {text!r}")
    return ranks


def split_shape(shape: ModelShape, ranks: int) -> ModelShape:
    """One rank's share of a tensor-parallel model: a slice of every
    expert and of the spine (the embeddings, in truth replicated, are
    counted split too: a small part of these models)."""
    if ranks == 1:
        return shape
    return replace(shape, expert_params=shape.expert_params / ranks,
                   dense_active_params=shape.dense_active_params / ranks,
                   total_params=shape.total_params / ranks)


def all_reduces_s(shape: ModelShape, ranks: int) -> float:
    """A token's time in all-reduces between ``ranks`` Macs."""
    return 0.0 if ranks == 1 else 2 * shape.moe_layers * ALL_REDUCE_S


def _quality_settings(path) -> List[dict]:
    """The approximate settings a ``bench quality`` JSON measured: per
    setting its misses and bytes read per token as shares of exact's."""
    if path is None:
        return []
    import json

    try:
        rows = json.loads(Path(path).read_text())["rows"]
        exact = next(r for r in rows if r["setting"] == "exact" and r["status"] == "ok")
    except (ValueError, KeyError, TypeError, StopIteration, OSError) as e:
        raise BenchError(f"{path} is not a bench quality result with an exact row "
                         f"({type(e).__name__}); run bench quality again") from None
    out = []
    for r in rows:
        if r["setting"] == "exact" or r["status"] != "ok" or not exact["mb_per_token"]:
            continue
        out.append(dict(setting=r["setting"], ppl_change=r["ppl_change"],
                        misses=(1 - r["hit_rate"]) / max(1e-12, 1 - exact["hit_rate"]),
                        bytes=r["mb_per_token"] / exact["mb_per_token"]))
    return out


def _with_settings(rows: List[dict], settings: List[dict]) -> List[dict]:
    """``rows`` (exact routing), each streamed one without prefetch followed
    by a row per approximate setting: its reads scaled by the bytes it read
    per token against exact's, as measured on the trace's own model."""
    out = []
    for row in rows:
        out.append(dict(row, setting="exact") if row.get("projected_tps") else row)
        if not row.get("projected_tps") or row["prefetch"] != "off" or row["pool"] >= 1:
            continue
        for s in settings:
            share = row["read_share"]
            scale = (1 - share) + share * s["bytes"]
            out.append(dict(row, setting=f"{s['setting']} ({s['ppl_change']:+.1%} ppl)",
                            hit_rate=1 - (1 - row["hit_rate"]) * s["misses"],
                            projected_tps=row["projected_tps"] / scale,
                            read_share=share * s["bytes"] / scale))
    return out


def _pool_fraction(prof: Profile, shape: ModelShape, prefetch: bool) -> float:
    """The share of each MoE layer's experts its pool holds: memory less a
    quarter left to the OS and apps, the spine, and with prefetch its
    staging area, which the loader's memory plan counts only where some
    experts are not resident."""
    room = prof.memory_gb * 0.75e9 - shape.spine_bytes()
    if prefetch and _pool_fraction(prof, shape, prefetch=False) < 1:
        staging = staging_records(StreamConfig(prefetch="next-layer"), [shape])
        room -= staging * shape.expert_bytes()
    return min(1.0, room / shape.expert_bytes() / shape.moe_layers / shape.experts)


def _read_trace(trace: Path) -> Dict[int, List[Call]]:
    """A trace's decode calls, with enough tokens to replay past the
    warm-up; a trace cut short or not a trace is refused in one line."""
    try:
        calls = decode_records(trace)
    except (ValueError, KeyError, TypeError, IndexError, OSError) as e:  # JSONDecodeError
        # is a ValueError
        raise BenchError(f"{trace} is not a routing trace that bench simulate can read "
                         f"({type(e).__name__}: {e}); record it again") from None
    tokens = min((len(seq) for seq in calls.values()), default=0)
    if tokens <= WARMUP_TOKENS:
        raise BenchError(f"{trace} holds {tokens} decode tokens; the projection needs more "
                         f"than the {WARMUP_TOKENS} that warm the pools (record a longer one)")
    return calls


def _project_prefetch(args, calls) -> list:
    """(label, depth, precision) of each projected setting, checked as
    bench decode checks them; prefetch needs the predictions of a decode
    trace."""
    from ..decode import config_values

    depths = config_values("--prefetch-depth", args.prefetch_depth, "prefetch_depth", int)
    precision = config_values("--prefetch-precision", None if args.prefetch_precision is None
                               else str(args.prefetch_precision), "prefetch_precision", float)[0]
    if precision is None:
        precision = DEFAULT_PREFETCH_PRECISION
    settings = []
    for prefetch in args.prefetch.split(","):
        if prefetch == "off":
            settings.append(("off", 0, 0.0))
        elif prefetch == "next-layer":
            for depth in depths:
                depth = depth or DEFAULT_PREFETCH_DEPTH
                settings.append((f"next-layer, depth {depth}", depth, precision))
        else:
            raise BenchError(f"--prefetch {prefetch!r}: project takes off, next-layer or both "
                             "comma-separated")
    predicted = any(c.ranked is not None for seq in calls.values() for c in seq)
    if any(depth for _, depth, _ in settings) and not predicted:
        raise BenchError("this trace holds no predictions to read ahead: project prefetch "
                         "from the decode trace bench decode records (decode-trace.jsonl)")
    two_ahead = any(c.ranked2 is not None for seq in calls.values() for c in seq)
    if any(depth == 2 for _, depth, _ in settings) and not two_ahead:
        raise BenchError("this trace holds no predictions two layers ahead (recorded at "
                         "prefetch_depth 1, or a model of fewer than 3 MoE layers): project "
                         "--prefetch-depth 1, or record the trace again with bench decode")
    return settings


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
