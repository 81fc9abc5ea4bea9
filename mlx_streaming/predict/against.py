"""Where a measured decode speed fell against a forecast's band: the
forecast is ``predict --json``'s output, given to ``generate --forecast``
or ``bench decode --forecast`` after the run."""

import json
from typing import Optional

from ..errors import ConfigError


def read_forecast(path: str) -> dict:
    """``predict --json``'s output, read before a run so a wrong file is
    known before the model loads.

    Raises:
        ConfigError: not a forecast of a model that fits.
    """
    try:
        with open(path) as file:
            f = json.load(file)
        band = [float(x) for x in f["decode_tok_s_band"]]
        if len(band) != 2 or not f["fits"] or not float(f["decode_tok_s"]) > 0:
            raise ValueError("no decode forecast")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--forecast {path} is not `mlx_streaming predict --json` output of "
                          f"a model that fits ({type(e).__name__}); write one with predict "
                          "--json > FILE") from None
    return f


def against(forecast: dict, measured_tok_s: float, slots_per_layer: Optional[int]) -> dict:
    """The measured speed against the forecast: its ratio, and inside,
    below or above the band."""
    low, high = forecast["decode_tok_s_band"]
    where = ("below the band" if measured_tok_s < low else
             "above the band" if measured_tok_s > high else "inside the band")
    return dict(forecast_tok_s=forecast["decode_tok_s"], band=[low, high],
                measured_tok_s=measured_tok_s,
                ratio=measured_tok_s / forecast["decode_tok_s"], where=where,
                forecast_machine=forecast["machine"],
                same_slots=slots_per_layer == forecast["slots_per_layer"])


def describe(a: dict) -> str:
    slots = "" if a["same_slots"] else " (the run had other slots per layer than the forecast)"
    return (f"forecast {a['forecast_tok_s']:.1f} tok/s (band {a['band'][0]:.1f}-"
            f"{a['band'][1]:.1f}, {a['forecast_machine']}); measured {a['measured_tok_s']:.1f} "
            f"tok/s: {a['ratio']:.2f} x, {a['where']}{slots}")
