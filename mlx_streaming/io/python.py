"""The Python reader, the reference path: ``os.preadv`` straight into slot
memory over threads; prefetch reads land in a staging area of whole records
(docs/design.md, "io/python.py")."""

import ctypes
import os
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import ExpertReadError
from .meters import BusyMeter, ReadPace

# Direct (uncached) reads need buffers aligned to the device's logical block.
DIRECT_ALIGNMENT = 4096


# Below this many bytes a read runs on the calling thread: the pool costs more.
INLINE_READ_BYTES = 1 << 20


def buffer_at(address: int, nbytes: int):
    """A writable buffer over ``nbytes`` of memory at ``address``."""
    return (ctypes.c_ubyte * nbytes).from_address(address)


def scatter_record(record: np.ndarray, segments, dst_row, want_crc: bool) -> int:
    """Copy a record's segments to their slot addresses; their CRC-32 if asked, else 0."""
    crc = 0
    for (seg_off, nbytes), address in zip(segments, dst_row):
        src = record[seg_off : seg_off + nbytes]
        np.frombuffer(buffer_at(int(address), int(nbytes)), np.uint8)[:] = src
        if want_crc:
            crc = zlib.crc32(src, crc)
    return crc


def aligned_empty(nbytes: int, alignment: int = DIRECT_ALIGNMENT) -> np.ndarray:
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start : start + nbytes]


def direct_supported() -> bool:
    return hasattr(os, "O_DIRECT")


def uncached_supported() -> bool:
    """O_DIRECT (Linux) or F_NOCACHE (macOS)."""
    return direct_supported() or sys.platform == "darwin"


