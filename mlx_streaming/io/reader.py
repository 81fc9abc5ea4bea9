"""What every reader of expert and spine records offers (Python, native,
remote), so that the package asks a reader what it can do, not what it is."""

from typing import Optional, Protocol, Tuple

import numpy as np


class Reader(Protocol):
    name: str  # shown in stats and logs: "python", "native", "remote"
    local: bool  # records come from local files that may change under a running model
    direct: bool  # uncached reads
    native_handle: object  # the C++ reader that native steps read through, or None

    def open(self, path: str) -> int:
        """A handle for the file at ``path``."""

    def read(self, file: int, offsets: np.ndarray, segments: np.ndarray, dst: np.ndarray,
             checksum: np.ndarray, stride: int) -> np.ndarray:
        """Read whole records into ``dst``; their CRC-32s where asked."""

    def staging(self, capacity: int, stride: int):
        """A staging area of ``capacity`` records for reads ahead."""

    def busy(self) -> Tuple[int, float]:
        """``(bytes read, seconds with a read in flight)`` since load."""

    def drain(self) -> None:
        """Wait until no read (prefetch included) is queued or running."""

    def report(self) -> Optional[dict]:
        """Counters of the reader's own (a remote reader's fetches), or None."""

    def reset(self) -> None:
        """Zero those counters."""

    def close(self) -> None:
        """Wait for reads in flight, then close the files."""
