"""mlx_streaming: run Mixture-of-Experts models larger than memory by
streaming their routed experts from SSD, bit-identical to mlx-lm.

    import mlx_streaming
    mlx_streaming.convert("path/to/mlx-model", "path/to/stream-dir")
    model, tokenizer = mlx_streaming.load("path/to/stream-dir", cache_gb=8)
    # model works with mlx_lm.generate / stream_generate / make_prompt_cache
    print(mlx_streaming.stats(model)["total"])
"""

from . import format
from .config import StreamConfig
from .converter import convert
from .errors import (
    BudgetError,
    ConversionError,
    CorruptExpertError,
    ExpertReadError,
    FormatError,
    StreamingError,
)
from .loader import load
from .stats import reset_stats, stats

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "ConversionError",
    "CorruptExpertError",
    "ExpertReadError",
    "FormatError",
    "StreamConfig",
    "StreamingError",
    "convert",
    "format",
    "load",
    "reset_stats",
    "stats",
]
