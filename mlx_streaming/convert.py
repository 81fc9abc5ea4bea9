"""``python -m mlx_streaming.convert``: see ``mlx_streaming.conversion``.

Importing this module sets ``mlx_streaming.convert`` to it (Python binds a
submodule to its package's attribute), which would hide the function the
package exports. So this module is callable: ``mlx_streaming.convert(src,
dst, ...)`` works whichever of the two the name holds.
"""

import importlib
import sys
import types


def main(argv=None) -> int:
    from .cli import run_main

    # The converter imports MLX: inside run_main, an interrupt is one line.
    return run_main(lambda: importlib.import_module("mlx_streaming.conversion.cli").main(argv))


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from .conversion.local import convert

        return convert(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    from .cli import leave

    leave(main())
