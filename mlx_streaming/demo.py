"""The offline demo: build a small MoE once, convert it, stream from it.

    python -m mlx_streaming.demo [--prompt "..."] [--max-tokens N]

The first run trains a BPE tokenizer on the Python standard library's
sources and a small qwen3_moe (a real mlx-lm architecture) to recite one
short passage, the Zen of Python (``import this``), which it learns by
heart in a few minutes; quantizes it to 4 bits with float32 scales (the
fast kind on MLX's CPU backend), converts it to a stream directory and
caches it. Every run then generates greedily from the passage's opening
words with half of each layer's experts resident, so experts really are
read from the blob files, and the text that comes out is recognisable.
"""

import argparse
import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

from .cli import run_main
from .flags import MAX_TOKENS, Parser, count, number
from .format import manifest_path

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "mlx_streaming" / "demo-v2"
DEFAULT_PROMPT = "Beautiful is better than"
DEMO_FAMILY = "qwen3_moe"
DEMO_VOCAB = 512
DEMO_CONFIG = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
    intermediate_size=256,
)
# 200 steps (3.5 min on 2 cores) take the loss on the passage from 6.4 to
# ~0.1: the first seven lines come back verbatim after 4-bit quantization.
DEMO_TRAIN_STEPS = 200
DEMO_LEARNING_RATE = 3e-3
DEMO_TEMPERATURE = 0.0
DEMO_SEQ_LEN = 64
DEMO_BATCH = 8
DEMO_CORPUS_CHARS = 1_500_000
DEMO_MAX_TOKENS = 120
WHAT_IT_IS = (
    "[demo] The demo model is a tiny qwen3_moe (4 layers, 16 experts of which 4 per "
    "token) trained for a few minutes to recite the Zen of Python; it knows nothing "
    "else. Prompted with the passage's opening words it continues it, the first lines "
    "verbatim, then drifts.")


def build_demo_model(cache_dir: Path, steps: int = DEMO_TRAIN_STEPS, log=print) -> Path:
    """Train, quantize and convert the demo model; returns its stream dir."""
    from .conversion.local import convert
    from .testing import tiny

    work = cache_dir / "build"
    shutil.rmtree(work, ignore_errors=True)
    start = time.perf_counter()
    log(f"[demo] training a BPE tokenizer ({DEMO_VOCAB} tokens) on the Python stdlib")
    tok = tiny.train_tokenizer(work / "tokenizer", DEMO_VOCAB, DEMO_CORPUS_CHARS)
    config = tiny.tiny_config(DEMO_FAMILY, DEMO_VOCAB, **DEMO_CONFIG)
    model = tiny.build_model(config)
    batches = tiny.token_batches(tok, DEMO_SEQ_LEN, DEMO_BATCH, DEMO_CORPUS_CHARS,
                                 text=tiny.zen_of_python())

    def report(i, loss):
        if i % 10 == 0 or i == steps - 1:
            log(f"[demo] step {i + 1}/{steps}: loss {loss:.3f} "
                f"({time.perf_counter() - start:.0f} s)")

    log(f"[demo] training a {DEMO_FAMILY} MoE ({config['num_experts']} experts, "
        f"top-{config['num_experts_per_tok']}) for {steps} steps on the Zen of Python")
    tiny.train(model, batches, steps, lr=DEMO_LEARNING_RATE, on_step=report)
    src = tiny.save_mlx_model(model, config, work / "mlx", tok, quantize=True)
    stream_dir = cache_dir / "stream"
    shutil.rmtree(stream_dir, ignore_errors=True)
    log("[demo] converting to a stream directory (4-bit, float32 scales)")
    convert(src, stream_dir, progress=False)
    shutil.rmtree(work, ignore_errors=True)
    log(f"[demo] built in {time.perf_counter() - start:.0f} s: {stream_dir}")
    return stream_dir


def demo_model(cache_dir: Path = DEFAULT_CACHE_DIR, rebuild: bool = False,
               steps: int = DEMO_TRAIN_STEPS, log=print) -> Path:
    """The cached demo stream directory, built on first use."""
    stream_dir = cache_dir / "stream"
    if rebuild or not manifest_path(stream_dir).exists():
        return build_demo_model(cache_dir, steps, log=log)
    return stream_dir


@contextlib.contextmanager
def _stdout_to_stderr():
    """Send file descriptor 1 to stderr: native code (the Rust tokenizer
    trainer) writes there without going through ``sys.stdout``."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv=None) -> int:
    p = Parser(prog="mlx_streaming demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--rebuild", action="store_true", help="rebuild the demo model")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=count(1, MAX_TOKENS), default=DEMO_MAX_TOKENS)
    p.add_argument("--temp", type=number(0), default=DEMO_TEMPERATURE,
                   help="sampling temperature (0: greedy, which recites the passage)")
    p.add_argument("--train-steps", type=count(1, 100_000), default=DEMO_TRAIN_STEPS,
                   help="training steps when the model is built")

    def body():
        from . import generate

        args = p.parse_args(argv)

        # mlx-lm and the tokenizer trainer print while the model is built:
        # stdout is for the generated text.
        with _stdout_to_stderr():
            stream_dir = demo_model(args.cache_dir, args.rebuild, args.train_steps,
                                    log=lambda m: print(m, file=sys.stderr))
        half = DEMO_CONFIG["num_experts"] // 2
        print(WHAT_IT_IS, file=sys.stderr)
        print(f"[demo] generating with {half} of {DEMO_CONFIG['num_experts']} experts "
              "per layer resident", file=sys.stderr)
        return generate.main([
            "--model", str(stream_dir), "--prompt", args.prompt,
            "--max-tokens", str(args.max_tokens), "--slots-per-layer", str(half),
            "--temp", str(args.temp), "--echo-prompt",
        ])

    return run_main(body)


if __name__ == "__main__":
    from .cli import leave

    leave(main())
