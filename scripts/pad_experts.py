"""Widen the experts of a trained 4-bit SwitchGLU model without changing
what it computes, to make a learned-routing model whose experts are large
(a read-bound benchmark case).

    python scripts/pad_experts.py --model MODEL/mlx --out MODEL-wide --intermediate 16384

Each expert's intermediate width grows from I to --intermediate: the new
gate/up rows and down-projection columns are quantized zeros (scale 0,
bias 0), so every added unit contributes exactly 0 and the routing is the
trained model's. Writes OUT/mlx (mlx-lm) and OUT/stream.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_streaming.conversion.local import convert  # noqa: E402

EXPERTS = ".mlp.switch_mlp."


def pad(name: str, a: mx.array, old: int, new: int, group: int, bits: int) -> mx.array:
    """Zero-pad one tensor of a quantized SwitchGLU projection."""
    per_word = 32 // bits
    if "gate_proj" in name or "up_proj" in name:  # [E, I, ...]: more rows
        extra = [(0, 0), (0, new - old)] + [(0, 0)] * (a.ndim - 2)
    else:  # down_proj [E, H, I / per_word or I / group]: more columns
        unit = per_word if name.endswith("weight") else group
        extra = [(0, 0)] * (a.ndim - 1) + [(0, (new - old) // unit)]
    return mx.pad(a, extra)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="4-bit mlx-lm model with SwitchGLU experts")
    p.add_argument("--out", required=True)
    p.add_argument("--intermediate", type=int, default=16384)
    args = p.parse_args(argv)
    src, out = Path(args.model), Path(args.out)
    config = json.loads((src / "config.json").read_text())
    q = config["quantization"]
    old = config["moe_intermediate_size"]
    if args.intermediate % q["group_size"] or args.intermediate <= old:
        raise SystemExit(f"--intermediate must exceed {old} and be a multiple of "
                         f"{q['group_size']}")
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    for k, v in weights.items():
        if EXPERTS in k:
            weights[k] = pad(k, v, old, args.intermediate, q["group_size"], q["bits"])
    dst = out / "mlx"
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    config["moe_intermediate_size"] = args.intermediate
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, dst / f.name)
    shutil.rmtree(out / "stream", ignore_errors=True)
    convert(dst, out / "stream", progress=False)
    print(f"wrote {dst} and {out / 'stream'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
