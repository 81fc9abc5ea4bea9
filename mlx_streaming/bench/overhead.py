"""bench overhead: where the time of one paged MoE call goes.

A paged layer pays, per call, what a resident one does not: one host sync,
the numpy work of turning ids into slots, the policy, the counters and the
graph of the remap. Two measurements:

In isolation, on a real layer and input, each piece in a loop of
``--repeats`` calls (a pool holding every expert: every lookup hits):

  sync          mx.eval of the router's ids for a fresh input
  to_numpy      the ids as a numpy array
  bookkeeping   distinct experts, hit count, policy, stats event, ensure
  graph         building the expert call's graph with the remapped ids
  paged call    the whole paged call, evaluated
  resident call mlx-lm's own expert call on the same input, evaluated

In decode, the steps of every paged call timed while the model decodes
(``Paged``'s own methods, wrapped): start (schedule the router, build the
expert graph), sync (wait for the ids), route (numpy, counters, policy),
ensure (evict and read the misses), launch (schedule the experts), and the
rest of the token (mlx-lm's own graph and scheduling). A call made inside
the graph (``block.NativePaged`` on the CPU backend: no sync) has one step,
in_graph (building its remap and expert graph); its bookkeeping and reads
run on the stream's thread and show in the rest of the token. Rounds of
decode with the model resident, paged with every expert in its pool, paged
at ``--pool``, paged at ``--pool`` with ``io="python"`` (the reference
path: route and ensure in numpy, the Python reader), and paged at
``--pool`` with next-layer prefetch (a host sync per call, as every call
makes on a GPU), the paged ones without ``overlap``, alternate, and the
tok/s of each is reported. With the native step (``store.NativeStore``)
the route and ensure steps are one C++ call each.
"""

import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..config import DEFAULT_POLICY, add_option_flag
from ..flags import MAX_ROUNDS, MAX_TOKENS, count, number
from ..format import read_manifest
from ..models.discover import find_router, input_dims_of
from .inputs import prompt_tokens
from .report import figure, finish
from .runs import paired_ratio


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="stream directory")
    p.add_argument("--repeats", type=count(1, 10**7), default=2000, help="calls per timed piece")
    p.add_argument("--tokens", type=count(1, MAX_TOKENS), default=64, help="decode tokens per round")
    p.add_argument("--rounds", type=count(1, MAX_ROUNDS), default=3, help="interleaved decode rounds")
    add_option_flag(p, "policy")
    p.add_argument("--pool", type=number(0, 1, open_low=True), default=0.25,
                   help="pool of the partial case, a fraction of each layer's experts")
    add_option_flag(p, "prefetch_precision", note="the prefetch case")
    p.add_argument("--out", type=Path, default=Path("bench-results/overhead"))


def _timed(fn, repeats: int) -> float:
    """Median of 5 batches, in microseconds per call."""
    batch = max(1, repeats // 5)
    fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - start) / batch)
    return float(np.median(samples)) * 1e6


def pieces(model, repeats: int) -> dict:
    """Microseconds per call of each piece, on the first paged layer."""
    runtime = model.streaming
    paged = runtime.residencies[0]
    store = paged.store
    block = next(m for _, m in model.named_modules()
                 if getattr(m, "residency", None) is paged)
    spec = store.spec
    dims = input_dims_of(block.inner)
    router = find_router(model, spec.module, spec.num_experts, dims)
    x = mx.random.normal((1, 1, dims)).astype(mx.float32)
    mx.eval(x)
    k = spec.top_k

    def route(x):
        return mx.argpartition(-router(x), kth=k - 1, axis=-1)[..., :k]

    indices = route(x)
    mx.eval(indices)

    def sync():
        mx.eval(route(x))

    def to_numpy():
        np.array(indices)

    def bookkeeping():
        # The paged call's own steps after its sync.
        _, experts, _ = paged._route(indices, ())
        store.ensure(experts)
        store.drop_staged()

    def graph():
        block.inner(x, store.pool.table[indices])

    def paged_call():
        mx.eval(paged(block.inner, x, indices))
        paged.pending = []

    table = store.pool.table

    def resident_call():
        # Pool slot == expert id here: the expert call mlx-lm makes, without paging.
        mx.eval(block.inner(x, table[indices]))

    out = {name: _timed(fn, repeats) for name, fn in [
        ("sync", sync), ("to_numpy", to_numpy), ("bookkeeping", bookkeeping),
        ("graph", graph), ("paged_call", paged_call), ("resident_call", resident_call)]}
    runtime.stats.reset()
    return out


