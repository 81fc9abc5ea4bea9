"""What a reader measures of its disk, and the paced disk benchmarks emulate
(the C++ reader has both, native/reader.h)."""

import threading
import time
from typing import Tuple


class ReadPace:
    """A disk of ``bytes_per_s`` emulated on a faster one, for benchmarks: no read
    ends earlier than at that rate, and idle time earns no credit."""

    def __init__(self, bytes_per_s: float):
        self._seconds_per_byte = 1.0 / bytes_per_s
        self._free = time.monotonic()
        self._lock = threading.Lock()

    def book(self, nbytes: int) -> float:
        """Book ``nbytes`` on the device; the read may end at the time returned."""
        with self._lock:
            self._free = max(self._free, time.monotonic()) + nbytes * self._seconds_per_byte
            return self._free


class BusyMeter:
    """Bytes read and the seconds with a read in flight (overlaps counted once),
    as native/reader.h's ``BusyMeter``: prefetch's rate of the disk."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._busy = 0.0
        self._bytes = 0

    def begin(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1

    def end(self, nbytes: int) -> None:
        with self._lock:
            self._bytes += nbytes
            self._active -= 1
            if self._active == 0:
                self._busy += time.perf_counter() - self._since

    def totals(self) -> Tuple[int, float]:
        """``(bytes, busy seconds)`` so far."""
        with self._lock:
            running = time.perf_counter() - self._since if self._active else 0.0
            return self._bytes, self._busy + running
