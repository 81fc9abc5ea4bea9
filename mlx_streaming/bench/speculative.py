"""bench speculative: the cost of verifying K draft tokens in one call, as MTP
and speculative decoding do, for K = 1..8.

A verify call needs the union of its tokens' experts in every layer, so its
cost grows with K while plain decode pays one call per token. With
acceptance rate a, a call with K drafts yields (1 - a^(K+1)) / (1 - a)
tokens on average (the accepted drafts and the model's own next token);
effective tokens/s = that / call time, against plain decode's 1 / call time
at K = 1. Draft cost is not counted.
"""

from pathlib import Path

from ..config import ON_OFF, add_option_flag, config_options
from ..flags import MAX_NUM_DRAFT, MAX_ROUNDS, MAX_TOKENS, count, draft, fractions, listed, number
from ..format import read_manifest
from . import routing
from .inputs import BenchError, add_option_list_flag, add_read_rate_flags, pool_slots
from .report import figure, finish
from .runs import run_case

ACCEPTANCE = (0.5, 0.7, 0.9)


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="stream directory")
    p.add_argument("--mlx-model", help="the same model as an mlx-lm directory (resident)")
    p.add_argument("--pool", type=number(0, 1, open_low=True), default=0.25,
                   help="pool size as a fraction of each layer's experts")
    p.add_argument("--max-k", type=count(1, MAX_NUM_DRAFT), default=8)
    p.add_argument("--repeats", type=count(1, MAX_ROUNDS), default=8,
                   help="calls per K (the sweep), or interleaved rounds (--drafts)")
    p.add_argument("--memory-limit-gb", type=number(0, open_low=True), default=None)
    p.add_argument("--cold", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench-results/speculative"))
    p.add_argument("--drafts", type=listed(draft), default=None,
                   help="real drafts instead of the K sweep, comma-separated: ngram, mtp "
                        "(the model's MTP layers), model:PATH (an mlx-lm draft model with the "
                        "same tokenizer)")
    p.add_argument("--draft-tokens", type=listed(count(1, MAX_NUM_DRAFT)), default="2,4", help="K values for --drafts")
    p.add_argument("--pools", type=fractions, default="0.25,0.5,1.0", help="pool sizes for --drafts")
    p.add_argument("--tokens", type=count(1, MAX_TOKENS), default=64, help="tokens decoded per prompt")
    add_option_list_flag(p, "overlap", note="--drafts")
    add_option_flag(p, "direct_io", note="--drafts (on with --read-mbps)")
    add_read_rate_flags(p, "the streamed cases'", pace=False)


def expected_tokens(k: int, acceptance: float) -> float:
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def _rows(result, label):
    rows = []
    base = result["rows"][0]["call_s"]
    for r in result["rows"]:
        row = dict(case=label, k=r["k"], call_ms=1e3 * r["call_s"],
                   mb_read_per_call=(r["bytes_read_per_call"] or 0) / 1e6
                   if r["bytes_read_per_call"] is not None else None)
        s = r.get("stats")
        if s:
            per_call = [layer["experts_per_call"] for layer in s["layers"].values() if layer["experts_per_call"]]
            row["experts_per_layer"] = sum(per_call) / len(per_call) if per_call else None
        for a in ACCEPTANCE:
            row[f"speedup@{a}"] = expected_tokens(r["k"], a) * base / r["call_s"]
        row["plain_tps"] = 1 / base
        rows.append(row)
    return rows


DRAFT_COLUMNS = [
    ("case", "case", "s"), ("prompt", "prompt", "s"), ("draft", "draft", "s"), ("k", "K", "d"),
    ("tps", "tok/s", ".3g"), ("vs_plain", "x plain", ".2f"),
    ("vs_streamed_plain", "x streamed plain", ".2f"), ("acceptance", "accepted", ".0%"),
    ("tokens_per_call", "tok/call", ".2f"), ("exact", "= greedy", "s"),
]


def run_drafts(args) -> dict:
    """Speculative decoding with real drafts: each pool streamed, and the
    model resident (mlx-lm's own speculative decoding for model drafts),
    one process per case, the repeats interleaved."""
    overlaps = args.overlap
    if args.read_mbps and args.direct_io == "off":
        raise BenchError("--read-mbps throttles uncached reads: drop --direct-io off")
    stream_dir = Path(args.model)
    spec = read_manifest(stream_dir).layers[0]
    common = dict(op="speculative", tokens=args.tokens, drafts=args.drafts,
                  ks=args.draft_tokens)
    cases = []
    for pool in args.pools:
        slots = pool_slots(spec, pool)
        for overlap in overlaps:
            load = dict(slots_per_layer=slots, mtp="mtp" in common["drafts"],
                        **config_options(args, ["direct_io"]))
            if args.read_mbps:
                load["direct_io"] = True  # the page cache would hide the throttle
            label = f"streamed {slots}/{spec.num_experts}"
            load["overlap"] = ON_OFF[overlap]
            if len(overlaps) > 1:
                label += f" overlap {overlap}"
            cases.append((label, dict(common, kind="streaming", model=str(stream_dir),
                                      load=load)))
    if args.mlx_model:
        cases.append(("mlx-lm resident", dict(common, kind="mlx-lm", model=args.mlx_model)))
    runs = [[] for _ in cases]
    for _ in range(args.repeats):
        for i, (_, case) in enumerate(cases):
            throttle = args.read_mbps if case["kind"] == "streaming" else None
            runs[i].append(run_case(case, memory_limit_gb=args.memory_limit_gb,
                                    read_mbps=throttle))
    rows = []
    for (label, _), results in zip(cases, runs):
        ok = [r for r in results if r["status"] == "ok"]
        if not ok:
            rows.append(dict(case=label, status=results[0]["status"],
                             error=results[0].get("error")))
            continue
        for j, row in enumerate(ok[0]["rows"]):
            tps = sorted(r["rows"][j]["tps"] for r in ok)
            rows.append(dict({k: v for k, v in row.items() if k != "stats"}, case=label,
                             tps=tps[len(tps) // 2], runs_tps=tps,
                             exact=str(all(r["rows"][j].get("exact", True) for r in ok))))
    plain = {(r["case"], r["prompt"]): r["tps"] for r in rows if r.get("draft") == "none"}
    for r in rows:
        base = plain.get((r["case"], r.get("prompt")))
        r["vs_plain"] = r["tps"] / base if base and r.get("tps") else None
        streamed = plain.get((rows[0]["case"], r.get("prompt")))
        r["vs_streamed_plain"] = r["tps"] / streamed if streamed and r.get("tps") else None
        if r.get("draft") == "none":
            r["exact"] = "-"
    title = (f"bench speculative --drafts: greedy decode of {args.tokens} tokens per prompt "
             f"(tok/s over the whole run, its 48-token prompt included); "
             f"median of {args.repeats} interleaved round(s); x streamed plain = vs plain "
             f"decode at the first pool")
    result = dict(rows=rows, cases=[r for rs in runs for r in rs])
    return finish(args.out, "speculative-drafts", result, rows, DRAFT_COLUMNS, title, _plot_drafts)


def _plot_drafts(rows, path, title):
    plt = figure()
    ok = [r for r in rows if r.get("tps") and r.get("draft") != "none"]
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(ok) + 1.5))
    ax.barh([f"{r['case']} {r['prompt']} {r['draft']} K={r['k']}" for r in ok],
            [r["vs_plain"] or 0 for r in ok])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("tok/s vs plain decode, same case")
    ax.tick_params(axis="y", labelsize=6)
    ax.set_title(title.splitlines()[0], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> dict:
    if args.drafts:
        return run_drafts(args)
    stream_dir = Path(args.model)
    spec = read_manifest(stream_dir).layers[0]
    slots = pool_slots(spec, args.pool)
    common = dict(op="verify", max_k=args.max_k, repeats=args.repeats)
    rows, raw = [], {}
    if args.mlx_model:
        r = run_case(dict(common, kind="mlx-lm", model=args.mlx_model), cold=args.cold)
        raw["resident"] = r
        if r["status"] == "ok":
            rows += _rows(r, "mlx-lm resident")
    r = run_case(dict(common, kind="streaming", model=str(stream_dir),
                      load=dict(slots_per_layer=slots)),
                 memory_limit_gb=args.memory_limit_gb, cold=args.cold)
    raw["streaming"] = r
    if r["status"] != "ok":
        raise BenchError(f"streaming verify case failed: {r.get('error', r['status'])}")
    rows += _rows(r, f"streaming pool {slots}/{spec.num_experts}")
    stats = routing.measure(stream_dir, args.out)
    columns = [("case", "case", "s"), ("k", "K", "d"), ("call_ms", "ms/call", ".1f"),
               ("experts_per_layer", "experts/layer", ".1f"),
               ("mb_read_per_call", "MB read/call", ".2f")] + [
        (f"speedup@{a}", f"x@{a}", ".2f") for a in ACCEPTANCE]
    title = (f"bench speculative: K draft tokens per call; x@a = effective tokens/s vs plain "
             f"decode at acceptance a\n{routing.describe(stats)}")
    result = dict(rows=rows, routing=stats, slots_per_layer=slots, cases=raw)
    return finish(args.out, "speculative", result, rows, columns, title, _plot)


def _plot(rows, path, title):
    plt = figure()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for case in dict.fromkeys(r["case"] for r in rows):
        rs = [r for r in rows if r["case"] == case]
        k = [r["k"] for r in rs]
        a1.plot(k, [r["call_ms"] for r in rs], "o-", label=case)
        for a in ACCEPTANCE:
            a2.plot(k, [r[f"speedup@{a}"] for r in rs], "o-", label=f"{case}, a={a}")
    a1.set_xlabel("K (tokens per verify call)")
    a1.set_ylabel("ms per call")
    a2.axhline(1.0, color="k", lw=0.8)
    a2.set_xlabel("K")
    a2.set_ylabel("effective speed vs plain decode")
    a1.legend(fontsize=7)
    a2.legend(fontsize=6)
    fig.suptitle(title.splitlines()[0], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
