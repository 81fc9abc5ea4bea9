"""bench prefill: prompt tokens/s at several prompt lengths, streaming vs
resident, and the expert bytes read per prompt token."""

from pathlib import Path

from ..flags import MAX_TOKENS, count, listed, number
from ..format import read_manifest
from . import routing
from .inputs import pool_slots
from .report import figure, finish
from .runs import run_case


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="stream directory")
    p.add_argument("--mlx-model", help="the same model as an mlx-lm directory (resident)")
    p.add_argument("--lengths", type=listed(count(1, MAX_TOKENS)), default="128,1024,4096")
    p.add_argument("--pool", type=number(0, 1, open_low=True), default=0.25)
    p.add_argument("--memory-limit-gb", type=number(0, open_low=True), default=None)
    p.add_argument("--cold", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench-results/prefill"))


def run(args) -> dict:
    stream_dir = Path(args.model)
    spec = read_manifest(stream_dir).layers[0]
    slots = pool_slots(spec, args.pool)
    lengths = args.lengths
    common = dict(op="prefill", lengths=lengths)
    cases = []
    if args.mlx_model:
        cases.append(("mlx-lm resident", dict(common, kind="mlx-lm", model=args.mlx_model), None))
    cases.append((f"streaming pool {slots}/{spec.num_experts}",
                  dict(common, kind="streaming", model=str(stream_dir),
                       load=dict(slots_per_layer=slots)), args.memory_limit_gb))
    rows, raw = [], {}
    for label, case, limit in cases:
        r = run_case(case, memory_limit_gb=limit, cold=args.cold)
        raw[label] = r
        if r["status"] != "ok":
            rows.append(dict(case=label, status=r["status"]))
            continue
        for row in r["rows"]:
            rows.append(dict(case=label, status="ok", tokens=row["tokens"],
                             prompt_tps=row["prompt_tps"],
                             kb_read_per_token=None if row["bytes_read_per_token"] is None
                             else row["bytes_read_per_token"] / 1e3))
    resident = {r["tokens"]: r["prompt_tps"] for r in rows
                if r["case"] == "mlx-lm resident" and r["status"] == "ok"}
    for r in rows:
        if r.get("tokens") in resident:
            r["vs_resident"] = r["prompt_tps"] / resident[r["tokens"]]
    stats = routing.measure(stream_dir, args.out)
    columns = [("case", "case", "s"), ("tokens", "prompt", "d"), ("prompt_tps", "tok/s", ".1f"),
               ("vs_resident", "x resident", ".2f"), ("kb_read_per_token", "KB read/tok", ".1f")]
    title = f"bench prefill: prompt processing\n{routing.describe(stats)}"
    result = dict(rows=rows, routing=stats, cases=raw)
    return finish(args.out, "prefill", result, rows, columns, title, _plot)


def _plot(rows, path, title):
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for case in dict.fromkeys(r["case"] for r in rows if r["status"] == "ok"):
        rs = [r for r in rows if r["case"] == case and r["status"] == "ok"]
        ax.plot([r["tokens"] for r in rs], [r["prompt_tps"] for r in rs], "o-", label=case)
    if len({r["tokens"] for r in rows if r["status"] == "ok"}) > 1:
        ax.set_xscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prompt tokens/s")
    if ax.get_legend_handles_labels()[0]:  # no case ran: no legend to draw
        ax.legend()
    ax.set_title(title.splitlines()[0], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
