"""How many distinct experts does a decode step of B sequences need per
layer, against B times top-k and against what independent routing would
give? Streams of a held-out text are decoded together (teacher-forced, the
whole pool resident so routing is the router's own) with the routing trace
on; each call's union is counted.

    python scripts/batch_union.py --model MODEL/stream --tokens 1536 --batch 1,2,4,8
"""

import argparse
import json
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np


def unions(model_dir: str, text: str, tokens: int, batch: int) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_streaming
    from mlx_streaming.format import read_manifest
    from mlx_streaming.runtime.trace import read_trace

    spec = read_manifest(model_dir).layers[0]
    with tempfile.TemporaryDirectory() as tmp:
        trace = str(Path(tmp) / "trace.jsonl")
        model, tokenizer = mlx_streaming.load(model_dir, slots_per_layer=spec.num_experts,
                                              trace=trace)
        ids = tokenizer.encode(text)[:tokens]
        length = len(ids) // batch
        if length < 2:
            raise SystemExit(f"error: {len(ids)} tokens cannot make {batch} streams of 2")
        streams = np.array(ids[: batch * length]).reshape(batch, length)
        cache = make_prompt_cache(model)
        for i in range(length - 1):
            mx.eval(model(mx.array(streams[:, i : i + 1]), cache=cache))
        model.streaming.close()
        calls = [np.asarray(routed).reshape(-1, spec.top_k) for _, routed in read_trace(trace)]
    sizes = [len(np.unique(c)) for c in calls]
    # Independent streams with the measured popularity of each expert.
    counts = np.bincount(np.concatenate([c.reshape(-1) for c in calls]),
                         minlength=spec.num_experts)
    p = counts / counts.sum() * spec.top_k  # chance a token routes to each expert
    e, k = spec.num_experts, spec.top_k
    return dict(batch=batch, union=float(np.mean(sizes)), picks=batch * k,
                uniform=e * (1 - (1 - k / e) ** batch),
                popularity=float(np.sum(1 - (1 - np.minimum(p, 1)) ** batch)))


def main():
    from mlx_streaming.flags import MAX_TOKENS, count, existing_file, listed

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="stream directory")
    p.add_argument("--text", type=existing_file,
                   help="a text file (default: the held-out text of bench quality)")
    p.add_argument("--tokens", type=count(2, MAX_TOKENS), default=1536)
    p.add_argument("--batch", type=listed(count(1, 64)), default="1,2,4,8",
                   help="batch sizes, comma-separated")
    args = p.parse_args()
    from mlx_streaming.errors import FormatError
    from mlx_streaming.format import read_manifest

    try:
        read_manifest(args.model)
    except (FormatError, OSError) as e:
        p.error(f"--model: {e}")
    if args.text:
        text = Path(args.text).read_text(errors="ignore")
    else:
        from mlx_streaming.bench.quality import held_out_text

        with tempfile.TemporaryDirectory() as tmp:
            text = held_out_text(Path(tmp), args.tokens).read_text()
    print("batch  union  B*k  uniform  independent (measured popularity)")
    for b in args.batch:
        r = unions(args.model, text, args.tokens, b)
        print(f"{b:5d}  {r['union']:5.1f}  {r['picks']:3d}  {r['uniform']:7.1f}  "
              f"{r['popularity']:.1f}")
        print(json.dumps(r))


if __name__ == "__main__":
    main()