def _decode(model, tokenizer, tokens: int):
    """tok/s of ``tokens`` greedy decode tokens after the prompt and two
    more, and what the pools read in them (``_reads``)."""
    from mlx_lm.generate import generate_step

    prompt = mx.array(prompt_tokens(tokenizer, 16))
    steps = generate_step(prompt, model, max_tokens=tokens + 2,
                          sampler=lambda logits: mx.argmax(logits, axis=-1))
    next(steps)
    next(steps)
    before = _reads(model)
    start = time.perf_counter()
    n = sum(1 for _ in steps)
    seconds = time.perf_counter() - start
    reads = {k: v - before[k] for k, v in _reads(model).items()}
    return n / seconds, dict(reads, tokens=n)


STEPS = ("_start", "_sync", "_route", "ensure", "_launch", "_in_graph")
# A call is one of these: a synced call starts with _start, a call inside
# the graph (block.NativePaged) is _in_graph alone.
FIRST_STEPS = ("_start", "_in_graph")


class StepTimer:
    """Wraps the steps of every paged call of a model (instance attributes
    shadow the methods) and sums their time."""

    def __init__(self, model):
        self.seconds = {name: 0.0 for name in STEPS}
        self.calls = 0
        for paged in model.streaming.residencies:
            for name in STEPS:
                owner = paged.store if name == "ensure" else paged
                if hasattr(owner, name):
                    setattr(owner, name, self._wrap(name, getattr(owner, name)))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls += name in FIRST_STEPS

        return timed

    def reset(self):
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.calls = 0


def _reads(model) -> dict:
    """Records read from disk, missed (token, expert) lookups, and the
    seconds the forward pass waited for them (stall), so far."""
    counters = model.streaming.stats.counters.values()
    return dict(records_read=sum(c.records_read for c in counters),
                misses=sum(c.misses for c in counters),
                stall_seconds=sum(c.stall_seconds for c in counters))


