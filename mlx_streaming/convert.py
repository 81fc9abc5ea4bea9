"""``python -m mlx_streaming.convert``: the converter's command
(``mlx_streaming.conversion.command``). A command only, never imported: as a
submodule it would be bound over the package's ``convert`` function."""

if __name__ != "__main__":
    raise ImportError("mlx_streaming.convert is the command `python -m mlx_streaming.convert`; "
                      "call the function mlx_streaming.convert(...) or import "
                      "mlx_streaming.conversion")

import importlib  # noqa: E402

from .cli import leave, run_main  # noqa: E402

# The converter imports MLX: inside run_main, an interrupt is one line.
leave(run_main(lambda: importlib.import_module("mlx_streaming.conversion.command").main()))
