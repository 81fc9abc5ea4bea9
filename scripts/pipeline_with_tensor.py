"""Does mlx-lm run a model split by pipeline and tensor groups at once?

    python scripts/pipeline_with_tensor.py --build DIR      # a tiny qwen3_moe
    mlx.launch -n 2 --backend ring --python "$(which python)" \
        scripts/pipeline_with_tensor.py --model DIR [--split]

Each rank loads DIR with mlx-lm's own ``sharded_load`` and runs one forward
pass, then prints how far its logits are from one machine's. Without
``--split`` the world group is both the pipeline and the tensor group (the
only groups a backend without ``Group.split`` has); ``--split`` asks for
sub-groups (tensor groups of two ranks, pipeline groups across them; run it
with ``-n 4``). Each step prints as it starts, so a hang shows where it is:
run it under ``timeout``. docs/distributed.md gives what it printed here.
"""

import argparse
from pathlib import Path


def build(out: Path) -> None:
    from mlx_streaming.testing import tiny

    config = tiny.tiny_config("qwen3_moe", 512)
    tokenizer = out.parent / "tokenizer"
    if not tokenizer.exists():
        tiny.train_tokenizer(tokenizer, 512, max_chars=200_000)
    tiny.save_mlx_model(tiny.build_model(config), config, out, tokenizer)


def run(model_dir: Path, split: bool) -> None:
    import mlx.core as mx
    from mlx_lm.utils import load, sharded_load

    world = mx.distributed.init()
    rank = world.rank()

    def say(text: str) -> None:
        print(f"rank {rank}: {text}", flush=True)

    if split:
        say("splitting the world into tensor and pipeline groups")
        try:
            tensor, pipeline = world.split(rank // 2), world.split(rank % 2)
        except RuntimeError as e:
            say(f"Group.split failed: {e}")
            return
    else:
        tensor = pipeline = world
    say("sharded_load")
    model, _ = sharded_load(str(model_dir), pipeline, tensor)
    say(f"loaded: stage of layers {model.model.start_idx}-{model.model.end_idx - 1} over "
        f"{tensor.size()} tensor rank(s); forward")
    tokens = mx.array([[1, 5, 9, 30, 77, 100]])
    out = model(tokens)
    mx.eval(out)
    reference, _ = load(str(model_dir))
    say(f"max |split - one machine| = {mx.abs(out - reference(tokens)).max().item():.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", type=Path, help="write a tiny mlx-lm model here and stop")
    p.add_argument("--model", type=Path, help="the mlx-lm model directory to load")
    p.add_argument("--split", action="store_true", help="sub-groups instead of the world twice")
    args = p.parse_args()
    if args.build:
        build(args.build)
    elif args.model:
        run(args.model, args.split)
    else:
        p.error("give --build DIR or --model DIR")


if __name__ == "__main__":
    main()
