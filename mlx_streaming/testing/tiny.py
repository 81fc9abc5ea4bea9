"""Tiny MoE models of real mlx-lm architectures, built offline.

Tests, the demo and the benchmarks need models without downloading weights:
these helpers build them from mlx-lm's own model classes with small configs,
train a small BPE tokenizer on text found on this machine (the Python
standard library's sources), and save everything as an mlx-lm model
directory.
"""

import copy
import json
import sysconfig
from pathlib import Path
from typing import Iterator, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model, save_config, save_model

from ..mlx_lm_adapter import model_classes
from .families import FAMILIES


def tiny_config(family: str, vocab_size: int, **overrides) -> dict:
    """The tiny config of an mlx-lm family, with ``overrides`` applied."""
    config = copy.deepcopy(FAMILIES[family])
    config["vocab_size"] = vocab_size
    config.update(overrides)
    return config


def build_model(config: dict, seed: int = 0) -> nn.Module:
    """An mlx-lm model of ``config`` with random weights, evaluated."""
    mx.random.seed(seed)
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    _spread_router_bias(model)
    mx.eval(model.parameters())
    return model


def _spread_router_bias(model: nn.Module) -> None:
    # Routers whose selection bias starts at zero pick the same experts for
    # every token; a spread makes random models route to all experts.
    for _, m in model.named_modules():
        if "e_score_correction_bias" in m:
            b = m["e_score_correction_bias"]
            m["e_score_correction_bias"] = mx.random.uniform(-0.5, 0.5, b.shape).astype(b.dtype)


def save_mlx_model(model: nn.Module, config: dict, out: Path, tokenizer_dir: Optional[Path],
                   quantize: bool = False, group_size: int = 64, bits: int = 4,
                   mode: str = "affine") -> Path:
    """Save ``model`` as an mlx-lm model directory (optionally quantized with
    mlx-lm's own quantizer, in ``mode``) with the tokenizer of ``tokenizer_dir``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    if quantize:
        model, config = quantize_model(model, config, group_size, bits, mode=mode)
    save_model(out, model)
    save_config(config, out / "config.json")
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file():
                (out / f.name).write_bytes(f.read_bytes())
    return out


def corpus_files(limit: Optional[int] = None) -> List[Path]:
    """Text found on every machine with Python: the standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    return files[:limit] if limit else files


def corpus_text(max_chars: int, files: Optional[List[Path]] = None) -> str:
    parts, n = [], 0
    for f in files or corpus_files():
        t = f.read_text(errors="ignore")
        parts.append(t)
        n += len(t)
        if n >= max_chars:
            break
    return "".join(parts)[:max_chars]


def train_tokenizer(out: Path, vocab_size: int = 512, max_chars: int = 2_000_000) -> Path:
    """Train a byte-level BPE tokenizer on local text and save it with
    transformers' ``save_pretrained`` (what mlx-lm's loader reads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = corpus_text(max_chars)
    chunks = (text[i : i + 10_000] for i in range(0, len(text), 10_000))
    tok.train_from_iterator(chunks, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>")
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def zen_of_python() -> str:
    """The Zen of Python, read from the standard library's ``this`` module
    (stored ROT13-encoded there; importing it would print it)."""
    import codecs
    import importlib.util
    import re

    source = Path(importlib.util.find_spec("this").origin).read_text()
    return codecs.decode(re.search(r's = """(.*?)"""', source, re.S).group(1), "rot13")


def token_batches(tokenizer_dir: Path, seq_len: int, batch: int, max_chars: int,
                  seed: int = 0, text: Optional[str] = None) -> Iterator[mx.array]:
    """Endless random batches ``[batch, seq_len + 1]`` of tokenized ``text``
    (default: local text, ``max_chars`` of it)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    text = corpus_text(max_chars) if text is None else text
    ids = mx.array(tok.encode(text).ids, dtype=mx.int32)
    key = mx.random.key(seed)
    while True:
        key, sub = mx.random.split(key)
        starts = mx.random.randint(0, ids.size - seq_len - 1, (batch,), key=sub)
        yield mx.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])


def train(model: nn.Module, batches: Iterator[mx.array], steps: int, lr: float = 3e-3,
          on_step=None) -> float:
    """A few steps of next-token training; returns the last loss."""
    import mlx.optimizers as optim

    opt = optim.AdamW(learning_rate=lr)

    def loss_fn(m, batch):
        logits = m(batch[:, :-1])
        return nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")

    step = nn.value_and_grad(model, loss_fn)
    loss = None
    for i in range(steps):
        loss, grads = step(model, next(batches))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        if on_step is not None:
            on_step(i, loss.item())
    return loss.item()


def write_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=1))


def add_mtp_weights(model: nn.Module, config: dict, out: Path, quantize: bool = False,
                    seed: int = 1) -> Path:
    """Random MTP layers for ``model`` (``config`` declares how many), saved
    as a checkpoint stores them: ``model.layers.{N + i}.*`` in
    ``out/mtp.safetensors``, where mlx-lm's loader never looks (its
    ``sanitize`` would keep a tiny model's and then refuse them)."""
    from ..models import mtp_layers

    mx.random.seed(seed)
    first = len(model.model.layers)
    weights = {}
    for depth, module in enumerate(mtp_layers.build(model, mtp_layers.mtp_layers_of(config))):
        _spread_router_bias(module)
        if quantize:
            mtp_layers.quantize(module, 64, 4, "affine")
        mx.eval(module.parameters())
        for name, value in tree_flatten(module.parameters()):
            name = name[len("layer."):] if name.startswith("layer.") else name
            weights[f"model.layers.{first + depth}.{name}"] = value
    mx.save_safetensors(str(Path(out) / mtp_layers.MTP_FILE), weights)
    return out
