"""bench overhead: where the time of one paged MoE call goes.

A paged layer pays, per call, what a resident one does not: one host sync,
the numpy work of turning ids into slots, the policy, the counters, a new
table and the graph of the remap. This loads the model with a pool that
holds every expert (every lookup hits, nothing is read) and times, on a
real layer and input, each piece in a loop of ``--repeats`` calls:

  sync          mx.eval of the router's ids for a fresh input (the sync
                itself: a hand-off to the compute thread and back)
  to_numpy      the ids as a numpy array
  bookkeeping   distinct experts, hit count, policy, stats events, ensure
  graph         building the expert call's graph with the remapped ids
  paged call    the whole paged call, evaluated
  resident call mlx-lm's own expert call on the same input, evaluated

and then the decode tok/s of the model resident and paged (all hits) in the
same process, interleaved, whose difference per call is the overhead as
decode sees it.
"""

import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..discover import find_router, input_dims_of
from ..format import read_manifest
from ..pool import distinct
from .common import finish, figure, prompt_tokens

PIECES = ("sync", "to_numpy", "bookkeeping", "graph", "paged_call", "resident_call")


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="stream directory")
    p.add_argument("--repeats", type=int, default=2000, help="calls per timed piece")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved decode rounds")
    p.add_argument("--policy", default="lru")
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
    ids = np.array(indices)

    def sync():
        mx.eval(route(x))

    def to_numpy():
        np.array(indices)

    def bookkeeping():
        experts = distinct(ids)
        hits = int(np.count_nonzero(store.pool.slot_of_expert[ids] >= 0))
        paged.events.on_paged_call(paged.layer, 1, ids, experts, hits, None)
        store.policy.observe(experts, ids.reshape(-1, k), None)
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


def _decode_tps(model, tokenizer, tokens: int) -> float:
    from mlx_lm.generate import generate_step

    prompt = mx.array(prompt_tokens(tokenizer, 16))
    steps = generate_step(prompt, model, max_tokens=tokens + 2,
                          sampler=lambda l: mx.argmax(l, axis=-1))
    next(steps)
    next(steps)
    start = time.perf_counter()
    n = sum(1 for _ in steps)
    return n / (time.perf_counter() - start)


def run(args) -> dict:
    from ..loader import load

    args.out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(args.model)
    experts = max(l.num_experts for l in manifest.layers)
    paged, tok = load(args.model, slots_per_layer=experts, policy=args.policy)
    _force_paged(paged)
    timings = pieces(paged, args.repeats)
    resident, _ = load(args.model, slots_per_layer=experts)
    layers = len(manifest.layers)
    tps = {"resident": [], "paged": []}
    for _ in range(args.rounds):
        for name, model in (("resident", resident), ("paged", paged)):
            tps[name].append(_decode_tps(model, tok, args.tokens))
    r, p = float(np.median(tps["resident"])), float(np.median(tps["paged"]))
    per_call = (1 / p - 1 / r) / layers * 1e6
    rows = [dict(piece=k, us=v) for k, v in timings.items()]
    rows.append(dict(piece="decode: resident tok/s", us=r))
    rows.append(dict(piece="decode: paged tok/s", us=p))
    rows.append(dict(piece="decode: overhead per call (us)", us=per_call))
    result = dict(rows=rows, pieces=timings, resident_tps=r, paged_tps=p,
                  overhead_us_per_call=per_call, paged_vs_resident=p / r,
                  moe_layers=layers, policy=args.policy, model=str(args.model))
    title = (f"bench overhead: microseconds per paged MoE call ({args.policy}); "
             f"paged decode {p / r:.2f}x of resident")
    return finish(args.out, "overhead", result, rows,
                  [("piece", "piece", "s"), ("us", "us (or tok/s)", ".1f")], title, _plot)


def _force_paged(model):
    """Turn a resident model's blocks paged: the pool holds every expert in
    the slot of its id, so every lookup hits and nothing is read."""
    from ..block import Paged

    runtime = model.streaming
    if runtime.residencies:
        return
    for _, module in model.named_modules():
        residency = getattr(module, "residency", None)
        if residency is None:
            continue
        store = next(s for s in runtime.stores if s.layer == residency.layer)
        paged = Paged(store, runtime.events)
        module.residency = paged
        runtime.residencies.append(paged)
    runtime.paged = True


def _plot(rows, path, title):
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["piece"] for r in rows if r["piece"] in PIECES]
    ax.barh(names, [r["us"] for r in rows if r["piece"] in PIECES])
    ax.set_xlabel("microseconds per call")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