def direct_io_works(path) -> bool:
    """Whether ``path`` reads uncached (tmpfs and some overlay file systems refuse)."""
    if not direct_supported():
        return uncached_supported()  # F_NOCACHE is set per file, never refused
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        os.preadv(fd, [aligned_empty(DIRECT_ALIGNMENT)], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class PythonReader:
    """``os.preadv`` straight into slot memory, records spread over threads."""

    name = "python"
    local = True
    native_handle = None

    def __init__(self, threads: int, direct: bool = False, pace_mbps: Optional[float] = None):
        if direct and not uncached_supported():
            raise ExpertReadError("uncached reads are not supported on this OS")
        self.direct = direct
        self.pace_mbps = pace_mbps
        self._pace = ReadPace(pace_mbps * 1e6) if pace_mbps else None
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mlxs-read")
        # Prefetch reads: a thread of their own, one at a time, best first (as native).
        self._background = ThreadPoolExecutor(1, thread_name_prefix="mlxs-prefetch")
        self._files: List[Tuple[int, str]] = []
        self._bounce = threading.local()
        self.meter = BusyMeter()
        self.closed = False

    def open(self, path: str) -> int:
        flags = os.O_RDONLY | (os.O_DIRECT if self.direct and direct_supported() else 0)
        try:
            fd = os.open(path, flags)
            if self.direct and sys.platform == "darwin":
                import fcntl

                fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
        except OSError as e:
            raise ExpertReadError(f"cannot open {path}: {e.strerror}") from None
        if not self.direct and hasattr(os, "posix_fadvise"):
            # Experts are read in no particular order: no readahead.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._files.append((fd, str(path)))
        return len(self._files) - 1

    def close(self) -> None:
        """Wait for reads in flight (prefetch included), then close files."""
        self.closed = True
        self._pool.shutdown(wait=True)
        # Prefetch reads not started are guesses nobody waits for any more.
        self._background.shutdown(wait=True, cancel_futures=True)
        for fd, _ in self._files:
            os.close(fd)
        self._files.clear()

    def report(self) -> Optional[dict]:
        return None

    def reset(self) -> None:
        pass

    def busy(self) -> Tuple[int, float]:
        """``(bytes read, seconds with a read in flight)`` since load."""
        return self.meter.totals()

    def _check_open(self) -> None:
        if self.closed:
            raise ExpertReadError("this model was closed; load it again to use it")

    def read(
        self,
        file: int,
        offsets: np.ndarray,
        segments: np.ndarray,
        dst: np.ndarray,
        checksum: np.ndarray,
        stride: int,
    ) -> np.ndarray:
        """Read the records at ``offsets`` [n] of ``file`` into ``dst`` [n, S] (an
        address per record and segment); ``segments`` [S, 2] (offset in record,
        nbytes), ``checksum`` [n] bool, ``stride`` the unit of a direct read.
        Returns [n] uint32 CRC-32s (0 where not asked)."""
        self._check_open()
        n = len(offsets)
        crcs = np.zeros(n, dtype=np.uint32)

        def work(i):
            return self._read_record(file, int(offsets[i]), segments, dst[i],
                                     bool(checksum[i]), stride)

        if n == 1 or n * stride < INLINE_READ_BYTES:
            for i in range(n):
                crcs[i] = work(i)
        else:
            for i, crc in enumerate(self._pool.map(work, range(n))):
                crcs[i] = crc
        return crcs

    def _read_record(self, file, offset, segments, dst_row, want_crc, stride) -> int:
        fd, path = self._files[file]
        if self.direct:
            record = self._bounce_buffer(stride)
            self._pread(fd, path, record, offset)
            return scatter_record(record, segments, dst_row, want_crc)
        else:
            parts = []
            for (seg_off, nbytes), address in zip(segments, dst_row):
                buf = buffer_at(int(address), int(nbytes))
                self._pread(fd, path, buf, offset + int(seg_off))
                parts.append(buf)
        if not want_crc:
            return 0
        crc = 0
        for p in parts:
            crc = zlib.crc32(p, crc)
        return crc

    def read_record(self, file: int, buf: np.ndarray, offset: int) -> None:
        """Read a whole record into ``buf`` (aligned when direct)."""
        fd, path = self._files[file]
        self._pread(fd, path, buf, offset)

    def drain(self) -> None:
        """Wait until no prefetch read is queued or running."""
        self._background.submit(lambda: None).result()  # one thread, in order

    def submit(self, fn, *args):
        """Run ``fn(*args)`` in the background; returns a future."""
        self._check_open()
        return self._background.submit(fn, *args)

    def _bounce_buffer(self, stride: int) -> np.ndarray:
        buf = getattr(self._bounce, "buf", None)
        if buf is None or len(buf) < stride:
            buf = self._bounce.buf = aligned_empty(stride)
        return buf[:stride]

    def _pread(self, fd: int, path: str, buf, offset: int) -> None:
        want = memoryview(buf).nbytes
        self.meter.begin()
        got = 0
        try:
            done = self._pace.book(want) if self._pace is not None else None
            try:
                got = os.preadv(fd, [buf], offset)
            except OSError as e:
                raise ExpertReadError(
                    f"read of {path} at offset {offset} failed: {e.strerror}"
                ) from None
            if got != want:
                raise ExpertReadError(
                    f"short read of {path} at offset {offset}: {got} of {want} "
                    "bytes; the blob is truncated, re-convert the model"
                )
            if done is not None:
                time.sleep(max(0.0, done - time.monotonic()))
        finally:
            self.meter.end(got)

    def staging(self, capacity: int, stride: int) -> "PythonStaging":
        return PythonStaging(self, capacity, stride)


class PythonStaging:
    """Prefetched whole records by (layer, expert), read on the reader's background thread."""

    def __init__(self, reader: PythonReader, capacity: int, stride: int):
        self.reader = reader
        self.stride = stride
        self._buffers = [aligned_empty(stride) for _ in range(capacity)]
        self._free = list(range(capacity))
        self._entries: Dict[Tuple[int, int], Tuple[int, object]] = {}
        self._lock = threading.Lock()
        self._cancelled = 0

    def stage(self, layer: int, file: int, experts: np.ndarray, offsets: np.ndarray) -> int:
        """Start background reads of ``experts`` not yet staged; returns reads issued."""
        issued = 0
        for expert, offset in zip(experts.tolist(), offsets.tolist()):
            key = (layer, expert)
            with self._lock:
                if key in self._entries or not self._free:
                    continue
                slot = self._free.pop()
            buf = self._buffers[slot]
            future = self.reader.submit(self.reader.read_record, file, buf, offset)
            with self._lock:
                self._entries[key] = (slot, future)
            issued += 1
        return issued

    def take(
        self, layer: int, expert: int, segments: np.ndarray, dst_row: np.ndarray, want_crc: bool
    ) -> Optional[int]:
        """Move a staged record into its slot (waiting for a read in flight): its
        CRC-32, or None (not staged, failed, or cancelled unstarted): read it then."""
        with self._lock:
            entry = self._entries.pop((layer, expert), None)
        if entry is None:
            return None
        slot, future = entry
        if future.cancel():
            # Not started: the caller's demand read goes first instead.
            self._cancelled += 1
            self._release(slot)
            return None
        try:
            future.result()
        except Exception:
            self._release(slot)
            return None
        crc = scatter_record(self._buffers[slot], segments, dst_row, want_crc)
        self._release(slot)
        return crc

    def drop(self, layer: int) -> int:
        """Discard ``layer``'s untaken staged records; returns how many (wasted)."""
        with self._lock:
            keys = [k for k in self._entries if k[0] == layer]
            entries = [self._entries.pop(k) for k in keys]
        for slot, future in entries:
            # Cancel reads not started; a buffer is free once its read ended or was cancelled.
            self._cancelled += future.cancel()
            future.add_done_callback(lambda _, s=slot: self._release(s))
        return len(entries)

    def cancelled(self) -> int:
        """Staged reads cancelled before they started (never read), in total."""
        return self._cancelled

    def _release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)
