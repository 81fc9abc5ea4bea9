"""mlx_streaming: run Mixture-of-Experts models larger than memory by
streaming their routed experts from SSD, bit-identical to mlx-lm.

    import mlx_streaming
    mlx_streaming.convert("path/to/mlx-model", "path/to/stream-dir")
    model, tokenizer = mlx_streaming.load("path/to/stream-dir", cache_gb=8)
    # model works with mlx_lm.generate / stream_generate / make_prompt_cache
    print(mlx_streaming.stats(model)["total"])

Importing the package is cheap: ``load``, ``convert`` and ``format`` (which
need MLX and mlx-lm) are imported on first use, so a command interrupted
while it starts stops with one line instead of a traceback.
"""

import importlib

from .cli import quiet_interrupt_while_starting

quiet_interrupt_while_starting()

from .cli import starting_a_command
from .supported import check_mlx_lm

try:
    check_mlx_lm()
except ImportError as e:
    if not starting_a_command():
        raise
    import sys

    sys.exit(f"error: {e}")  # a command says it in one line

from .config import StreamConfig
from .errors import (
    BudgetError,
    ConfigError,
    ConversionError,
    CorruptExpertError,
    ExpertReadError,
    FormatError,
    StreamingError,
)
from .runtime.stats import reset_stats, stats
from .version import __version__

# name -> (module, attribute); None: the module itself.
_LAZY = {
    "batch_generate": (".decode.batch", "batch_generate"),
    "convert": (".conversion.local", "convert"),
    "load": (".runtime.loader", "load"),
    "sharded_load": (".runtime.loader", "sharded_load"),
    "sharded_stats": (".runtime.sharding", "sharded_stats"),
    "format": (".format", None),
    "stream_generate": (".decode.batch", "stream_generate"),
}

__all__ = [
    "BudgetError",
    "ConfigError",
    "ConversionError",
    "CorruptExpertError",
    "ExpertReadError",
    "FormatError",
    "StreamConfig",
    "StreamingError",
    "__version__",
    "batch_generate",
    "convert",
    "format",
    "load",
    "reset_stats",
    "sharded_load",
    "sharded_stats",
    "stats",
    "stream_generate",
]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'mlx_streaming' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name, __name__)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
