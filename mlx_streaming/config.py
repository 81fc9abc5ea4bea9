"""The one configuration object of a streaming model, built at load from
``load(...)`` keyword arguments or command-line flags and passed down.

Each option is described once, on its ``StreamConfig`` field: ``load()``
takes the field names as keywords and ``add_config_flags`` derives the
command-line flags (``cache_gb`` -> ``--cache-gb``) from the same table.
"""

import argparse
import math
import numbers
import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Optional

from .errors import ConfigError

IO_CHOICES = ("auto", "native", "python")
PREFETCH_CHOICES = ("off", "next-layer", "auto")
# Eviction policies (mlx_streaming.runtime.policy.POLICIES); bench cache compares them.
POLICY_CHOICES = ("adaptive", "lru", "lfu", "lfu-decay", "lru-2", "arc", "router-ema", "gate-ema")
DEFAULT_POLICY = "adaptive"
CHECKSUM_CHOICES = ("first-read", "always", "off")
ROUTING_CHOICES = ("exact", "cache-aware", "top-k-cut", "skip-misses")
# Widths of low-bit miss reads (format.LOW_BITS).
MISS_BITS = (2, 3, 4, 5, 6, 8)
# Command-line spelling of StreamConfig.direct_io.
DIRECT_IO_CHOICES = {"auto": None, "on": True, "off": False}
ON_OFF = {"on": True, "off": False}

DEFAULT_RESERVE_GB = 2.0
# Streamed spine layers: one computing, one being read (runtime.spine).
DEFAULT_SPINE_RING = 2
MAX_SPINE_RING = 8
# Below this much available memory the pools give memory back (runtime.runtime.PressureWatch).
DEFAULT_PRESSURE_GB = 0.5
DEFAULT_PREFETCH_MAX_TOKENS = 8
DEFAULT_PREFETCH_PRECISION = 0.7
# Reads for the layer after next too: it hid more of the stall than one
# layer ahead where measured (docs/results.md, prefetch depth).
DEFAULT_PREFETCH_DEPTH = 2
# A bound on sizes in GB: beyond it float arithmetic on bytes loses meaning.
MAX_GB = 1e6
# read_pace_mbps: slower would pace one record for days.
MIN_PACE_MBPS = 0.01
# More reader threads than this only add contention: an NVMe queue is kept
# full by far fewer, and each thread holds a bounce buffer.
MAX_IO_THREADS = 64
# Prefetch stages at most this many records per layer (staging holds 2 x width).
MAX_BUDGET = 1 << 16
# Slots, layers, experts and tokens per call: far beyond any model, and
# still a number every size computed from it can hold.
MAX_COUNT = 1 << 24
# Hub repos: parallel range requests, and seconds any network wait may take.
DEFAULT_FETCH_THREADS = 8
MAX_FETCH_THREADS = 64
DEFAULT_FETCH_TIMEOUT = 30.0
DEFAULT_FETCH_RETRIES = 4
MAX_FETCH_RETRIES = 20


def default_io_threads() -> int:
    # Reads mostly wait on the device: queue depth, not cores, sets the pace
    # (SSDs want deep queues; docs/results.md, "bench io").
    return min(MAX_IO_THREADS, max(8, os.cpu_count() or 1))


def _option(default, help: str, **cli):
    # same_on_ranks=True: the option changes what a split model computes, so
    # every rank must load with the same value (runtime.sharding.agree).
    # measurement=True: it exists to measure (the benchmarks); its help says so.
    return field(default=default, metadata=dict(help=help, **cli))


