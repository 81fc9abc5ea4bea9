"""The one configuration object of a streaming model, built at load from
``load(...)`` keyword arguments or command-line flags and passed down."""

import os
from dataclasses import dataclass
from typing import Optional

IO_CHOICES = ("auto", "native", "python")
PREFETCH_CHOICES = ("off", "next-layer", "auto")
VERIFY_CHOICES = ("first-read", "off")
# Command-line spelling of StreamConfig.direct_io.
DIRECT_IO_CHOICES = {"auto": None, "on": True, "off": False}

DEFAULT_RESERVE_GB = 2.0
DEFAULT_PREFETCH_MAX_TOKENS = 8


def default_io_threads() -> int:
    # Reads mostly wait on the device: queue depth, not cores, sets the pace.
    # 8 read 256 KiB experts 1.3x faster than 4 on the 2-core machine we
    # measured (bench io), and SSDs want deep queues.
    return max(8, os.cpu_count() or 1)


@dataclass(frozen=True)
class StreamConfig:
    """How a stream directory is loaded and run.

    Attributes:
        cache_gb: bytes of expert slots for all layers together, in GB. None
            sizes the pools from memory that is actually free.
        slots_per_layer: experts resident per layer; overrides ``cache_gb``.
        io: ``"native"`` (C++ extension), ``"python"``, or ``"auto"``
            (native when the extension is built).
        direct_io: read with O_DIRECT / F_NOCACHE so expert bytes are not
            kept twice (page cache and pool). None decides at load: uncached
            when the experts cannot stay in the page cache.
        io_threads: reader threads.
        prefetch: ``"off"``, ``"next-layer"`` (predict the next layer's
            experts with its router and read them ahead), or ``"auto"``
            (measure, and keep prefetch only if it pays).
        prefetch_width: candidates predicted per token (default 2 x top-k).
        prefetch_max_tokens: calls with more tokens than this (prefill) do
            not prefetch.
        verify: ``"first-read"`` checks each expert's CRC the first time it
            is read; ``"off"`` never does.
        reserve_gb: memory left free when ``cache_gb`` is not given.
        trace: write one line per MoE call (layer, expert ids) to this file.
    """

    cache_gb: Optional[float] = None
    slots_per_layer: Optional[int] = None
    io: str = "auto"
    direct_io: Optional[bool] = None
    io_threads: int = default_io_threads()
    prefetch: str = "off"
    prefetch_width: Optional[int] = None
    prefetch_max_tokens: int = DEFAULT_PREFETCH_MAX_TOKENS
    verify: str = "first-read"
    reserve_gb: float = DEFAULT_RESERVE_GB
    trace: Optional[str] = None

    def __post_init__(self):
        _check_choice("io", self.io, IO_CHOICES)
        _check_choice("prefetch", self.prefetch, PREFETCH_CHOICES)
        _check_choice("verify", self.verify, VERIFY_CHOICES)
        if self.cache_gb is not None and self.cache_gb <= 0:
            raise ValueError("cache_gb must be positive")
        if self.slots_per_layer is not None and self.slots_per_layer < 1:
            raise ValueError("slots_per_layer must be at least 1")
        if self.io_threads < 1:
            raise ValueError("io_threads must be at least 1")


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
