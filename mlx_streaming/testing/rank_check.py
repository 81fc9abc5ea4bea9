"""One rank's check of a split model, run by the tests under ``mlx.launch``:
the logits of ``mlx_streaming.sharded_load`` against mlx-lm's own
``sharded_load`` of the source (and, for a pipeline, mlx-lm on one rank).

    mlx.launch -n 2 --backend ring --python PY -m? (run this file)
        --source SRC --model STREAM --mode tensor|pipeline --slots 4,8,16 --out DIR

Each rank writes ``DIR/rank{r}.json``: per pool size whether its logits are
bit-identical, and its stats; or the error it stopped with.
"""

import argparse
import json
import sys
import warnings
import zlib
from pathlib import Path

import mlx.core as mx

from mlx_streaming.testing.helpers import logits_trace

# A short trace: each rank runs it at every pool size.
PROMPT = [1, 5, 9, 13, 17, 21, 25, 29]
DECODE_STEPS = 4


def same(a, b) -> bool:
    return len(a) == len(b) and all(mx.array_equal(x, y).item() for x, y in zip(a, b))


def digest(trace) -> int:
    """A checksum of a logits trace's bytes (ranks compare theirs)."""
    return zlib.crc32(b"".join(bytes(memoryview(x.astype(mx.float32))) for x in trace))


def desync(model) -> None:
    """Make this rank's routers steer by the opposite of the resident set
    the ranks agreed on (the agreement still runs: its collective is kept)."""
    for router in model.streaming.routers:
        agreed = router.residency
        object.__setattr__(router, "residency", lambda x, agreed=agreed: ~agreed(x))


def groups(mode: str, world):
    return (world, None) if mode == "pipeline" else (None, world)


def check(args, world) -> dict:
    import mlx_lm
    from mlx_lm.utils import sharded_load as mlx_sharded_load

    import mlx_streaming

    want, result = None, {"pools": {}}
    if args.source:
        reference, _ = mlx_sharded_load(args.source, *groups(args.mode, world))
        want = logits_trace(reference, PROMPT, DECODE_STEPS)
        del reference
    if args.source and args.mode == "pipeline":
        alone, _ = mlx_lm.load(args.source)
        result["pipeline_is_one_rank"] = same(want, logits_trace(alone, PROMPT, DECODE_STEPS))
        del alone
    model_dir = args.model
    if world.rank() == 1 and args.model_rank1:
        model_dir = args.model_rank1
    for slots in args.slots:
        options = json.loads(args.options)
        if world.rank() == 1:
            options.update(json.loads(args.options_rank1))
        options = {k: v.format(rank=world.rank()) if isinstance(v, str) else v
                   for k, v in options.items()}
        if slots:  # 0: the budget in --options sizes the pools
            options.setdefault("slots_per_layer", slots)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            model, _ = mlx_streaming.sharded_load(model_dir, *groups(args.mode, world),
                                                  **options)
        if args.desync and world.rank() == 1:
            desync(model)
        got = logits_trace(model, PROMPT, DECODE_STEPS)
        result["pools"][slots] = {"same": want is not None and same(want, got),
                                  "digest": digest(got),
                                  "warnings": [str(w.message) for w in said],
                                  "stats": mlx_streaming.sharded_stats(model)[world.rank()]}
        model.streaming.close()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--source", default=None, help="mlx-lm's model (none: no reference)")
    p.add_argument("--model", required=True)
    p.add_argument("--model-rank1", default=None, help="rank 1 loads this instead")
    p.add_argument("--mode", choices=("tensor", "pipeline"), required=True)
    p.add_argument("--slots", type=lambda s: [int(x) for x in s.split(",")], required=True)
    p.add_argument("--options", default="{}",
                   help="more load options, as JSON; {rank} in a string is the rank")
    p.add_argument("--options-rank1", default="{}",
                   help="options rank 1 loads with instead, as JSON")
    p.add_argument("--desync", action="store_true",
                   help="rank 1 routes by another resident set than rank 0")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    world = mx.distributed.init()
    from mlx_streaming.errors import StreamingError

    try:
        result = check(args, world)
    except (StreamingError, RuntimeError) as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    out = Path(args.out) / f"rank{world.rank()}.json"
    out.write_text(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
