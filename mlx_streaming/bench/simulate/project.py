"""``bench simulate --project``: predict's speed model (``predict/speed.py``)
for Apple Silicon machines x large MoE models, with the hit rates a
recorded routing trace gives at each machine's pool (projections, not
measurements).
"""

import itertools
import json
import tempfile
from pathlib import Path
from typing import Dict, List

from ...predict.__main__ import ALL_REDUCE_S, DEFAULT_CONTEXT
from ...predict.curves import HitCurve, replay_curve
from ...predict.headers import read_model
from ...predict.machines import GB, MACHINES, Machine
from ...predict.plan import fit, largest_budget
from ...predict.shape import ModelShape, model_shape, split
from ...predict.speed import forecast
from ...testing.sparse_repo import write_sparse_repo
from ..cache import Call, decode_records
from ..case import WARMUP_TOKENS
from ..inputs import BenchError
from ..report import figure, finish

PUBLISHED = Path(__file__).parents[2] / "predict" / "data" / "published.json"


def project(args) -> dict:
    trace = args.trace or (Path(args.model) / "routing-trace.jsonl" if args.model else None)
    if trace is None:
        raise BenchError("--project needs --trace (a routing trace of a learned-routing model)")
    if not Path(trace).is_file():
        raise BenchError(f"no routing trace at {trace}: bench cache --model STREAM records one "
                         "(routing-trace-w*.jsonl in its --out)")
    if args.prefetch != ["off"]:
        raise BenchError("--project forecasts with predict's speed model, which does not model "
                         "prefetch: leave --prefetch off (--validate runs prefetch's cases)")
    calls = _read_trace(Path(trace))
    curves = {p: replay_curve(calls, p, Path(trace).name, warmup=WARMUP_TOKENS)
              for p in args.policies}
    rows = []
    for (key, mac), (name, whole), ranks in itertools.product(
            MACHINES.items(), _shapes().items(), _ranks(args)):
        rows += _rows(mac, name, split(whole, ranks), ranks, curves)
    rows = _with_settings(rows, _quality_settings(args.quality))
    result = dict(rows=rows, machines={k: m.name for k, m in MACHINES.items()},
                  trace=str(trace), context=DEFAULT_CONTEXT,
                  curves={p: dict(fractions=c.fractions, hits=c.hits) for p, c in curves.items()})
    cols = [("machine", "machine", "s"), ("model", "model", "s"), ("ranks", "Macs", "d"),
            ("policy", "policy", "s"), ("setting", "routing", "s"),
            ("spine_gb", "spine GB", ".1f"), ("experts_gb", "experts GB", ".0f"),
            ("budget_gb", "budget GB", ".1f"), ("pool", "pool", ".0%"),
            ("hit_rate", "hit", ".0%"), ("projected_tps", "projected tok/s", ".3g"), ("read_share", "reads", ".0%"),
            ("note", "note", "s")]
    title = ("bench simulate --project: predict's speed model with this trace's hit rates, "
             "PROJECTED decode tok/s (not measured)")
    return finish(args.out, "projection", result, rows, cols, title, _plot_project)


def _rows(mac: Machine, name: str, shape: ModelShape, ranks: int,
          curves: Dict[str, HitCurve]) -> List[dict]:
    """One row per policy: the largest budget the machine holds beside the
    KV cache of predict's default context, planned as the loader plans it."""
    row = dict(machine=mac.name, model=name, ranks=ranks, spine_gb=shape.spine_bytes / GB,
               experts_gb=shape.expert_bytes / GB)
    budget = largest_budget(shape, mac, DEFAULT_CONTEXT)
    plan = fit(shape, mac, budget, DEFAULT_CONTEXT).plan if budget else None
    if plan is None:
        return [dict(row, pool=0.0, note="does not fit this machine")]
    extra = 0.0 if ranks == 1 else 2 * shape.moe_layers * ALL_REDUCE_S
    out = []
    for policy, curve in curves.items():
        # The trace's curve, carried to this model's experts and top-k as
        # predict carries its built-in curves.
        f = forecast(shape, mac, plan.slots, curve, extra_s=extra)
        seconds = 1 / f.tok_s
        out.append(dict(row, policy=policy, pool=f.resident,
                        hit_rate=f.hit_rate, projected_tps=f.tok_s,
                        band=list(f.band), read_share=f.reads_s / seconds,
                        slots_per_layer=plan.slots, budget_gb=budget))
    return out


def _shapes() -> Dict[str, ModelShape]:
    """The large models of predict's validation, built from their public
    config.json sizes as sparse repos (headers over holes)."""
    data = json.loads(PUBLISHED.read_text())
    shapes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, m in data["models"].items():
            write_sparse_repo(Path(tmp) / name, m["config"])
            shapes[name] = model_shape(read_model(str(Path(tmp) / name)))
    return shapes


def _ranks(args) -> List[int]:
    text = getattr(args, "ranks", None) or "1"
    try:
        ranks = [int(x) for x in text.split(",")]
    except ValueError:
        raise BenchError(f"--ranks takes numbers of Macs, comma-separated; got {text!r}") from None
    if not all(1 <= n <= 64 for n in ranks):
        raise BenchError(f"--ranks takes 1 to 64 Macs each; got {text!r}")
    return ranks


def _quality_settings(path) -> List[dict]:
    """The approximate settings a ``bench quality`` JSON measured: per
    setting its misses and bytes read per token as shares of exact's."""
    if path is None:
        return []
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
    """``rows`` (exact routing), each streamed one followed by a row per
    approximate setting: its reads scaled by the bytes it read per token
    against exact's, as measured on the trace's own model."""
    out = []
    for row in rows:
        out.append(dict(row, setting="exact") if row.get("projected_tps") else row)
        if not row.get("projected_tps") or row["pool"] >= 1:
            continue
        for s in settings:
            share = row["read_share"]
            scale = (1 - share) + share * s["bytes"]
            out.append(dict(row, setting=f"{s['setting']} ({s['ppl_change']:+.1%} ppl)",
                            hit_rate=1 - (1 - row["hit_rate"]) * s["misses"],
                            projected_tps=row["projected_tps"] / scale,
                            read_share=share * s["bytes"] / scale))
    return out


def _read_trace(trace: Path) -> Dict[int, List[Call]]:
    """A trace's decode calls, with enough tokens to replay past the
    warm-up; a trace cut short or not a trace is refused in one line."""
    try:
        calls = decode_records(trace)
    except (ValueError, KeyError, TypeError, IndexError, OSError) as e:
        raise BenchError(f"{trace} is not a routing trace that bench simulate can read "
                         f"({type(e).__name__}: {e}); record it again") from None
    tokens = min((len(seq) for seq in calls.values()), default=0)
    if tokens <= WARMUP_TOKENS:
        raise BenchError(f"{trace} holds {tokens} decode tokens; the projection needs more "
                         f"than the {WARMUP_TOKENS} that warm the pools (record a longer one)")
    return calls


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
