"""What the benchmarks take in: their error, the options they compare,
pool sizes, prompts of real text, and the routing statistics of a trace."""

import argparse
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from ..config import (
    StreamConfig,
    add_option_flag,
    fields_by_name,
    flag_help,
    flag_value,
    percent,
)
from ..errors import ConfigError, StreamingError
from ..flags import flag_names, number
from ..runtime.trace import read_trace


class BenchError(StreamingError):
    """A benchmark cannot run as asked (permissions, platform, input)."""


def add_option_list_flag(p, name: str, *flags: str, note: Optional[str] = None) -> None:
    """A ``StreamConfig`` field's values to compare side by side, under
    ``flags`` (default ``--name``): comma-separated, as its flag spells
    them, each checked as load() checks it when parsed; its help the
    field's; the field's default alone when not given."""
    f = fields_by_name()[name]
    choices = f.metadata.get("choices")
    values = f"any of {', '.join(choices)}, " if choices else ""
    more = f"; {values}comma-separated to compare (default: {flag_value(f)})"
    p.add_argument(*flag_names(name, flags), type=option_values(name), default=[flag_value(f)],
                   help=flag_help(name, note, more))


def option_values(name: str):
    """An ``argparse`` type: a comma-separated list of values of the
    ``StreamConfig`` field ``name`` as its flag spells them, each checked
    as load() would check it."""
    meta = fields_by_name()[name].metadata
    choices = meta.get("choices")
    parse = percent if meta.get("parse") == "percent" else meta.get("type", str)

    def values(text: str) -> list:
        try:
            out = [parse(v) for v in text.split(",")]
            for v in out:
                if isinstance(choices, dict) and v not in choices:
                    raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {v!r}")
                StreamConfig(**{name: choices[v] if isinstance(choices, dict) else v})
        except (ValueError, argparse.ArgumentTypeError) as e:  # ConfigError is a ValueError
            raise argparse.ArgumentTypeError(f"must be values of {name}, comma-separated, got "
                                             f"{text!r}: {e}") from None
        return out

    return values


def pool_slots(spec, fraction: float) -> int:
    """Slots per layer for a pool of ``fraction`` of a layer's experts (at
    least one call's top-k)."""
    return max(spec.top_k, round(fraction * spec.num_experts))


def decode_calls(trace_path: Path) -> Dict[int, List[np.ndarray]]:
    """Each layer's decode calls (one token) in a routing trace: the sorted
    distinct experts of each."""
    calls: Dict[int, List[np.ndarray]] = {}
    for layer, ids in read_trace(str(trace_path)):
        if ids.shape[0] == 1:
            calls.setdefault(layer, []).append(np.unique(ids[0]))
    return calls


def routing_stats(trace_path: Path, top: int = 8) -> dict:
    """Temporal reuse and traffic concentration of decode calls in a trace.

    temporal_reuse: share of a token's experts the previous token also used.
    top8_share: share of routing traffic that goes to a layer's ``top`` most
    used experts.
    """
    layers = {}
    for layer, seq in decode_calls(trace_path).items():
        reuse = [len(np.intersect1d(a, b)) / len(b) for a, b in zip(seq, seq[1:])]
        counts = np.bincount(np.concatenate(seq))
        share = np.sort(counts)[::-1][:top].sum() / counts.sum()
        layers[layer] = {"temporal_reuse": float(np.mean(reuse)) if reuse else None,
                         "top8_share": float(share), "decode_calls": len(seq)}
    values = [v for v in layers.values() if v["temporal_reuse"] is not None]
    return {
        "temporal_reuse": float(np.mean([v["temporal_reuse"] for v in values])) if values else None,
        "top8_share": float(np.mean([v["top8_share"] for v in values])) if values else None,
        "layers": layers,
    }


def prompt_tokens(tokenizer, n: int, seed: int = 0) -> List[int]:
    """``n`` tokens of real text (the Python standard library) as a prompt."""
    from ..testing.tiny import corpus_text

    text = corpus_text(max(4 * n, 20_000) * 4)
    ids = tokenizer.encode(text)
    start = (seed * 997) % max(1, len(ids) - n)
    if len(ids) < n:
        raise BenchError(f"not enough local text for a {n}-token prompt")
    return ids[start : start + n]


def add_read_rate_flags(p, whose: str, pace: bool = True) -> None:
    """The two ways a benchmark emulates a slower disk: a cgroup throttle of
    ``whose`` reads (a measurement setting, not a ``load()`` option) and, with
    ``pace``, the reader's own pace (the ``read_pace_mbps`` option)."""
    p.add_argument("--read-mbps", type=number(0, open_low=True), default=None,
                   help=f"throttle {whose} disk reads to this many MB/s (cgroup v1 blkio, root; "
                        "reads uncached; measurement only): a Mac's read/compute ratio on a "
                        "fast disk")
    if pace:
        add_option_flag(p, "read_pace_mbps", "--pace-mbps", "--read-pace-mbps")
