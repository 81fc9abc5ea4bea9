"""Train a small MoE of a real mlx-lm architecture on text found on this
machine, so that its routing is learned rather than random.

    python scripts/train_moe.py --out ~/.cache/mlx_streaming/trained --minutes 45

Random-init routers flatter expert caches (tokens keep re-using the same few
experts); cache-policy and prefetch studies need a model whose routing was
learned. This trains a qwen3_moe (32 experts, top-4 by default) with a
Switch-Transformer load-balancing loss on the Python standard library's
sources for a set time, then writes:

    OUT/mlx        the mlx-lm model (4-bit, float32 scales)
    OUT/stream     the stream directory of the same weights
    OUT/train.json the loss curve and the config

The weights are never committed; this script is.
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_streaming.conversion.local import convert  # noqa: E402
from mlx_streaming.testing import tiny  # noqa: E402

DEFAULTS = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=64,
    intermediate_size=256,
)


class RecordingGate(nn.Module):
    """A router that remembers its logits, for the load-balancing loss."""

    def __init__(self, gate: nn.Linear, sink: list):
        super().__init__()
        self.gate = gate
        self._sink = sink

    def __call__(self, x):
        logits = self.gate(x)
        self._sink.append(logits)
        return logits


def balance_loss(logits_list, top_k: int) -> mx.array:
    """Switch Transformer auxiliary loss: E * sum_i f_i * P_i per layer."""
    total = 0.0
    for logits in logits_list:
        probs = mx.softmax(logits.reshape(-1, logits.shape[-1]), axis=-1)
        E = probs.shape[-1]
        chosen = mx.stop_gradient(mx.argpartition(-probs, kth=top_k - 1, axis=-1)[:, :top_k])
        f = mx.zeros((E,)).at[chosen.reshape(-1)].add(1.0) / chosen.size
        total = total + E * (f * probs.mean(axis=0)).sum()
    return total / len(logits_list)


def train(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = tiny.train_tokenizer(out / "tokenizer", args.vocab, args.corpus_chars)
    config = tiny.tiny_config("qwen3_moe", args.vocab, **DEFAULTS)
    config.update(num_experts=args.experts, num_experts_per_tok=args.top_k,
                  num_hidden_layers=args.layers, moe_intermediate_size=args.expert_width)
    model = tiny.build_model(config, seed=args.seed)
    sink = []
    blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "switch_mlp")]
    for block in blocks:
        block.gate = RecordingGate(block.gate, sink)

    def loss_fn(m, batch):
        sink.clear()
        logits = m(batch[:, :-1])
        ce = nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")
        return ce + args.balance * balance_loss(sink, args.top_k), ce

    step = nn.value_and_grad(model, loss_fn)
    warmup = optim.linear_schedule(args.lr / 100, args.lr, args.warmup)
    decay = optim.cosine_decay(args.lr, args.max_steps, args.lr / 10)
    opt = optim.AdamW(learning_rate=optim.join_schedules([warmup, decay], [args.warmup]))
    batches = tiny.token_batches(tok, args.seq_len, args.batch, args.corpus_chars, args.seed)
    start = time.time()
    log = []
    i = 0
    while time.time() - start < args.minutes * 60 and i < args.max_steps:
        (loss, ce), grads = step(model, next(batches))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss, ce)
        if i % 25 == 0:
            log.append(dict(step=i, seconds=round(time.time() - start, 1), loss=loss.item(),
                            ce=ce.item()))
            print(json.dumps(log[-1]), flush=True)
        i += 1
    for block in blocks:
        block.gate = block.gate.gate
    mx.eval(model.parameters())

    # The 4-bit mlx-lm model is the reference the benchmarks compare with;
    # the stream directory holds exactly its weights.
    shutil.rmtree(out / "mlx", ignore_errors=True)
    src = tiny.save_mlx_model(model, config, out / "mlx", tok, quantize=True)
    shutil.rmtree(out / "stream", ignore_errors=True)
    convert(src, out / "stream", progress=False)
    (out / "train.json").write_text(json.dumps(
        dict(config=config, steps=i, minutes=args.minutes, log=log, args=vars(args)), indent=1))
    print(f"trained {i} steps in {time.time() - start:.0f} s; wrote {out}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=45)
    p.add_argument("--max-steps", type=int, default=2500,
                   help="steps of the cosine schedule (training also stops at --minutes)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=DEFAULTS["num_hidden_layers"],
                   help="decoder layers, each with an MoE block (a deeper model leaves "
                   "the first layer, which prefetch cannot see coming, a smaller share)")
    p.add_argument("--expert-width", type=int, default=DEFAULTS["moe_intermediate_size"],
                   help="each expert's intermediate size (a multiple of 64 times the ranks "
                   "of a tensor-parallel conversion, at 4 bits)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--balance", type=float, default=0.01, help="load-balancing loss weight")
    p.add_argument("--corpus-chars", type=int, default=4_000_000)
    p.add_argument("--seed", type=int, default=0)
    train(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
