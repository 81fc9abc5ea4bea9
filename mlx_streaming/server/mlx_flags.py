"""mlx-lm's server flags, declared here: ``mlx_lm.server`` builds its parser
inside ``main()``, so it cannot be reused. Names and defaults are
mlx-lm's; a test compares them with mlx-lm's own parser, so a new mlx-lm
flag is noticed."""

import argparse
import json

# mlx-lm's default (mlx_lm.generate.DEFAULT_QUANTIZED_KV_START).
QUANTIZED_KV_START = 5000
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
SIZE_UNITS = {"": 1, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}


def parse_size(text: str) -> int:
    """Bytes of ``10GB``, ``500M`` or ``1000``, as mlx-lm takes them."""
    digits = text.rstrip("BMGbmg ")
    unit = text[len(digits):].strip().upper()
    try:
        return int(float(digits) * SIZE_UNITS[unit])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500MB, 2GB)") from None


def add_mlx_lm_server_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of ``mlx_lm.server``, with its default (``--model`` is ours)."""
    g = p.add_argument_group("mlx-lm server options (as mlx_lm.server takes them)")
    g.add_argument("--adapter-path", default=None, help="not supported on a streamed model")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8080, help="port to listen on")
    g.add_argument("--allowed-origins", type=lambda x: x.split(","), default="*",
                   help="CORS origins, comma-separated")
    g.add_argument("--draft-model", default=None, help="not supported on a streamed model")
    g.add_argument("--num-draft-tokens", type=int, default=3,
                   help="tokens drafted per verify call (with --draft)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="trust remote code of the tokenizer")
    g.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, help="logging level")
    g.add_argument("--chat-template", default="", help="a chat template for the tokenizer")
    g.add_argument("--use-default-chat-template", action="store_true",
                   help="use the tokenizer's default chat template")
    g.add_argument("--temp", type=float, default=0.0, help="default sampling temperature")
    g.add_argument("--top-p", type=float, default=1.0, help="default nucleus sampling top-p")
    g.add_argument("--top-k", type=int, default=0, help="default top-k sampling (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="default min-p sampling (0: off)")
    g.add_argument("--max-tokens", type=int, default=512,
                   help="default largest number of tokens to generate")
    g.add_argument("--chat-template-args", type=json.loads, default="{}",
                   help="JSON arguments for the tokenizer's apply_chat_template")
    g.add_argument("--decode-concurrency", type=int, default=32,
                   help="requests decoded together when batching")
    g.add_argument("--prompt-concurrency", type=int, default=8,
                   help="prompts processed together when batching")
    g.add_argument("--prefill-step-size", type=int, default=None,
                   help="prompt tokens per model call (default: mlx-lm's 2048, or fewer where "
                        "the memory plan's headroom would not hold them, shared by the "
                        "prompts prefilled together)")
    g.add_argument("--prompt-cache-size", type=int, default=10,
                   help="distinct KV caches kept in the prompt cache")
    g.add_argument("--prompt-cache-bytes", type=parse_size, default=None,
                   help="most bytes of the KV caches kept")
    g.add_argument("--kv-bits", type=int, default=None, help="bits of a quantized KV cache")
    g.add_argument("--kv-group-size", type=int, default=64,
                   help="group size of a quantized KV cache")
    g.add_argument("--quantized-kv-start", type=int, default=QUANTIZED_KV_START,
                   help="token position where KV cache quantization starts")
    g.add_argument("--pipeline", action="store_true",
                   help="pipeline rather than tensor parallelism (distributed)")
