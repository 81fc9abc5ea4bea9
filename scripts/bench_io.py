"""Expert-read throughput (native vs Python vs dd with direct I/O, cold and
warm, several expert sizes) and decode with prefetch off vs on.

    python scripts/bench_io.py [--model STREAM_DIR] [--out DIR]

The same as `python -m mlx_streaming.bench io`; see --help.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_streaming.bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["io", *sys.argv[1:]]))
