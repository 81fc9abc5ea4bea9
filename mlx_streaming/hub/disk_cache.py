"""Fetched expert records kept on disk between runs, within a cap.

One file per record, written to a temporary name and renamed into place,
so a process killed mid-fetch leaves either the whole checked record or
nothing; the total never exceeds the cap (least recently used records go
first, across runs: the order is the files' mtime).
"""

import fcntl
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Dict

import numpy as np

from .ranges import ExpertFetchError

log = logging.getLogger(__name__)



TMP_SUFFIX = ".part"


class DiskCache:
    """Whole records as files under ``root``, at most ``cap_bytes`` in total.

    One process uses a cache directory at a time (an exclusive lock), so the
    cap holds; files left half-written by a killed process (``*.part``)
    are removed when the next one opens it.
    """

    def __init__(self, root: Path, cap_bytes: int):
        self.root = Path(root)
        self.cap = int(cap_bytes)
        self._warned = False  # about a failed write
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(self.root / ".lock", "w")
        except OSError as e:
            raise ExpertFetchError(
                f"cannot use the disk cache {self.root} ({e.strerror}); choose a writable "
                "disk_cache_dir, or disk_cache_gb=0 to keep no records") from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise ExpertFetchError(
                f"another process uses the disk cache {self.root}; wait for it to finish or "
                "give this one its own disk_cache_dir"
            ) from None
        self._lock = threading.Lock()
        self._index: "OrderedDict[str, int]" = OrderedDict()
        self._writing: set = set()  # keys being written (their bytes are in used)
        self.used = 0  # bytes of files, finished or being written
        self.hits = self.misses = self.evicted = 0
        self.users = 1  # models of this process that share it (open_cache)
        self._scan()

    def set_cap(self, cap_bytes: int) -> None:
        """Change the cap (evicting down to it now)."""
        with self._lock:
            self.cap = int(cap_bytes)
            self._make_room(0)

    def _scan(self) -> None:
        found = []
        for f in self.root.rglob("*"):
            if not f.is_file() or f.name == ".lock":
                continue
            if f.name.endswith(TMP_SUFFIX):
                f.unlink(missing_ok=True)  # a killed process's unfinished record
                continue
            st = f.stat()
            found.append((st.st_mtime_ns, str(f.relative_to(self.root)), st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used += size
        with self._lock:
            self._make_room(0)  # the cap may have been lowered since

    def close(self) -> None:
        """Release this user's hold; the last one unlocks the directory."""
        with _OPEN_LOCK:
            self.users -= 1
            if self.users > 0 or self._lock_file.closed:
                return
            _OPEN.pop(self.root.resolve(), None)
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()

    def get(self, key: str, buf: np.ndarray) -> bool:
        """Read the record ``key`` into ``buf``; False when not cached."""
        with self._lock:
            if key not in self._index:
                self.misses += 1
                return False
            self._index.move_to_end(key)
        path = self.root / key
        try:
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(memoryview(buf))
            os.utime(path)  # recency that outlives this process
        except OSError:
            got = -1
        if got != buf.nbytes:
            self.discard(key)
            with self._lock:
                self.misses += 1
            return False
        with self._lock:
            self.hits += 1
        return True

    def put(self, key: str, data) -> None:
        """Store a checked record (skipped when it alone exceeds the cap)."""
        nbytes = memoryview(data).nbytes
        with self._lock:
            if key in self._index or key in self._writing:
                return
            self._make_room(nbytes)
            if self.used + nbytes > self.cap:
                return  # the rest is reserved by writes in flight: skip, never overflow
            self.used += nbytes  # reserved before the file exists: the cap holds
            self._writing.add(key)
        path = self.root / key
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # its directory could not be made either
            with self._lock:
                self.used -= nbytes
                self._writing.discard(key)
            # Once per cache: a full disk would say so for every record.
            (log.debug if self._warned else log.warning)(
                "cannot write %s to the disk cache (%s); continuing without caching what "
                "fails to write", key, e.strerror)
            self._warned = True
            return
        with self._lock:
            self._index[key] = nbytes
            self._writing.discard(key)

    def discard(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used -= size
        if size is not None:
            (self.root / key).unlink(missing_ok=True)

    def _make_room(self, nbytes: int) -> None:
        """Evict least recently used records until ``nbytes`` more fit
        (caller holds the lock)."""
        while self._index and self.used + nbytes > self.cap:
            key, size = self._index.popitem(last=False)
            (self.root / key).unlink(missing_ok=True)
            self.used -= size
            self.evicted += 1

    def disk_bytes(self) -> int:
        """Bytes of record files on disk now (for tests: never above the cap)."""
        total = 0
        for f in self.root.rglob("*"):
            try:
                total += f.stat().st_size if f.is_file() and f.name != ".lock" else 0
            except FileNotFoundError:
                pass  # evicted meanwhile
        return total


# Disk caches open in this process, by directory.
_OPEN: Dict[Path, DiskCache] = {}
_OPEN_LOCK = threading.Lock()


def open_cache(root: Path, cap_bytes: int) -> DiskCache:
    """The disk cache at ``root``, shared by the models of this process (the
    directory lock is per process); the cap is the one it was opened with."""
    key = Path(root).resolve()
    with _OPEN_LOCK:
        cache = _OPEN.get(key)
        if cache is not None:
            if cache.cap != int(cap_bytes):
                log.warning("disk cache %s is already open with a cap of %d bytes; "
                            "keeping that cap", root, cache.cap)
            cache.users += 1
            return cache
        cache = _OPEN[key] = DiskCache(root, cap_bytes)
        return cache
