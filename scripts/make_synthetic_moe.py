"""Make a synthetic MoE model of a chosen family and size, one layer at a
time, so a model of tens of GB is made on a machine with less memory.

    python scripts/make_synthetic_moe.py --out DIR --format stream \
        --hidden-size 2048 --layers 32 --experts 128 --top-k 8 --moe-intermediate 768

--format mlx-lm writes an mlx-lm model directory instead (which mlx-lm loads
and `mlx_streaming convert` converts into the same stream directory). The
weights are random 4-bit codes with float32 scales: the routing is that of a
random model, which the benchmarks report next to every number.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_streaming.testing import synthetic, tiny  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--format", choices=["stream", "mlx-lm"], default="stream")
    p.add_argument("--family", default="qwen3_moe", choices=sorted(tiny.FAMILIES))
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--moe-intermediate", type=int, default=768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--shared-intermediate", type=int, default=None,
                   help="qwen2_moe: the shared expert's width (a wide spine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer directory (default: train one on local text)")
    args = p.parse_args(argv)

    if args.family not in ("qwen3_moe", "qwen2_moe"):
        raise SystemExit("only qwen3_moe and qwen2_moe sizes are exposed as flags; use "
                         "mlx_streaming.testing.synthetic.make_synthetic for other families")
    extra = {}
    if args.shared_intermediate is not None:
        if args.family != "qwen2_moe":
            raise SystemExit("--shared-intermediate needs --family qwen2_moe")
        extra["shared_expert_intermediate_size"] = args.shared_intermediate
    start = time.perf_counter()
    tok = args.tokenizer or tiny.train_tokenizer(args.out.parent / f"{args.out.name}-tokenizer",
                                                 args.vocab)
    from tqdm import tqdm

    # Stream directories: each layer's experts, then each layer's dense record.
    steps = args.layers * (2 if args.format == "stream" else 1)
    with tqdm(total=steps, unit="layer", file=sys.stderr) as bar:
        synthetic.make_synthetic(
            args.out, tok, family=args.family, fmt=args.format, seed=args.seed,
            progress=bar.update, hidden_size=args.hidden_size,
            num_hidden_layers=args.layers, num_experts=args.experts,
            num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            head_dim=args.hidden_size // args.heads, **extra,
        )
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out} ({size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
