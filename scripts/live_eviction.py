"""Misses of eviction policies in live greedy generations: several prompts,
through one pool kept across them (as a server keeps it) and each from an
empty pool, at several pool sizes; prefetch off. For each set it reports
each policy's misses (``stats()``), the sum of the better of LRU and
decayed LFU taken generation by generation, and the adaptive policy's
ratio to that sum and its worst ratio on one generation.

    python scripts/live_eviction.py --model MODEL/stream --pools 0.25,0.5 --prompts 4 --tokens 256
"""

import argparse
import json
import sys
from pathlib import Path

ARMS = ("lru", "lfu-decay")


def prompts(tokenizer, n: int, length: int = 48) -> list:
    """``n`` prompts of ``length`` tokens, each from another file of the
    corpus the test models were trained on, taken from its end."""
    from mlx_streaming.testing.tiny import corpus_files

    files = corpus_files()[::-1]
    out = []
    for path in files:
        ids = tokenizer.encode(path.read_text(errors="replace")[-4000:])
        if len(ids) >= length:
            out.append(ids[-length:])
        if len(out) == n:
            return out
    raise SystemExit(f"found only {len(out)} prompts of {length} tokens")


def generation_misses(model, tokenizer, prompt, tokens: int) -> int:
    import mlx_lm

    import mlx_streaming

    mlx_streaming.reset_stats(model)
    mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=tokens,
                    prefill_step_size=model.streaming.plan.prefill_step)
    return mlx_streaming.stats(model)["total"]["misses"]


def run_policy(model_dir, policy, slots, texts, tokens, shared: bool) -> list:
    import mlx_streaming

    misses, model = [], None
    for prompt in texts:
        if model is None:
            model, tokenizer = mlx_streaming.load(model_dir, slots_per_layer=slots,
                                                  policy=policy, prefetch="off")
        misses.append(generation_misses(model, tokenizer, prompt, tokens))
        if not shared:
            model.streaming.close()
            model = None
    if model is not None:
        model.streaming.close()
    return misses


def summary(rows: dict) -> dict:
    better = [min(a, b) for a, b in zip(*(rows[arm] for arm in ARMS))]
    out = {"better_arm_sum": sum(better)}
    for policy, misses in rows.items():
        out[policy] = {"misses": sum(misses), "per_generation": misses,
                       "vs_better_arm": sum(misses) / max(sum(better), 1),
                       "worst_generation": max(m / max(b, 1) for m, b in zip(misses, better))}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="stream directory (learned routing)")
    p.add_argument("--pools", default="0.25,0.5", help="fractions of each layer's experts")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--policies", default="lfu-decay,lru,adaptive")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    import mlx_streaming
    from mlx_streaming.format import read_manifest

    experts = read_manifest(args.model).layers[0].num_experts
    _, tokenizer = mlx_streaming.load(args.model, slots_per_layer=experts, lazy=True)
    texts = prompts(tokenizer, args.prompts)
    results = []
    for pool in map(float, args.pools.split(",")):
        slots = max(1, round(pool * experts))
        for shared in (True, False):
            rows = {policy: run_policy(args.model, policy, slots, texts, args.tokens, shared)
                    for policy in args.policies.split(",")}
            s = summary(rows)
            results.append(dict(pool=pool, slots=slots, shared=shared, **s))
            line = ", ".join(f"{k} {v['misses']}" for k, v in s.items() if isinstance(v, dict))
            a = s.get("adaptive")
            print(f"pool {pool:.0%} ({slots} slots), {'one pool' if shared else 'from empty'}: "
                  f"{line}; better arm by generation {s['better_arm_sum']}"
                  + (f"; adaptive {a['vs_better_arm']:.3f}x of it, worst generation "
                     f"{a['worst_generation']:.3f}x" if a else ""), flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(model=args.model, prompts=args.prompts,
                                             tokens=args.tokens, results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
