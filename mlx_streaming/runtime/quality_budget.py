"""A quality budget instead of knobs (``routing_max_ppl``): cache-aware routing's
settings chosen by a short ``bench quality`` calibration, cached per model, pool
and budget."""

import json
import subprocess
import sys
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from typing import List

from ..errors import ConfigError
from ..format import Manifest

# Tokens of held-out text per candidate: a stable perplexity, seconds each.
CALIBRATION_TOKENS = 256


# Bonuses tried with keep 1 (docs/design.md, "runtime/quality_budget.py").
BONUSES = (0.25, 0.5)


def candidates(top_k: int, num_experts: int) -> List[str]:
    """The ``bench quality`` settings to try: keep, window, and a residency bonus."""
    windows = sorted({min(num_experts, 2 * top_k), min(num_experts, 4 * top_k)})
    plain = [f"cache-aware:{keep}:{window}" for keep in range(1, top_k) for window in windows]
    return plain + [f"cache-aware:1:{windows[0]}:{b:g}" for b in BONUSES]


# Part of a choice's file name: choices made before cache-aware routing's defaults
# changed (a bonus left unset meant resident first) are not read back.
CHOICE_VERSION = 2


def choice_path(cache_dir: Path, identity: int, slots: int, max_ppl: float) -> Path:
    name = f"{identity:08x}-s{slots}-p{max_ppl:g}-v{CHOICE_VERSION}.json"
    return Path(cache_dir) / "routing-budget" / name


def resolve(path: Path, manifest: Manifest, config, slots: int, identity: int,
            cache_dir: Path):
    """``config`` with the cheapest settings (bytes read) whose perplexity change
    the budget allows, else exact; says what it chose. ConfigError if it fails."""
    spec = manifest.layers[0]
    cached = choice_path(cache_dir, identity, slots, config.routing_max_ppl)
    if cached.is_file():
        choice = json.loads(cached.read_text())
        how = f"cached in {cached}"
    else:
        choice = _calibrate(path, spec, slots, config.routing_max_ppl)
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(choice))
        how = f"measured on {CALIBRATION_TOKENS} tokens of held-out text"
    keep, window, bonus = choice["keep"], choice["window"], choice["bonus"]
    also = ", routing_bonus default" if bonus is None else f", routing_bonus={bonus:g}"
    warnings.warn(
        f"mlx_streaming: routing_max_ppl={config.routing_max_ppl:g}: chose routing_keep={keep}, "
        f"routing_window={window}{also} at {slots} slots per layer (perplexity "
        f"{choice['ppl_change']:+.2%} against exact, {choice['mb_per_token']:.3g} MB read per "
        f"token against {choice['exact_mb_per_token']:.3g}; {how})", UserWarning, stacklevel=5)
    return replace(config, routing_max_ppl=None, routing_keep=keep, routing_window=window,
                   routing_bonus=bonus)


def _calibrate(path: Path, spec, slots: int, max_ppl: float) -> dict:
    settings = candidates(spec.top_k, spec.num_experts)
    with tempfile.TemporaryDirectory(prefix="mlx-streaming-budget-") as out:
        cmd = [sys.executable, "-m", "mlx_streaming.bench", "quality", "--model", str(path),
               "--tokens", str(CALIBRATION_TOKENS), "--pool", repr(slots / spec.num_experts),
               "--settings", ",".join(settings), "--out", out]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        result = Path(out) / "quality.json"
        if proc.returncode != 0 or not result.is_file():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ConfigError(f"routing_max_ppl: the calibration failed ({last}); choose "
                              "routing_keep and routing_window yourself (bench quality)")
        rows = json.loads(result.read_text())["rows"]
    exact, tried = rows[0], rows[1:]
    fits = [r for r in tried if r.get("ppl_change") is not None
            and r["ppl_change"] <= max_ppl]
    best = min(fits, key=lambda r: r["mb_per_token"]) if fits else None
    values = best["setting"].split(":")[1:] if best else [spec.top_k, 2 * spec.top_k]
    return dict(keep=int(values[0]), window=int(values[1]),
                bonus=float(values[2]) if len(values) > 2 else None, ppl_change=best["ppl_change"] if best else 0.0,
                mb_per_token=(best or exact)["mb_per_token"],
                exact_mb_per_token=exact["mb_per_token"],
                tried={r["setting"]: [r.get("ppl_change"), r.get("mb_per_token")]
                       for r in tried})