@dataclass(frozen=True)
class StreamConfig:
    """How a stream directory is loaded and run (each field's ``help``
    says what it means; ``load()`` and ``generate`` take them all)."""

    cache_gb: Optional[float] = _option(
        None, "memory for the model's weights in GB: the resident spine, then spine layers "
        "(those that do not fit are streamed), then expert slots (default: available "
        "memory less a reserve)", type=float,
        bounds=dict(low=0, high=MAX_GB, open_low=True, optional=True))
    slots_per_layer: Optional[int] = _option(
        None, "experts resident per layer (overrides cache_gb)", type=int,
        bounds=dict(low=1, high=MAX_COUNT, optional=True))
    pinned_layers: Optional[int] = _option(
        None, "spine layers kept resident; the others are read on every pass (default: "
        "as many as the budget holds)", type=int,
        bounds=dict(low=0, high=MAX_COUNT, optional=True))
    spine_ring: Optional[int] = _option(
        None, f"layer buffers that streamed spine layers take turns in (1-{MAX_SPINE_RING}); "
        f"{DEFAULT_SPINE_RING} reads the next layer while one computes (default: "
        f"{DEFAULT_SPINE_RING}, or 1 where {DEFAULT_SPINE_RING} do not fit)", type=int,
        bounds=dict(low=1, high=MAX_SPINE_RING, optional=True),
        shown_default=f"{DEFAULT_SPINE_RING} (1 when short)")
    io: str = _option("auto", "expert reader: the C++ extension, Python, or native "
                      "when built", choices=IO_CHOICES)
    direct_io: Optional[bool] = _option(
        None, "uncached expert reads (O_DIRECT / F_NOCACHE); auto: when the experts "
        "cannot stay in the page cache", choices=DIRECT_IO_CHOICES)
    io_threads: int = _option(default_io_threads(), f"reader threads (1-{MAX_IO_THREADS})",
                              type=int, bounds=dict(low=1, high=MAX_IO_THREADS),
                              shown_default="CPU count, at least 8")
    read_pace_mbps: Optional[float] = _option(
        None, "emulate a slower disk; every read of the model's reader (experts, "
        "streamed spine layers, page-cache hits too) ends no earlier than on a disk that "
        f"reads this many MB/s ({MIN_PACE_MBPS:g} or more), one read after another, with no "
        "credit for its idle time (unlike a cgroup throttle)", type=float,
        bounds=dict(low=MIN_PACE_MBPS, high=MAX_GB * 1e3, optional=True), measurement=True)
    prefetch: str = _option("off", "next-layer: read the next layer's predicted experts "
                            "ahead; auto: measure and keep it only if it pays",
                            choices=PREFETCH_CHOICES)
    prefetch_width: Optional[int] = _option(
        None, "experts predicted per token (default 2 x top-k)", type=int,
        bounds=dict(low=1, high=MAX_COUNT, optional=True))
    prefetch_depth: int = _option(
        DEFAULT_PREFETCH_DEPTH, "MoE layers ahead that prefetch reads for (1 or 2); 2 also "
        "reads the likeliest experts of the layer after next, predicted by its router on this "
        "layer's input, with the budget the next layer's reads leave, held to a "
        "prefetch_precision bar of their own", type=int,
        bounds=dict(low=1, high=2))
    prefetch_records: Optional[int] = _option(
        None, "whole records prefetched per layer (default: measured, what the disk reads "
        "in one layer's compute time, and one more that it reads only part of where its "
        "chance of use is at least the part it does not)", type=int,
        bounds=dict(low=0, high=MAX_BUDGET, optional=True))
    prefetch_precision: float = _option(
        DEFAULT_PREFETCH_PRECISION, "least share of a layer's reads ahead that it must use: "
        "each layer reads only the predictions whose scores, counted on its calls so far, "
        "were used that often (0: every prediction the bandwidth budget allows)",
        type=float, bounds=dict(low=0, high=1))
    prefetch_affinity: bool = _option(
        True, "weigh each prediction by how often the expert followed the experts this "
        "layer chose, counted on the routing so far", choices=ON_OFF)
    overlap: bool = _option(
        True, "a call that syncs computes its resident experts while its misses are read, "
        "when they are expected to take 1 ms or more (on the CPU, a layer whose reads take "
        "that long leaves the graph to sync)",
        choices=ON_OFF)
    prefetch_max_tokens: int = _option(
        DEFAULT_PREFETCH_MAX_TOKENS, "calls with more tokens (prefill) do not prefetch",
        type=int, bounds=dict(low=1, high=MAX_COUNT))
    policy: str = _option(
        DEFAULT_POLICY, "which resident experts a miss evicts (bench cache compares them)",
        choices=POLICY_CHOICES)
    routing: str = _option(
        "exact", "cache-aware (approximate): among the router's top routing_window experts, "
        "after its own top routing_keep, a token takes resident experts before missing "
        "ones; baselines: top-k-cut (the router's top routing_keep only), skip-misses (its "
        "top-k less the missing ones, the top routing_keep always); bench quality measures "
        "what each costs", choices=ROUTING_CHOICES, same_on_ranks=True)
    routing_keep: Optional[int] = _option(
        None, "approximate routing: the router's own top experts always taken (default: "
        "half the experts per token; 1 for skip-misses and a softmax router of < 8 per token; "
        "all of them is exact for cache-aware routing, refused for the baselines)", type=int,
        bounds=dict(low=1, high=MAX_COUNT, optional=True), shown_default="top-k / 2 or 1",
        same_on_ranks=True)
    routing_window: Optional[int] = _option(
        None, "cache-aware routing: the router's top candidates a resident expert may come "
        "from (default: twice the experts per token)", type=int,
        bounds=dict(low=1, high=MAX_COUNT, optional=True), shown_default="2 x top-k",
        same_on_ranks=True)
    routing_bonus: Optional[float] = _option(
        None, "cache-aware routing: instead of taking every resident candidate first, add "
        "this to the resident candidates' selection scores and take the best (an ungrouped "
        "softmax router's logits: a resident expert counts as e^bonus times as likely; "
        "docs/routing.md gives the others' units; default: 0.15 for such a router of < 8 "
        "experts per token, else resident first)", type=float,
        bounds=dict(low=0, high=MAX_GB, optional=True), shown_default="0.15 or resident first",
        same_on_ranks=True)
    routing_max_ppl: Optional[float] = _option(
        None, "a quality budget instead of knobs: cache-aware routing with the routing_keep, "
        "routing_window and routing_bonus that read least while perplexity rises at most "
        "this much against exact (0.01 or 1%: +1%), chosen by a short calibration on held-out text "
        "(bench quality's measurement) at the run's pool size, said at load and cached per "
        "model, pool and budget in disk_cache_dir", type=float, parse="percent",
        bounds=dict(low=0, high=10, optional=True), shown_default="off", same_on_ranks=True)
    routing_check: bool = _option(
        False, "tensor-parallel ranks with approximate routing: gather every MoE call's "
        "choices from every rank and stop all of them at the first pass where a rank chose "
        "other experts than rank 0 (a collective per MoE layer per pass: for tests and "
        "debugging; the ranks route alike by construction)", choices=ON_OFF,
        same_on_ranks=True)
    miss_bits: Optional[int] = _option(
        None, "read a missed expert's low-bit copy of this width (approximate; made by "
        "convert --miss-bits) instead of its full record, for that call only: hits always "
        "compute with the full weights; 2, 3, 4, 5, 6 or 8 (docs/routing.md)", type=int,
        bounds=dict(low=2, high=8, optional=True), shown_default="off", same_on_ranks=True)
    miss_bits_weight: Optional[float] = _option(
        None, "with miss_bits: only a missed expert whose share of its token's routed "
        "weight (the router's probability over the token's routed experts) stays below this "
        "for every token of the call takes its low-bit copy; the others are read in full and "
        "join the pool (default: every miss but each token's weightiest expert; every miss "
        "where the router's probabilities are not known)",
        type=float, bounds=dict(low=0, high=1, optional=True),
        shown_default="all but the top expert", same_on_ranks=True)
    checksums: str = _option(
        "first-read", "CRC-32 checks of expert records: on each expert's first read "
        "(and again after its blob changes on disk), on every read, or never",
        choices=CHECKSUM_CHOICES)
    reserve_gb: float = _option(
        DEFAULT_RESERVE_GB, "memory left free for the rest of the process, in GB, or a "
        "quarter of what is available where that is less, and at least what the least "
        "prefill step's activations need (a lower reserve is raised to that): no budget may "
        "take it",
        type=float, bounds=dict(low=0, high=MAX_GB))
    pressure_gb: float = _option(
        DEFAULT_PRESSURE_GB, "when available memory falls below this many GB during a run "
        "(or half the reserve where that is less), the expert pools shrink, and grow back "
        "when it returns; 0: never", type=float, bounds=dict(low=0, high=MAX_GB))
    trace: Optional[str] = _option(None, "write the routing of every MoE call to this file "
                                   "(bench cache and predict --trace read it)", measurement=True)
    mtp: bool = _option(False, "load the model's multi-token-prediction layers (kept by "
                        "convert when the checkpoint has them) to draft with (--draft mtp)",
                        action="store_true")
    disk_cache_gb: Optional[float] = _option(
        None, "Hub repos: GB of expert records kept on disk between runs, 0 for none "
        "(default: half the free space of the disk_cache_dir disk, at most the experts)",
        type=float, bounds=dict(low=0, high=MAX_GB, optional=True))
    disk_cache_dir: Optional[str] = _option(
        None, "Hub repos: where records, downloaded spines and conversions are kept "
        "(default: HF_HOME/mlx_streaming)")
    endpoint: Optional[str] = _option(
        None, "Hub repos: the Hub's URL (default: huggingface_hub's, HF_ENDPOINT)")
    fetch_threads: int = _option(DEFAULT_FETCH_THREADS, "Hub repos: parallel range requests "
                                 f"(1-{MAX_FETCH_THREADS})", type=int,
        bounds=dict(low=1, high=MAX_FETCH_THREADS))
    fetch_timeout: float = _option(DEFAULT_FETCH_TIMEOUT, "Hub repos: seconds to wait for "
                                   "the server before a try fails", type=float,
        bounds=dict(low=0, high=3600.0, open_low=True))
    fetch_retries: int = _option(DEFAULT_FETCH_RETRIES, "Hub repos: tries after the first "
                                 "before a fetch is an error", type=int,
        bounds=dict(low=0, high=MAX_FETCH_RETRIES))

    def __post_init__(self):
        _check_choice("io", self.io, IO_CHOICES)
        _check_choice("prefetch", self.prefetch, PREFETCH_CHOICES)
        _check_choice("checksums", self.checksums, CHECKSUM_CHOICES)
        _check_choice("policy", self.policy, POLICY_CHOICES)
        _check_choice("routing", self.routing, ROUTING_CHOICES)
        if self.miss_bits is not None and self.miss_bits not in MISS_BITS:
            raise ConfigError(f"miss_bits must be one of {', '.join(map(str, MISS_BITS))}, "
                              f"got {self.miss_bits!r}")
        if self.miss_bits_weight is not None and self.miss_bits is None:
            raise ConfigError("miss_bits_weight is a setting of miss_bits: set miss_bits too")
        for name in ("prefetch_affinity", "overlap", "mtp", "routing_check"):
            _check_bool(name, getattr(self, name))
        if self.trace is not None:
            trace = os.fspath(self.trace) if isinstance(self.trace, os.PathLike) else self.trace
            if not (isinstance(trace, str) and trace):
                raise ConfigError(f"trace must be a file path, got {self.trace!r}")
            object.__setattr__(self, "trace", os.path.expanduser(trace))
        if self.direct_io is not None:
            _check_bool("direct_io", self.direct_io, "None, ")
        for name in ("disk_cache_dir", "endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (str, os.PathLike))
                                          and os.fspath(value).strip()):
                # "" would have been the current directory, silently.
                raise ConfigError(f"{name} must be a non-empty path or None, got {value!r}")
        for f in fields(self):
            bounds = f.metadata.get("bounds")
            if bounds is not None:
                # Stored as plain Python numbers (numpy scalars are accepted).
                value = _number(f.name, getattr(self, f.name), f.metadata["type"], **bounds)
                object.__setattr__(self, f.name, value)
        _check_routing_settings(self)


