"""Which reader a model reads its records with, and whether uncached."""

import warnings
from pathlib import Path
from typing import Tuple

from ..config import StreamConfig
from ..errors import StreamingError
from ..format import Manifest, blob_path
from ..system import total_memory_bytes
from .native import NativeReader, load_extension
from .python import PythonReader, direct_io_works


def make_reader(config: StreamConfig, direct: bool) -> Tuple[object, str]:
    ext, why = load_extension()
    if config.io == "native" and ext is None:
        raise StreamingError(
            f"io='native' was asked for but the native extension is {why}; "
            "use io='python' or reinstall with `pip install -e .`"
        )
    if config.io == "python" or ext is None:
        reason = "asked for" if config.io == "python" else f"native extension {why}"
        if config.io == "auto":
            warnings.warn(
                f"mlx_streaming: the native extension is {why}; reading experts with the "
                "slower Python reader, without its paged calls inside the graph. Reinstall "
                "with a C++ compiler and CMake (`pip install -e .`) to build it.",
                RuntimeWarning, stacklevel=4)
        return PythonReader(config.io_threads, direct, config.read_pace_mbps), reason
    return NativeReader(ext, config.io_threads, direct, config.read_pace_mbps), \
        "native extension"


def choose_direct_io(config: StreamConfig, path: Path, manifest: Manifest,
                     resident_bytes: int) -> Tuple[bool, str]:
    """Uncached reads or not, and why: cached while the blobs fit the memory the
    pools and the spine leave (docs/design.md, "Reads")."""
    if config.direct_io is not None:
        return config.direct_io, "asked for"
    room = total_memory_bytes() - resident_bytes
    if manifest.expert_nbytes <= room:
        return False, (f"experts ({manifest.expert_nbytes / 1e9:.2f} GB) fit in the "
                       f"{room / 1e9:.2f} GB the page cache can use")
    if not direct_io_works(blob_path(path, manifest.layers[0])):
        return False, "this file system refuses uncached reads"
    return True, (f"experts ({manifest.expert_nbytes / 1e9:.2f} GB) exceed the "
                  f"{room / 1e9:.2f} GB the page cache can use")