def in_decode(models: dict, tokenizer, tokens: int, rounds: int) -> dict:
    """tok/s of each model (interleaved rounds, medians; ``runs_tps`` in
    round order, ``runs_reads`` what was read in each round's timed tokens)
    and, for the paged ones, microseconds per call of each step and the
    stall per record read (microseconds), in the median round."""
    timers = {k: StepTimer(m) for k, m in models.items() if m.streaming.residencies}
    runs = {k: [] for k in models}
    for _ in range(rounds):
        for name, model in models.items():
            if name in timers:
                timers[name].reset()
            tps, reads = _decode(model, tokenizer, tokens)
            steps, per_record = None, None
            if name in timers:
                t = timers[name]
                per_call = {k: v / t.calls * 1e6 for k, v in t.seconds.items()}
                token_us = 1e6 / tps
                layers = len(model.streaming.residencies)
                per_call["rest of the token"] = token_us / layers - sum(per_call.values())
                steps = per_call
                # Per record read: the stall (evict, read, check, map) as the
                # store measures it, inside the graph or not.
                if reads["records_read"]:
                    per_record = reads["stall_seconds"] / reads["records_read"] * 1e6
            runs[name].append((tps, steps, per_record, reads))
    out = {}
    for name, results in runs.items():
        tps, steps, per_record, _ = sorted(results, key=lambda r: r[0])[len(results) // 2]
        out[name] = dict(tps=tps, steps_us=steps, stall_us_per_record=per_record,
                         runs_tps=[r[0] for r in results], runs_reads=[r[3] for r in results])
    return out


def run(args) -> dict:
    from ..runtime.loader import load

    args.out.mkdir(parents=True, exist_ok=True)
    policy = args.policy or DEFAULT_POLICY
    manifest = read_manifest(args.model)
    spec = manifest.layers[0]
    experts = max(spec.num_experts for spec in manifest.layers)
    paged, tok = load(args.model, slots_per_layer=experts, policy=policy)
    _force_paged(paged)
    timings = pieces(paged, args.repeats)
    resident, _ = load(args.model, slots_per_layer=experts)
    slots = max(spec.top_k, round(args.pool * experts))
    partial, _ = load(args.model, slots_per_layer=slots, policy=policy, overlap=False)
    # The reference path: route and ensure in Python (and the Python reader).
    # Synced calls run without their overlap here, so that the stall is
    # every read's whole cost (bench simulate models the overlap apart).
    python, _ = load(args.model, slots_per_layer=slots, policy=policy, io="python",
                     overlap=False)
    # Prefetch's path: a host sync per call for the ids and the next layer's
    # prediction, route and ensure in Python (the path of every call on a GPU).
    precision = {} if args.prefetch_precision is None else dict(
        prefetch_precision=args.prefetch_precision)
    prefetch, _ = load(args.model, slots_per_layer=slots, policy=policy,
                       prefetch="next-layer", overlap=False, **precision)
    cases = {"resident": resident, "paged, all hits": paged,
             f"paged, pool {args.pool:.0%}": partial,
             f"paged, pool {args.pool:.0%}, io=python": python,
             f"paged, pool {args.pool:.0%}, prefetch": prefetch}
    decode = in_decode(cases, tok, args.tokens, args.rounds)
    r = decode["resident"]["tps"]
    rows = [dict(piece=f"isolated: {k}", us=v) for k, v in timings.items()]
    for name in list(decode)[1:]:
        d = decode[name]
        rows += [dict(piece=f"{name}: {k.strip('_')}", us=v) for k, v in d["steps_us"].items()]
        rows.append(dict(piece=f"{name}: tok/s vs resident (paired rounds)",
                         us=paired_ratio(d["runs_tps"], decode["resident"]["runs_tps"])))
    result = dict(rows=rows, pieces=timings, decode=decode, moe_layers=len(manifest.layers),
                  policy=policy, model=str(args.model), pool=args.pool)
    title = (f"bench overhead: microseconds per paged MoE call ({policy}); resident "
             f"{r:.0f} tok/s")
    return finish(args.out, "overhead", result, rows,
                  [("piece", "piece", "s"), ("us", "us (ratio for vs rows)", ".2f")],
                  title, _plot)


def _force_paged(model):
    """Turn a resident model's blocks paged, with the store and residency
    the loader would choose for a paged pool: the pool holds every expert
    in the slot of its id, so every lookup hits and nothing is read."""
    from ..runtime.residency import choose_path, make_paged, make_store
    from ..runtime.wrap import one_pass_at_a_time

    runtime = model.streaming
    if runtime.residencies:
        return
    runtime.paged = True
    runtime.path = choose_path(runtime)
    for _, module in model.named_modules():
        residency = getattr(module, "residency", None)
        if residency is None:
            continue
        i, old = next((i, s) for i, s in enumerate(runtime.stores)
                      if s.layer == residency.layer)
        store = make_store(old.spec, old.pool, old.source, old.policy, runtime)
        runtime.stores[i] = store
        module.residency = make_paged(store, runtime)
    # Calls as a loaded paged model makes them (the lock, the pending
    # readers evaluated at the end of each).
    one_pass_at_a_time(model, runtime)


def _plot(rows, path, title):
    plt = figure()
    fig, ax = plt.subplots(figsize=(8, 5))
    shown = [r for r in rows if "vs resident" not in r["piece"]]
    ax.barh([r["piece"] for r in shown], [r["us"] for r in shown])
    ax.set_xlabel("microseconds per call")
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