def _check_routing_settings(config) -> None:
    """A routing setting the chosen routing does not use is refused, not ignored."""
    if config.routing_max_ppl is not None:
        if config.routing not in ("exact", "cache-aware"):
            raise ConfigError(f"routing_max_ppl chooses cache-aware routing's settings, not "
                              f"routing={config.routing!r}'s: leave one of them out")
        for name in ("routing_keep", "routing_window", "routing_bonus"):
            if getattr(config, name) is not None:
                raise ConfigError(f"routing_max_ppl chooses {name}: leave {name} unset, or "
                                  "routing_max_ppl")
        object.__setattr__(config, "routing", "cache-aware")
    if config.routing == "exact":
        for name in ("routing_keep", "routing_window", "routing_bonus", "routing_check"):
            if getattr(config, name) not in (None, False):
                raise ConfigError(f"{name} is a setting of approximate routing: set routing "
                                  "(cache-aware, top-k-cut or skip-misses) too, or leave it unset")
    elif config.routing != "cache-aware":
        for name in ("routing_window", "routing_bonus"):
            if getattr(config, name) is not None:
                raise ConfigError(f"{name} is a setting of cache-aware routing, unused by "
                                  f"routing={config.routing!r}: leave it unset")


def percent(text: str) -> float:
    """``1%`` as 0.01; a plain number as it is."""
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a share such as 1% or 0.01, got {text!r}") from None


