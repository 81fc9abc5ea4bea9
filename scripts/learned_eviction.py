"""Can a learned predictor of reuse evict better than decayed LFU?

    python scripts/learned_eviction.py TRACE [TRACE ...] [--pools 0.25,0.5]

TRACE is a routing trace that ``bench cache`` recorded
(``routing-trace-w4.jsonl`` in its output directory). For each layer, a
predictor is fitted on the first half of the calls and the cache is scored
on the second half (hits counted there only, every policy run over the
whole trace): a ridge regression and a small MLP (numpy, 32 hidden units),
both on what an online policy can know of each expert after a call: its
use counts decayed at half-lives 1 to 128 calls, the log of the calls since
its last use, the router's probability for it in this call and a decayed
mean of that. The target is its discounted use over the next 8 calls
(0.7 per call); the cache keeps the experts predicted highest. LRU, decayed
LFU (the default), the next-call oracle and Belady are scored alike.

An experiment, not a shipped policy: it answers whether features an online
policy sees hold more than decayed counts do (README, cache policies).
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_streaming.bench.cache import Belady, Lookahead, decode_records, replay_misses  # noqa: E402
from mlx_streaming.runtime.policy import LRU, DecayedLFU, Policy  # noqa: E402

HALF_LIVES = (1, 2, 4, 8, 16, 32, 64, 128)
HORIZON = 8
DISCOUNT = 0.7


def features(calls, num_experts: int) -> np.ndarray:
    """[call, expert, feature]: what is known of each expert after each call."""
    counts = np.zeros((len(HALF_LIVES), num_experts))
    decays = 0.5 ** (1 / np.array(HALF_LIVES))[:, None]
    mean_prob = np.zeros(num_experts)
    last = np.full(num_experts, -1e3)
    out = np.zeros((len(calls), num_experts, len(HALF_LIVES) + 4))
    for t, call in enumerate(calls):
        counts *= decays
        counts[:, call.experts] += 1
        prob = call.probs[0] if call.probs is not None else np.zeros(num_experts)
        mean_prob = 0.8 * mean_prob + 0.2 * prob
        last[call.experts] = t
        out[t, :, : len(HALF_LIVES)] = counts.T
        out[t, :, -4] = np.log1p(t - last)
        out[t, :, -3] = prob
        out[t, :, -2] = mean_prob
        out[t, :, -1] = 1.0
    return out


def targets(calls, num_experts: int) -> np.ndarray:
    """[call, expert]: discounted use over the next ``HORIZON`` calls."""
    used = np.zeros((len(calls), num_experts))
    for t, call in enumerate(calls):
        used[t, call.experts] = 1
    y = np.zeros_like(used)
    for d in range(1, HORIZON + 1):
        y[:-d] += DISCOUNT ** (d - 1) * used[d:]
    return y


def fit_ridge(x, y):
    w = np.linalg.solve(x.T @ x + 1e-3 * np.eye(x.shape[1]), x.T @ y)
    return lambda f: f @ w


def fit_mlp(x, y, hidden=32, steps=3000, lr=3e-3, seed=0):
    """A one-hidden-layer ReLU network, squared error, Adam."""
    rng = np.random.default_rng(seed)
    mu, sd = x.mean(0), x.std(0) + 1e-6
    xn = (x - mu) / sd
    params = [rng.normal(0, x.shape[1] ** -0.5, (x.shape[1], hidden)), np.zeros(hidden),
              rng.normal(0, hidden ** -0.5, hidden), np.zeros(())]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for step in range(1, steps + 1):
        idx = rng.integers(0, len(xn), 1024)
        xb, yb = xn[idx], y[idx]
        h = np.maximum(xb @ params[0] + params[1], 0)
        g = 2 * (h @ params[2] + params[3] - yb) / len(yb)
        gh = np.outer(g, params[2]) * (h > 0)
        grads = [xb.T @ gh, gh.sum(0), h.T @ g, g.sum()]
        for i, grad in enumerate(grads):
            m[i] = 0.9 * m[i] + 0.1 * grad
            v[i] = 0.999 * v[i] + 0.001 * grad * grad
            params[i] = params[i] - lr * (m[i] / (1 - 0.9 ** step)) / (
                np.sqrt(v[i] / (1 - 0.999 ** step)) + 1e-8)
    return lambda f: np.maximum(((f - mu) / sd) @ params[0] + params[1], 0) @ params[2] + params[3]


class Predicted(Policy):
    """Keep the experts whose predicted reuse is highest."""

    def __init__(self, num_experts, predict, feats):
        super().__init__(num_experts)
        self.predict, self.feats, self.t = predict, feats, -1
        self.name = "learned"

    def observe(self, experts, ids, probs=None):
        super().observe(experts, ids, probs)
        self.t += 1

    def keep_score(self):
        # The last entry stands for an empty slot: it goes first.
        return np.concatenate([self.predict(self.feats[self.t]), [-np.inf]])


def second_half_hit_rate(calls, capacity, policy) -> float:
    misses = replay_misses(calls, capacity, policy)
    half = len(calls) // 2
    total = sum(c.ids.size for c in calls[half:])
    missed = sum(int(np.isin(c.ids, m).sum()) for c, m in zip(calls[half:], misses[half:]))
    return 1 - missed / total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--pools", default="0.25,0.5")
    args = p.parse_args(argv)
    for trace in args.traces:
        layers = decode_records(trace)
        num_experts = 1 + max(int(c.experts.max()) for cs in layers.values() for c in cs)
        feats, xs, ys = {}, [], []
        for layer, calls in layers.items():
            feats[layer] = features(calls, num_experts)
            half = len(calls) // 2 - HORIZON
            xs.append(feats[layer][:half].reshape(-1, feats[layer].shape[-1]))
            ys.append(targets(calls, num_experts)[:half].reshape(-1))
        x, y = np.concatenate(xs), np.concatenate(ys)
        predictors = {"ridge": fit_ridge(x, y), "mlp": fit_mlp(x, y)}
        print(f"{trace}: {len(layers)} layers, {num_experts} experts, "
              f"{len(next(iter(layers.values())))} calls per layer")
        for pool in (float(f) for f in args.pools.split(",")):
            capacity = max(1, int(round(pool * num_experts)))
            policies = {
                "lru": lambda calls, layer: LRU(num_experts),
                "lfu-decay32": lambda calls, layer: DecayedLFU(num_experts, 32),
                **{name: (lambda calls, layer, f=f: Predicted(num_experts, f, feats[layer]))
                   for name, f in predictors.items()},
                "lookahead1": lambda calls, layer: Lookahead(calls, num_experts, 1),
                "belady": lambda calls, layer: Belady(calls, num_experts),
            }
            rates = {name: np.mean([second_half_hit_rate(calls, capacity, make(calls, layer))
                                    for layer, calls in layers.items()])
                     for name, make in policies.items()}
            print(f"  pool {pool:g} ({capacity} slots), hit % on the second half: " +
                  ", ".join(f"{name} {100 * r:.1f}" for name, r in rates.items()))


if __name__ == "__main__":
    main()
