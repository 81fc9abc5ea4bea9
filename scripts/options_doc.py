"""Write docs/options.md from StreamConfig's table (tests check it is current).

    python scripts/options_doc.py
"""

from pathlib import Path

from mlx_streaming.config_doc import options_doc

if __name__ == "__main__":
    out = Path(__file__).resolve().parent.parent / "docs" / "options.md"
    out.write_text(options_doc())
    print(f"wrote {out}")
