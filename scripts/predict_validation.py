"""predict's speed model against published measurements of exact
expert-streaming runtimes on real Macs (mlx_streaming/predict/data/
published.json): builds each model as a sparse repo (its real shapes, no
weights), fits the two free parameters on the rows named by --fit, and
prints the table docs/predict.md shows (the other rows out of sample).

    python scripts/predict_validation.py [--fit 2,1] [--policy lru]
"""

import argparse
import itertools
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlx_streaming.predict.curves import builtin_curve
from mlx_streaming.predict.headers import read_model
from mlx_streaming.predict.machines import machine
from mlx_streaming.predict.plan import whole_budget_fit
from mlx_streaming.predict.shape import model_shape
from mlx_streaming.predict.speed import SpeedModel, forecast
from mlx_streaming.testing.sparse_repo import write_sparse_repo

DATA = Path(__file__).parent.parent / "mlx_streaming" / "predict" / "data" / "published.json"


def cases(data, root: Path, policy: str):
    """(row, shape, machine, slots) of each published row."""
    shapes = {}
    for name, m in data["models"].items():
        write_sparse_repo(root / name, m["config"])
        shapes[name] = model_shape(read_model(str(root / name)))
    curve = builtin_curve(policy)
    for row in data["rows"]:
        shape, mac = shapes[row["model"]], machine(row["machine"])
        if "budget_gb" in row:
            counts = row["budget_counts"]
            slots = whole_budget_fit(shape, mac, row["budget_gb"], counts["context"],
                                     counts["headroom_gb"]).plan.slots
        else:
            slots = max(shape.top_k, round(row["resident"] * shape.experts))
        yield row, shape, mac, slots, curve


def measured_runtime(shape, mac, slots, curve, model: SpeedModel):
    """The forecast of the runtimes measured: they page every call, even
    with every expert resident."""
    return forecast(shape, mac, slots, curve, model, paged=True)


def error(cases, model: SpeedModel, rows) -> float:
    return sum(math.log(measured_runtime(s, m, n, c, model).tok_s / r["published_tok_s"]) ** 2
               for i, (r, s, m, n, c) in enumerate(cases) if i in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fit", default="1,2,3",
                   help="row numbers (0-based) the parameters are fitted on, or 'none' to "
                        "check predict/speed.py's own parameters")
    p.add_argument("--policy", default="lru", help="the runtimes measured run LRU slots")
    p.add_argument("--json", type=Path, help="also write the table here")
    args = p.parse_args()
    data = json.loads(DATA.read_text())
    fit_rows = set() if args.fit == "none" else {int(x) for x in args.fit.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        all_cases = list(cases(data, Path(tmp), args.policy))
    shares = [x / 100 for x in range(30, 101)]
    calls = [x * 10e-6 for x in range(0, 61)]
    best = min((SpeedModel(s, c) for s, c in itertools.product(shares, calls)),
               key=lambda m: error(all_cases, m, fit_rows)) if fit_rows else SpeedModel()
    print(f"{'fitted on rows ' + str(sorted(fit_rows)) if fit_rows else 'predict/speed.py'}: "
          f"bandwidth share {best.bandwidth_share:.2f}, per-call cost {best.call_s * 1e6:.0f} us")
    print("| model | machine | budget | resident | published tok/s | forecast (band) | ratio | "
          "row |")
    print("|---|---|---|---|---|---|---|---|")
    table = []
    for i, (row, shape, mac, slots, curve) in enumerate(all_cases):
        f = measured_runtime(shape, mac, slots, curve, best)
        ratio = f.tok_s / row["published_tok_s"]
        budget = f"{row['budget_gb']} GB" if "budget_gb" in row else "-"
        print(f"| {row['model']} | {mac.name} | {budget} | {f.resident:.1%} | "
              f"{row['published_tok_s']} | {f.tok_s:.1f} ({f.band[0]:.1f}-{f.band[1]:.1f}) | "
              f"{ratio:.2f} | {'fit' if i in fit_rows else 'out of sample'} |")
        table.append(dict(row, forecast=f.report(), ratio=ratio, fitted=i in fit_rows))
    if args.json:
        args.json.write_text(json.dumps(dict(bandwidth_share=best.bandwidth_share,
                                             call_s=best.call_s, rows=table), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
