"""``python -m mlx_streaming.convert``: see ``mlx_streaming.converter``.

The converter lives in ``converter.py`` so that ``mlx_streaming.convert``
stays the function the package exports."""

import sys

from .converter import main

if __name__ == "__main__":
    sys.exit(main())
