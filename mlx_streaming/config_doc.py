"""docs/options.md, made from the ``StreamConfig`` table (``python
scripts/options_doc.py`` writes it; a test checks it is current)."""

from dataclasses import fields

from .config import RENAMED, StreamConfig, shown


def options_doc() -> str:
    """The options page, one row per ``StreamConfig`` field."""
    lines = [
        "# Options",
        "",
        "Every option is a keyword of `mlx_streaming.load` and a flag of `generate`, the",
        "server and `bench` (`cache_gb` is `--cache-gb`). This page is generated from",
        "`StreamConfig` by `python scripts/options_doc.py`; the topic docs explain the",
        "mechanisms ([design](design.md), [prefetch](prefetch.md), [spine](spine.md),",
        "[Hub](hub.md)).",
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
            default = f"`{_doc_value(f)}`" if known else "-"
        flag = "--" + f.name.replace("_", "-")
        help_text = " ".join(meta["help"].split())
        lines.append(f"| `{f.name}` | `{flag}` | {default} | {values} | {help_text} |")
    lines += ["", "Renamed options, still taken with a warning: "
              + ", ".join(f"`{old}` (now `{new}`)" for old, new in RENAMED.items()) + ".", ""]
    return "\n".join(lines)


def _doc_value(f) -> str:
    """A field's default as its flag takes it (``on``/``off`` for choices
    given as a map)."""
    choices = f.metadata.get("choices")
    if isinstance(choices, dict):
        return next(k for k, v in choices.items() if v == f.default)
    return f.default