def _check_bool(name, value, also=""):
    # Not ``in (True, False)``: 1 and 0 compare equal to them.
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be {also}True or False, got {value!r}")


def _check_choice(name, value, choices):
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _number(name, value, kind, low, high=None, open_low=False, optional=False):
    """``value`` as a plain ``kind``, or a ConfigError that says what is
    allowed."""
    if value is None and optional:
        return None
    is_int = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    is_float = kind is float and isinstance(value, numbers.Real) and not is_int \
        and not isinstance(value, bool)
    # Integers are compared as they are: a huge one is out of bounds, not
    # an OverflowError from float().
    if not (is_int or (is_float and math.isfinite(value))):
        raise ConfigError(f"{name} must be a finite {'integer' if kind is int else 'number'}, "
                          f"got {value!r}")
    too_low = value <= low if open_low else value < low
    if too_low or (high is not None and value > high):
        lo, hi = shown(low), shown(high)
        bound = f"above {lo}" if open_low else f"at least {lo}"
        if high is not None:
            bound = f"{bound} and at most {hi}" if open_low else f"between {lo} and {hi}"
        got = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}..."
        raise ConfigError(f"{name} must be {bound}, got {got}")
    return kind(value)


def shown(bound) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


# Options renamed, old name -> new: still taken, with a DeprecationWarning.
RENAMED = {"verify": "checksums", "prefetch_budget": "prefetch_records"}


