"""What a benchmark writes: JSON results, a printed table and a plot."""

import json
from pathlib import Path
from typing import List, Sequence

import numpy as np

from .inputs import BenchError


def save_json(path: Path, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=_jsonable))
    return path


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"cannot write {type(x).__name__} as JSON")


def fmt(value, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return format(value, spec)


def print_table(rows: List[dict], columns: Sequence[tuple], title: str = "") -> str:
    """Print ``rows`` with ``columns`` = (key, header[, format spec])."""
    cells = [[h for _, h, *_ in columns]]
    for r in rows:
        cells.append([fmt(r.get(c[0]), *(c[2:] or [".3g"])) for c in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    text = (title + "\n" if title else "") + "\n".join(lines)
    print(text, flush=True)
    return text


def finish(out: Path, name: str, result: dict, rows, columns, title: str, plot) -> dict:
    """Print the table, write ``name``.json and ``name``.png into ``out``."""
    result["table"] = print_table(rows, columns, title)
    save_json(Path(out) / f"{name}.json", result)
    plot(rows, Path(out) / f"{name}.png", title)
    return result


def figure():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("plots need matplotlib: pip install 'mlx_streaming[bench]'") from None
    return plt
