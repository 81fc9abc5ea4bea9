"""bench quality: what an approximate setting costs, and what it saves.

Reads a text through the streamed model one token per call (as decode
does; with --batch B, B streams of it one token each per call, as batched
serving does), once exactly and once per setting, each in its own process, and
reports per setting: perplexity and its change, next-token top-1 agreement
and mean KL divergence against exact, route agreement (the share of the
router's own (token, layer, expert) choices kept), hit rate and bytes read
per token. With --read-mbps or --pace-mbps the reads run at an emulated
disk's rate and the decode tok/s, as a ratio to exact's in the same round,
is the speed a read-bound machine gets.

Settings (``--settings``): ``exact``; ``cache-aware`` (load()'s defaults),
``cache-aware:KEEP:WINDOW`` (load()'s default bonus: resident first, or
0.15 on a softmax router of fewer than 8 experts per token) or
``cache-aware:KEEP:WINDOW:BONUS`` (routing_bonus); the baselines
``top-k-cut:KEEP`` and ``skip-misses``; low-bit miss reads ``miss-bits:BITS``
or ``miss-bits:BITS:WEIGHT`` (miss_bits_weight), alone or after a routing
setting and a ``+``. By default a sweep of them. The default
text is Python standard library source past what scripts/train_moe.py
trains on (held out for models trained there).
"""

from pathlib import Path
from typing import List, Optional

import numpy as np

from ..flags import MAX_ROUNDS, MAX_TOKENS, count, number, text_file
from ..format import LOW_BITS, read_manifest
from ..runtime.low_bits import copy_slots
from .inputs import BenchError, add_read_rate_flags, pool_slots
from .ranks import run_ranks
from .report import figure, finish
from .runs import paired_ratio, run_case

# scripts/train_moe.py trains on the first 4,000,000 characters of the corpus.
HELD_OUT_FROM = 4_000_000

SETTING_FORMS = ("exact, cache-aware[:KEEP:WINDOW[:BONUS]], top-k-cut[:KEEP], "
                 "skip-misses[:KEEP], miss-bits:BITS[:WEIGHT], or a routing setting "
                 "+miss-bits:BITS[:WEIGHT]")


COLUMNS = [
    ("setting", "setting", "s"), ("status", "status", "s"), ("slots", "slots", "d"),
    ("ppl", "ppl", ".4g"),
    ("ppl_change", "ppl +", "+.2%"), ("top1_agreement", "top-1 agree", ".1%"),
    ("kl", "KL", ".4f"), ("route_agreement", "route agree", ".1%"),
    ("hit_rate", "hit", ".1%"), ("low_bit_share", "low-bit", ".1%"),
    ("mb_per_token", "MB/tok", ".3f"),
    ("decode_tps", "tok/s", ".3g"), ("speedup", "x exact", ".2f"),
]


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="stream directory")
    p.add_argument("--text", type=text_file, default=None,
                   help="held-out text to read (default: Python standard library source "
                        "that scripts/train_moe.py does not train on)")
    p.add_argument("--tokens", type=count(2, MAX_TOKENS), default=512,
                   help="tokens of the text to read")
    p.add_argument("--pool", type=number(0, 1, open_low=True), default=0.25,
                   help="pool size as a fraction of each layer's experts")
    p.add_argument("--settings", default=None,
                   help=f"comma-separated, each one of: {SETTING_FORMS} (default: a sweep)")
    add_read_rate_flags(p, "the cases'", pace=True)
    p.add_argument("--batch", type=count(1, 64), default=1,
                   help="cut the text into this many streams decoded together, one token "
                        "of each per call (as batched serving decodes)")
    p.add_argument("--repeats", type=count(1, MAX_ROUNDS), default=1,
                   help="rounds of all cases, interleaved; speeds are paired per round")
    p.add_argument("--ranks", type=count(1, 8), default=1,
                   help="run every setting (exact too) tensor parallel over N local ranks "
                        "(ring backend), each with the --pool pool and, with --read-mbps, a "
                        "throttle of its own (needs --tp-model)")
    p.add_argument("--tp-model", default=None,
                   help="with --ranks: --model converted with --tensor-parallel N")
    p.add_argument("--out", type=Path, default=Path("bench-results/quality"))