def config_fields():
    return [f.name for f in fields(StreamConfig)]


def renamed_options(options: dict) -> dict:
    """``options`` with renamed keywords under their new names."""
    out = dict(options)
    for old, new in RENAMED.items():
        if old in out:
            warnings.warn(f"mlx_streaming: the option {old!r} is now {new!r}",
                          DeprecationWarning, stacklevel=3)
            if new in out:
                raise ConfigError(f"pass {new!r} only ({old!r} is its old name)")
            out[new] = out.pop(old)
    return out


# Metadata of the options page and load()'s checks, not argparse's.
_NOT_ARGPARSE = ("bounds", "shown_default", "same_on_ranks", "parse", "measurement")


def option_help(name: str) -> str:
    """A field's help, as its flags and the options page give it."""
    meta = fields_by_name()[name].metadata
    return ("measurement only: " if meta.get("measurement") else "") + meta["help"]


def flag_value(f):
    """A field's default as its flag spells it (``on``/``off`` for choices
    given as a map)."""
    choices = f.metadata.get("choices")
    if isinstance(choices, dict):
        return next(k for k, v in choices.items() if v == f.default)
    return f.default


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``StreamConfig`` field, from the field's metadata."""
    group = parser.add_argument_group("streaming options (mlx_streaming.load keywords)")
    for f in fields(StreamConfig):
        meta = {k: v for k, v in f.metadata.items() if k not in _NOT_ARGPARSE}
        if f.metadata.get("parse") == "percent":
            meta["type"] = percent
        meta["help"] = option_help(f.name).replace("%", "%%")  # argparse formats help with %
        flag = "--" + f.name.replace("_", "-")
        choices = meta.pop("choices", None)
        if isinstance(choices, dict):
            group.add_argument(flag, choices=list(choices), default=None, **meta)
        elif meta.get("action") == "store_true":
            group.add_argument(flag, default=None, **meta)
        else:
            group.add_argument(flag, choices=choices, default=None, **meta)
    for old, new in RENAMED.items():
        choices = fields_by_name()[new].metadata.get("choices")
        group.add_argument("--" + old.replace("_", "-"), dest=new, default=None,
                           choices=list(choices) if choices else None, help=argparse.SUPPRESS)


def add_option_flag(parser, name: str, *flags: str, note: Optional[str] = None) -> None:
    """One ``StreamConfig`` field's flag where a command takes only some of
    them (the benchmarks): its type, bounds, choices and help from the
    field (after ``note``, what the command applies it to), under ``flags``
    (default ``--name``), its dest the field's name, None when not given."""
    from .flags import count, flag_names, number

    bounds = fields_by_name()[name].metadata.get("bounds")
    meta = {k: v for k, v in fields_by_name()[name].metadata.items() if k not in _NOT_ARGPARSE}
    if bounds is not None:
        make = count if meta["type"] is int else number
        limits = dict(open_low=bounds.get("open_low", False)) if make is number else {}
        meta["type"] = make(bounds["low"], bounds.get("high"), **limits)
    if "choices" in meta:
        meta["choices"] = list(meta["choices"])
    meta["help"] = flag_help(name, note)
    parser.add_argument(*flag_names(name, flags), dest=name, default=None, **meta)


def flag_help(name: str, note: Optional[str] = None, more: str = "") -> str:
    """The field's help for argparse, after ``note`` (what a command applies it to)."""
    return ((f"{note}: " if note else "") + option_help(name) + more).replace("%", "%%")


def fields_by_name() -> dict:
    return {f.name: f for f in fields(StreamConfig)}


def config_options(args: argparse.Namespace, names=None) -> dict:
    """``load()`` keywords of the option flags given in ``args`` (of
    ``names``, default all): the flags' spellings as the fields take them."""
    options = {}
    for name in names or config_fields():
        value = getattr(args, name, None)
        if value is None:
            continue
        choices = fields_by_name()[name].metadata.get("choices")
        options[name] = choices[value] if isinstance(choices, dict) else value
    return options


def config_from_args(args: argparse.Namespace) -> StreamConfig:
    """The ``StreamConfig`` of the flags that ``add_config_flags`` added;
    flags left unset keep the field defaults."""
    return StreamConfig(**config_options(args))
