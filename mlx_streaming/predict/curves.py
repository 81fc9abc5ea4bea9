"""Hit-rate curves: the share of a token's experts already resident, as a
function of the share of each layer's experts the pools hold, per eviction
policy; replayed from a routing trace through the live policies.

The built-in curves (``data/hit-curves.json``) come from real routing:
OLMoE-1B-7B decoding 299 tokens (64 experts, top-8; github.com/sqliteai/warp,
Apache-2.0, see ``data/NOTICE.md``). A curve is carried to a model of E
experts and top-k by the resident fraction f, scaled by how much wider that
model's choice is: f' = f x ((E/k) / (64/8)) ** c. c = 0 keeps the fraction,
c = 1 keeps the slots per top-k; the forecast takes c = 1/2 and its band
spans 0 to 1 (docs/predict.md).

Regenerate the built-in curves with:
    python -m mlx_streaming.predict.curves --trace olmoe_299.jsonl \
        --out mlx_streaming/predict/data/hit-curves.json
"""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

import numpy as np

from ..errors import ConfigError
from ..runtime.policy import make_policy

BUILTIN = Path(__file__).parent / "data" / "hit-curves.json"
POLICIES = ("lru", "lfu-decay", "adaptive")
CARRY, CARRY_BAND = 0.5, (0.0, 1.0)
# Tokens that fill the empty pools and are not counted (as decode's warm-up).
WARMUP = 16


@dataclass(frozen=True)
class HitCurve:
    """Hit rate at resident fractions of one trace's model and policy."""

    name: str
    policy: str
    experts: int
    top_k: int
    fractions: Tuple[float, ...]
    hits: Tuple[float, ...]

    def hit_rate(self, fraction: float) -> float:
        """Linear between the replayed points, to 0 at an empty pool and 1
        at a whole one."""
        xs = (0.0,) + self.fractions + (1.0,)
        ys = (0.0,) + self.hits + (1.0,)
        return float(np.interp(min(1.0, max(0.0, fraction)), xs, ys))

    def carried(self, fraction: float, experts: int, top_k: int, carry: float = CARRY) -> float:
        """The hit rate of a model of ``experts`` and ``top_k`` at
        ``fraction`` resident (the module's docstring says how)."""
        if fraction >= 1:
            return 1.0
        scale = ((experts / top_k) / (self.experts / self.top_k)) ** carry
        return self.hit_rate(fraction * scale)


def builtin_curve(policy: str) -> HitCurve:
    data = json.loads(BUILTIN.read_text())
    if policy not in data["curves"]:
        raise ConfigError(f"no built-in hit curve for policy {policy!r}; one of "
                          f"{', '.join(data['curves'])} (or --trace a routing trace)")
    c = data["curves"][policy]
    return HitCurve(f"{data['name']} ({policy})", policy, data["experts"], data["top_k"],
                    tuple(c["fractions"]), tuple(c["hits"]))


def trace_curve(path: str, policy: str) -> HitCurve:
    """The curve of a routing trace (``bench trace``, the ``trace`` option,
    or the real-trace format), replayed through ``policy``.

    Raises:
        ConfigError: not a trace, or too short to replay.
    """
    from ..bench.cache import decode_records

    try:
        calls = decode_records(Path(path))
    except (ValueError, KeyError, TypeError, IndexError, OSError) as e:
        raise ConfigError(f"{path} is not a routing trace predict can read "
                          f"({type(e).__name__}); record one with the trace option") from None
    if not calls or min(len(s) for s in calls.values()) <= WARMUP:
        raise ConfigError(f"{path} holds too few decode tokens to replay (more than {WARMUP} "
                          "needed); record a longer one")
    return replay_curve(calls, policy, Path(path).name)


def replay_curve(calls: Dict[int, list], policy: str, name: str,
                 warmup: int = WARMUP) -> HitCurve:
    """Every layer's calls replayed at each pool size from top-k slots to
    all experts; hits count (token, expert) pairs after ``warmup`` tokens."""
    from ..bench.cache import replay_misses

    top_k = max(c.ids.shape[-1] for seq in calls.values() for c in seq)
    # All the router's experts where the trace has its probabilities (the
    # policies that weigh them need every one), else those routed to.
    experts = max([1 + int(c.experts.max()) for seq in calls.values() for c in seq]
                  + [c.probs.shape[-1] for seq in calls.values() for c in seq[:1]
                     if c.probs is not None])
    fractions, hits = [], []
    for slots in range(top_k, experts, max(1, top_k // 2)):
        hit = total = 0
        for seq in calls.values():
            missed = replay_misses(seq, slots, make_policy(policy, experts))
            for call, m in list(zip(seq, missed, strict=True))[warmup:]:
                total += call.ids.size
                hit += call.ids.size - int(np.isin(call.ids, m).sum())
        fractions.append(round(slots / experts, 4))
        hits.append(round(hit / total, 4))
    return HitCurve(f"{name} ({policy})", policy, experts, top_k, tuple(fractions), tuple(hits))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="replay a routing trace into predict's hit curves")
    p.add_argument("--trace", required=True, help="routing trace (real-trace format or ours)")
    p.add_argument("--name", default="OLMoE-1B-7B real routing (olmoe_299)")
    p.add_argument("--source", default="github.com/sqliteai/warp, tests/trace_olmoe_299.jsonl "
                                        "at commit 7f1fbba3")
    p.add_argument("--license", default="Apache-2.0 (copyright its authors); keep "
                                         "data/NOTICE.md with any copy")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    curves = {policy: trace_curve(args.trace, policy) for policy in POLICIES}
    first = next(iter(curves.values()))
    data = dict(name=args.name, source=args.source, license=args.license,
                notice="data/NOTICE.md", experts=first.experts,
                top_k=first.top_k, warmup_tokens=WARMUP,
                curves={p: dict(fractions=c.fractions, hits=c.hits) for p, c in curves.items()})
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
