"""How well prefetch's scores and ranks tell which predictions a layer will
use, offline, on a trained model's real routing (teacher-forced text).

    python scripts/prefetch_scores.py --model MODEL/mlx --tokens 400 --slots 8

For every MoE layer but the first, the prediction is made as prefetch
makes it: the layer's router applied to the previous layer's MoE input,
weighed by affinity (which experts followed the previous layer's choice so
far), normalised per token; with ``--distance 2``, to the input two layers
before and unweighed, as ``prefetch_depth=2`` reads ahead. Residency comes
from replaying the layer's routing through decayed LFU with --slots slots;
only predictions of experts not resident count, as only those are read.
Prints, per call, the records a rule reads ahead, how many of them the
layer used, and the share of its misses they caught, for the first N ranks
and for bars on the score (a prediction's share of the probability times
the number of experts), then how often predictions of each score were used.
"""

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_streaming.bench.cache import replay_misses  # noqa: E402
from mlx_streaming.runtime.policy import DecayedLFU  # noqa: E402

WARMUP = 32  # tokens before counting: the pool and the affinity fill first


class Recorder:
    """Wraps a layer's MoE block and keeps its input."""

    def __init__(self, block, sink: list):
        self.block = block
        self.sink = sink

    def __call__(self, x):
        self.sink.append(x.reshape(-1))
        return self.block(x)


def moe_inputs(model, ids) -> list:
    """Per layer, ``[tokens, hidden]``: each token's MoE input."""
    sinks = [[] for _ in model.model.layers]
    for layer, sink in zip(model.model.layers, sinks):
        layer.mlp = Recorder(layer.mlp, sink)
    cache = make_prompt_cache(model)
    for t in ids:
        mx.eval(model(mx.array([[t]]), cache=cache))
    for layer in model.model.layers:
        layer.mlp = layer.mlp.block
    return [mx.stack(s) for s in sinks]


def residency(routing: np.ndarray, experts: int, slots: int) -> list:
    """The experts resident before each call, under decayed LFU."""
    before = []
    replay_misses(list(routing), slots, DecayedLFU(experts, 32), resident=before)
    return before


def norm_ratio(model, i: int, j: int):
    """What turns layer i's MoE input into what layer j's norm would make
    of the same residual: the ratio of their RMSNorm weights."""
    layers = model.model.layers
    return layers[j].post_attention_layernorm.weight / \
        layers[i].post_attention_layernorm.weight


def candidates(model, xs, k: int, slots: int, width: int, rescale: bool = False,
               distance: int = 1):
    """Per (token, layer): [(score, used)] of the non-resident predictions
    of the layer ``distance`` layers on, best first; and the count of
    misses."""
    gates = [layer.mlp.gate for layer in model.model.layers]
    routed = [np.array(mx.argpartition(-g(x), k - 1, axis=-1)[:, :k]) for g, x in zip(gates, xs)]
    out, misses = [], 0
    for i in range(len(xs) - distance):
        j = i + distance
        x = xs[i] * norm_ratio(model, i, j) if rescale else xs[i]
        probs = np.array(mx.softmax(gates[j](x).astype(mx.float32), axis=-1))
        resident = residency(routed[j], probs.shape[-1], slots)
        counts = np.ones((probs.shape[-1], probs.shape[-1]), np.float32)
        for t in range(len(probs)):
            w = counts[routed[i][t]]
            # Two layers ahead the loader keeps no affinity: the router alone.
            p = probs[t] * (w / w.sum(-1, keepdims=True)).mean(0) if distance == 1 else probs[t]
            p /= p.sum()
            used = set(routed[j][t].tolist())
            ranked = np.argsort(-p, kind="stable")[:width]
            if t >= WARMUP:
                out.append([(p[e] * len(p), e in used) for e in ranked
                            if e not in resident[t]])
                misses += len(used - resident[t])
            for a in routed[i][t]:
                counts[a, routed[j][t]] += 1
    return out, misses


def report(rows, misses: int, budget: int) -> None:
    calls = len(rows)
    print(f"calls {calls}, misses per call {misses / calls:.2f}, at most {budget} read a call")
    print("rule           read/call  used/call  used share  misses caught")

    def line(name, chosen):
        read = sum(len(c) for c in chosen)
        used = sum(u for c in chosen for _, u in c)
        print(f"{name:14s} {read / calls:9.2f}  {used / calls:9.2f}  {used / max(read, 1):10.2f}"
              f"  {used / misses:13.2f}")

    for depth in range(1, budget + 1):
        line(f"first {depth} ranks", [c[:depth] for c in rows])
    for bar in (0.5, 1.0, 1.4, 2.0, 2.8, 4.0, 5.7, 8.0):
        line(f"score >= {bar}", [[x for x in c if x[0] >= bar][:budget] for c in rows])
    scores = np.array([s for c in rows for s, _ in c])
    used = np.array([u for c in rows for _, u in c])
    edges = [0, 0.5, 1, 2, 4, 8, np.inf]
    for lo, hi in zip(edges, edges[1:]):
        sel = (scores >= lo) & (scores < hi)
        share = f"{used[sel].mean():.2f}" if sel.any() else "-"
        print(f"score {lo:g}-{hi:g}: {sel.sum()} predictions, used {share}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an mlx-lm MoE model directory")
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--slots", type=int, default=8, help="pool slots per layer")
    p.add_argument("--budget", type=int, default=4, help="most records read ahead a call")
    p.add_argument("--norm-ratio", action="store_true",
                   help="scale the MoE input by the ratio of the two layers' norm weights "
                        "before the next router (untried on a real model)")
    p.add_argument("--distance", type=int, default=1,
                   help="predict the layer this many MoE layers on (2: prefetch_depth=2's "
                        "reads two layers ahead)")
    args = p.parse_args(argv)
    model, tokenizer = load(args.model)
    text = Path(argparse.__file__).read_text()[20000:60000]  # stdlib source, as trained on
    ids = tokenizer.encode(text)[: args.tokens]
    if len(ids) <= WARMUP:
        p.error(f"--tokens must exceed the {WARMUP} warm-up tokens")
    k = model.model.layers[0].mlp.top_k
    rows, misses = candidates(model, moe_inputs(model, ids), k, args.slots, 2 * k,
                              args.norm_ratio, args.distance)
    report(rows, misses, args.budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