def parse_settings(text: Optional[str], top_k: int, num_experts: int,
                   low_bits=()) -> List[dict]:
    """``[{name, load}]``: exact first, then each setting's load() options
    (the default sweep adds miss-bits settings for the ``low_bits`` widths
    the model holds)."""
    if text is None:
        keeps = sorted({max(1, top_k * q // 4) for q in (3, 2, 1)} | {top_k - 1} - {0},
                       reverse=True)
        window = min(num_experts, 4 * top_k)
        names = [f"cache-aware:{k}:{window}" for k in keeps]
        names += [f"cache-aware:1:{window}:{b:g}" for b in (0.25, 0.5, 1.0)]
        if top_k > 1:  # a baseline that keeps every routed expert is refused
            names += [f"top-k-cut:{k}" for k in keeps[:2]] + ["skip-misses"]
        names += [f"miss-bits:{b}{w}" for b in low_bits for w in ("", ":0.1", ":0.05")]
    else:
        names = [n.strip() for n in text.split(",")]
        if not all(names):
            raise BenchError(f"--settings {text!r} holds an empty setting: give settings "
                             "separated by single commas")
        names = [n for n in names if n != "exact"]
    out = [dict(name="exact", load=dict(routing="exact"))]
    for name in names:
        out.append(dict(name=name, load=setting_options(name, top_k, num_experts)))
    if len({s["name"] for s in out}) != len(out):
        raise BenchError("--settings names a setting twice")
    return out


def setting_options(name: str, top_k: int, num_experts: int, flag: str = "--settings") -> dict:
    """The load() options of one setting (an entry of ``flag``, which
    errors name)."""
    routing, plus, low = name.partition("+miss-bits:")
    if name.startswith("miss-bits:"):
        routing, plus, low = "", "+", name[len("miss-bits:"):]
    load = _routing_setting(routing, top_k, num_experts, flag) if routing else {}
    return dict(load, **_miss_bits_setting(name, low, flag)) if plus else load


def _miss_bits_setting(name: str, text: str, flag: str) -> dict:
    bits, _, weight = text.partition(":")
    try:
        load = dict(miss_bits=int(bits))
        if weight:
            load["miss_bits_weight"] = float(weight)
    except ValueError:
        raise BenchError(f"{flag} {name}: miss-bits takes BITS[:WEIGHT], an integer and "
                         "a number") from None
    if load["miss_bits"] not in LOW_BITS:
        raise BenchError(f"{flag} {name}: BITS must be one of {', '.join(map(str, LOW_BITS))} "
                         "(the widths convert --miss-bits writes)")
    if not 0 <= load.get("miss_bits_weight", 0) <= 1:
        raise BenchError(f"{flag} {name}: WEIGHT must be 0-1")
    return load


def _routing_setting(name: str, top_k: int, num_experts: int, flag: str) -> dict:
    mode, *values = name.split(":")
    sizes = {"cache-aware": (0, 2, 3), "top-k-cut": (0, 1), "skip-misses": (0, 1)}
    if mode not in sizes or len(values) not in sizes[mode]:
        raise BenchError(f"{flag} takes {SETTING_FORMS}; got {name!r}")
    load = dict(routing=mode)
    try:
        numbers = [int(v) for v in values[:2]] + [float(v) for v in values[2:]]
    except ValueError:
        raise BenchError(f"{flag}: KEEP and WINDOW are integers, BONUS a number; "
                         f"got {name!r}") from None
    if numbers:
        # A baseline keeping all top_k is exact, and refused at load.
        most = top_k if mode == "cache-aware" else top_k - 1
        if not 1 <= numbers[0] <= most:
            raise BenchError(f"{flag} {name}: KEEP must be 1-{most}")
        load["routing_keep"] = numbers[0]
    if len(numbers) > 1:
        if not top_k <= numbers[1] <= num_experts:
            raise BenchError(f"{flag} {name}: WINDOW must be {top_k}-{num_experts}")
        load["routing_window"] = numbers[1]
    if len(numbers) > 2:
        if not 0 <= numbers[2] < float("inf"):
            raise BenchError(f"{flag} {name}: BONUS must be 0 or more")
        load["routing_bonus"] = numbers[2]
    return load


def equal_memory_slots(manifest, slots: int, bits: Optional[int],
                       flag: str = "--settings") -> int:
    """The pool a setting gets so that every setting holds the same expert
    memory: with low-bit copies, ``slots`` less the records' worth of the
    copies' pool (rounded up)."""
    if bits is None:
        return slots
    copies = manifest.low_copies(bits)
    if copies is None:
        from ..conversion.copies import check_width
        from ..errors import ConversionError

        try:  # what convert would refuse is not suggested
            for spec in manifest.layers:
                check_width(spec, bits)
        except ConversionError as e:
            raise BenchError(f"{flag}: the model holds no {bits}-bit copies, and convert "
                             f"cannot write them ({e})") from None
        raise BenchError(f"{flag}: the model holds no {bits}-bit copies (add them: "
                         f"python -m mlx_streaming.convert --out DIR --miss-bits {bits})")
    full, low = manifest.layers[0], copies.layers[0]
    copy_bytes = copy_slots(low) * low.expert_nbytes
    return slots - -(-copy_bytes // full.expert_nbytes)


def held_out_text(out: Path, tokens: int) -> Path:
    """The default text, written into ``out``."""
    from ..testing.tiny import corpus_text

    chars = max(20_000, 8 * tokens)
    text = corpus_text(HELD_OUT_FROM + chars)[HELD_OUT_FROM:]
    if len(text) < chars // 2:
        raise BenchError("not enough local text past the training text; give --text")
    path = Path(out) / "held-out.txt"
    path.write_text(text)
    return path


def run(args) -> dict:
    manifest = read_manifest(args.model)
    spec = manifest.layers[0]
    settings = parse_settings(args.settings, spec.top_k, spec.num_experts,
                              [c.bits for c in manifest.low_bits])
    if args.tokens < 2 * args.batch:
        raise BenchError(f"--tokens {args.tokens} cannot make {args.batch} streams of 2 tokens")
    slots = pool_slots(spec, args.pool)
    for s in settings:
        s["slots"] = equal_memory_slots(manifest, slots, s["load"].get("miss_bits"))
        if s["slots"] < spec.top_k:
            raise BenchError(f"--settings {s['name']}: its copies' pool leaves the "
                             f"pool {s['slots']} slots, fewer than a token's {spec.top_k} "
                             "experts; use a larger --pool")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = args.text or held_out_text(out, args.tokens)
    base = dict(slots_per_layer=slots)
    if args.read_pace_mbps:
        base["read_pace_mbps"] = args.read_pace_mbps
    if args.read_mbps:
        base["direct_io"] = True  # page-cache hits are not throttled
    reference = out / "exact-logprobs.npy"
    reference.unlink(missing_ok=True)  # never another run's
    rounds = {s["name"]: [] for s in settings}
    ranks = _ranks(args)
    for r in range(args.repeats):
        for s in settings:
            case = dict(op="quality", kind="streaming", model=str(args.model),
                        text=str(text), tokens=args.tokens, batch=args.batch,
                        load=dict(base, **s["load"], slots_per_layer=s["slots"]))
            if r == 0:
                case["save" if s["name"] == "exact" else "reference"] = str(reference)
            if ranks > 1:  # the same settings on every rank
                case.update(kind="sharded", model=str(args.tp_model))
                rounds[s["name"]].append(run_ranks(case, ranks, None, False, args.read_mbps))
            else:
                rounds[s["name"]].append(run_case(case, read_mbps=args.read_mbps))
    if rounds["exact"][0]["status"] != "ok":
        raise BenchError(f"the exact case failed ({rounds['exact'][0].get('error', 'see above')})"
                         ": nothing to measure the settings against")
    rows = [dict(_row(s["name"], rounds[s["name"]], rounds["exact"]), slots=s["slots"])
            for s in settings]
    exact_ppl = rows[0].get("ppl")
    for row in rows:
        if row.get("ppl") and exact_ppl:
            row["ppl_change"] = row["ppl"] / exact_ppl - 1
    disk = (f", reads throttled to {args.read_mbps:g} MB/s" if args.read_mbps else "") + \
        (f", reads paced at {args.read_pace_mbps:g} MB/s" if args.read_pace_mbps else "")
    streams = f" in {args.batch} streams decoded together" if args.batch > 1 else ""
    if ranks > 1:
        streams += f", {ranks} tensor-parallel ranks"
    title = (f"bench quality: {Path(args.model).name}, {args.tokens} tokens of {Path(text).name}"
             f"{streams}, pool {slots}/{spec.num_experts} experts per layer{disk}")
    result = dict(model=str(args.model), text=str(text), tokens=args.tokens, slots=slots,
                  batch=args.batch, ranks=ranks, tp_model=args.tp_model,
                  read_mbps=args.read_mbps, pace_mbps=args.read_pace_mbps, rows=rows)
    return finish(out, "quality", result, rows, COLUMNS, title, _plot)


def _ranks(args) -> int:
    """The ranks every case runs on (1: this machine's one process)."""
    if args.ranks == 1 and args.tp_model is None:
        return 1
    if args.tp_model is None:
        raise BenchError("--ranks needs --tp-model (--model converted with --tensor-parallel N)")
    have = read_manifest(args.tp_model).tensor_parallel
    if have != args.ranks:
        raise BenchError(f"{args.tp_model} is converted for {have} tensor-parallel ranks, "
                         f"not --ranks {args.ranks}")
    return args.ranks


def _row(name: str, runs: List[dict], exact: List[dict]) -> dict:
    first = runs[0]
    row = dict(setting=name, status=first["status"])
    if first["status"] != "ok":
        row["error"] = first.get("error")
        return row
    t = first["stats"]["total"]
    routing = first["stats"]["routing"]
    row.update(ppl=first["ppl"], top1_agreement=first.get("top1_agreement", 1.0),
               kl=first.get("kl", 0.0), route_agreement=routing.get("route_agreement", 1.0),
               hit_rate=t["hit_rate"], mb_per_token=t["bytes_read"] / 1e6 / first["tokens"],
               low_bit_share=(first["stats"].get("miss_bits") or {}).get("share_of_misses"))
    speeds = [r.get("decode_tps") if r["status"] == "ok" else None for r in runs]
    ok = [s for s in speeds if s]
    row["decode_tps"] = float(np.median(ok)) if ok else None
    row["speedup"] = paired_ratio(speeds, [r.get("decode_tps") if r["status"] == "ok" else None
                                           for r in exact])
    return row


def _plot(rows, path, title):
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = [r for r in rows if r.get("ppl_change") is not None]
    paced = any(r.get("speedup") for r in ok[1:])
    y_key, y_label = (("speedup", "decode tok/s, x exact") if paced else
                      ("mb_per_token", "MB read per token"))
    for r in ok:
        # Ours round, the baselines others ship square.
        style = "k*" if r["setting"] == "exact" else \
            "o" if r["setting"].startswith(("cache-aware", "miss-bits")) else "s"
        ax.plot(100 * r["ppl_change"], r[y_key] or 0, style)
        ax.annotate(r["setting"].replace("cache-aware", "ca"), (100 * r["ppl_change"],
                    r[y_key] or 0), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("perplexity change against exact (%)")
    ax.set_ylabel(y_label)
    ax.set_title(title, fontsize=8, wrap=True)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
