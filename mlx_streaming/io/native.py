"""The optional C++ extension (``mlx_streaming._ext``, built from native/)."""

from typing import Optional, Tuple

import mlx.core as mx

from ..errors import ExpertReadError


def load_extension() -> Tuple[Optional[object], str]:
    """The extension module, or None and the reason it cannot be used."""
    try:
        from .. import _ext
    except ImportError as e:
        return None, f"not built ({e})"
    if _ext.mlx_version != mx.__version__:
        return None, (
            f"built against mlx {_ext.mlx_version} but mlx {mx.__version__} is "
            "installed; rebuild it with `pip install -e .`"
        )
    return _ext, "available"


class NativeReader:
    """Python face of the C++ reader: the same interface as ``PythonReader``."""

    name = "native"
    local = True

    def __init__(self, ext, threads: int, direct: bool, pace_mbps: Optional[float] = None):
        self.ext = ext
        self.direct = direct
        self.threads = threads
        self.pace_mbps = pace_mbps
        self._reader = ext.ExpertReader(threads, direct, (pace_mbps or 0.0) * 1e6)
        self.closed = False

    def open(self, path: str) -> int:
        try:
            return self._reader.open(str(path))
        except self.ext.ReadError as e:
            raise ExpertReadError(str(e)) from None

    def read(self, file, offsets, segments, dst, checksum, stride):
        if self.closed:
            raise ExpertReadError("this model was closed; load it again to use it")
        try:
            return self._reader.read(file, offsets, segments, dst, checksum, stride)
        except self.ext.ReadError as e:
            raise ExpertReadError(str(e)) from None

    def busy(self) -> Tuple[int, float]:
        """``(bytes read, seconds with a read in flight)`` since load."""
        return self._reader.busy()

    @property
    def native_handle(self):
        """The C++ reader, for native steps that read through it."""
        return self._reader

    def report(self) -> Optional[dict]:
        return None

    def reset(self) -> None:
        pass

    def drain(self) -> None:
        """Wait until no read (prefetch included) is queued or running."""
        self._reader.drain()

    def staging(self, capacity: int, stride: int):
        return self._reader.staging(capacity, stride)

    def close(self) -> None:
        """Wait for reads in flight (prefetch included), then close files."""
        self.closed = True
        self._reader.close()
