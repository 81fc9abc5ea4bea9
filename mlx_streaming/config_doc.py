"""docs/options.md, made from the ``StreamConfig`` table (``python
scripts/options_doc.py`` writes it; a test checks it is current)."""

from dataclasses import fields

from .config import RENAMED, StreamConfig, flag_value, option_help, shown


def options_doc() -> str:
    """The options page, one row per ``StreamConfig`` field."""
    lines = [
        "# Options",
        "",
        "Every option is a keyword of `mlx_streaming.load` and a flag of `generate` and the",
        "server (`cache_gb` is `--cache-gb`); each `bench` subcommand takes those its cases",
        "vary, with the same help and checks, some as comma-separated lists to compare side",
        "by side. Options marked *measurement only* exist to measure (the benchmarks set",
        "them): a run needs none of them. This page is generated from `StreamConfig` by",
        "`python scripts/options_doc.py`; the topic docs explain the mechanisms",
        "([design](design.md), [prefetch](prefetch.md), [spine](spine.md), [Hub](hub.md)).",
        "",
        "| option | flag | default | values | meaning |",
        "|---|---|---|---|---|",
    ]
    for f in fields(StreamConfig):
        meta = f.metadata
        choices = meta.get("choices")
        if isinstance(choices, dict):
            values = ", ".join(f"`{k}`" for k in choices)
        elif choices:
            values = ", ".join(f"`{c}`" for c in choices)
        elif "bounds" in meta:
            b = meta["bounds"]
            low = f"> {shown(b['low'])}" if b.get("open_low") else f">= {shown(b['low'])}"
            values = low + ("" if b.get("high") is None else f", <= {shown(b['high'])}")
        elif meta.get("action") == "store_true":
            values = "`True`, `False`"
        else:
            values = "a path or URL"
        default = meta.get("shown_default")
        if default is None:
            known = f.default is not None or isinstance(choices, dict)
            default = f"`{flag_value(f)}`" if known else "-"
        flag = "--" + f.name.replace("_", "-")
        help_text = " ".join(option_help(f.name).split())
        if meta.get("measurement"):
            help_text = help_text.replace("measurement only:", "*measurement only*:", 1)
        lines.append(f"| `{f.name}` | `{flag}` | {default} | {values} | {help_text} |")
    lines += ["", "Renamed options, still taken with a warning: "
              + ", ".join(f"`{old}` (now `{new}`)" for old, new in RENAMED.items()) + ".", ""]
    return "\n".join(lines)

