"""Expert records fetched over HTTP by range, kept in a bounded disk cache.

A stream directory uploaded to the Hugging Face Hub need not be on disk: the
records of a blob are fixed-size and aligned, so expert ``e`` of a layer is
bytes ``[e * stride, (e + 1) * stride)`` of its blob, one HTTP range
request. ``RemoteReader`` has the reader interface (``readers.py``): a
miss is looked up in the ``DiskCache``, else fetched (adjacent records of one
call in one request, requests in parallel, retried with backoff), checked
against the manifest's CRC-32 before it is used or cached, and cached; a
record read back from the disk cache is checked again each time.

The disk cache holds one file per record, written to a temporary name and
renamed into place, so a process killed mid-fetch leaves either the whole
checked record or nothing; its total never exceeds ``disk_cache_gb``
(least recently used records go first, across runs: the order is the files'
mtime).
"""

import fcntl
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple
from urllib.parse import urlparse

import numpy as np

from .errors import ExpertReadError, first_line
from .format import LayerSpec, record_checksum
from .readers import PythonReader, aligned_empty, scatter_record

log = logging.getLogger(__name__)

# One request never asks for more than this many bytes: a long run of
# adjacent misses becomes several requests, which run in parallel.
MAX_REQUEST_BYTES = 64 << 20
RETRY_STATUS = (429, 500, 502, 503, 504)
# A server's Retry-After is honoured up to this many seconds.
MAX_RETRY_AFTER = 60.0
# A try fails when its body arrives slower than this (after fetch_timeout).
MIN_RATE = 256e3
TMP_SUFFIX = ".part"


class ExpertFetchError(ExpertReadError):
    """Fetching expert records over HTTP failed."""


# -- HTTP ------------------------------------------------------------------


class RangeFetcher:
    """Byte ranges of URLs, with retries, backoff and a timeout on every
    network wait. The session, headers and token are huggingface_hub's."""

    def __init__(self, headers: dict, timeout: float, retries: int, backoff: float = 0.5):
        import httpx2

        self.httpx = httpx2
        self.headers = dict(headers)
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.requests = 0
        self.bytes = 0
        self._warned_full = False
        self._lock = threading.Lock()
        # Set when the model closes: fetches stop retrying and waiting.
        self.cancelled = threading.Event()

    def fetch(self, url: str, start: int, nbytes: int) -> bytearray:
        """Bytes ``[start, start + nbytes)`` of ``url``.

        Raises:
            ExpertFetchError: no complete answer after ``retries`` retries,
                or an answer that retrying cannot change (401, 404, ...).
        """
        last, wait = None, 0.0
        for attempt in range(self.retries + 1):
            if attempt and self.cancelled.wait(max(wait, self.backoff * 2 ** (attempt - 1))):
                break
            if self.cancelled.is_set():
                break
            try:
                data = self._once(url, start, nbytes)
            except _Retry as e:
                last, wait = str(e), min(MAX_RETRY_AFTER, e.after)
                log.warning("range %d+%d of %s: %s (try %d of %d)", start, nbytes, url,
                            last, attempt + 1, self.retries + 1)
                continue
            with self._lock:
                self.requests += 1
                self.bytes += nbytes
            return data
        if self.cancelled.is_set():
            raise ExpertFetchError("the model was closed while an expert was being fetched")
        host = urlparse(url).netloc
        raise ExpertFetchError(
            f"could not fetch bytes {start}-{start + nbytes - 1} of {url} after "
            f"{self.retries + 1} tries (last: {last}); check the network and {host}, or raise "
            "fetch_timeout / fetch_retries"
        )

    def _once(self, url: str, start: int, nbytes: int) -> bytearray:
        from huggingface_hub.utils import get_session, hf_raise_for_status

        headers = {**self.headers, "Range": f"bytes={start}-{start + nbytes - 1}",
                   "Accept-Encoding": "identity"}
        try:
            with get_session().stream("GET", url, headers=headers, timeout=self.timeout,
                                      follow_redirects=True) as r:
                if r.status_code in RETRY_STATUS:
                    after = _retry_after(r.headers.get("Retry-After"))
                    what = "rate limited" if r.status_code == 429 else "server error"
                    raise _Retry(f"HTTP {r.status_code} ({what}"
                                 + (f", retry after {after:g} s)" if after else ")"), after)
                if r.status_code not in (200, 206):
                    r.read()
                    try:
                        hf_raise_for_status(r)
                    except Exception as e:
                        raise ExpertFetchError(
                            f"{url} answered HTTP {r.status_code} ({first_line(e)}); "
                            f"{_status_hint(r.status_code)}") from None
                    raise ExpertFetchError(f"{url} answered HTTP {r.status_code}")
                skip = 0
                if r.status_code == 200:
                    skip = start
                    self._warn_full(url)
                else:
                    _check_content_range(r.headers.get("Content-Range"), start, nbytes)
                return self._body(r, skip, nbytes, self._deadline(skip + nbytes))
        except self.httpx.TimeoutException:
            raise _Retry(f"no answer within {self.timeout:g} s") from None
        except self.httpx.TransportError as e:
            raise _Retry(f"{type(e).__name__}: {first_line(e)}") from None

    def _deadline(self, nbytes: int) -> float:
        """When a try that reads ``nbytes`` gives up: a server that trickles
        bytes never lets a read time out, so the whole body has a deadline."""
        return time.monotonic() + self.timeout + nbytes / MIN_RATE

    def _body(self, r, skip: int, nbytes: int, deadline: float) -> bytearray:
        """``nbytes`` of the body after its first ``skip`` bytes."""
        out = bytearray(nbytes)
        pos = -skip
        for chunk in r.iter_raw():
            if time.monotonic() > deadline or self.cancelled.is_set():
                raise _Retry(f"slower than {MIN_RATE / 1e3:g} KB/s after the first "
                             f"{self.timeout:g} s")
            lo = max(0, -pos)
            if lo < len(chunk):
                take = chunk[lo : lo + nbytes - max(pos, 0)]
                out[max(pos, 0) : max(pos, 0) + len(take)] = take
            pos += len(chunk)
            if pos >= nbytes:
                return out
        raise _Retry(f"the answer ended after {max(pos, 0)} of {nbytes} bytes")

    def _warn_full(self, url: str) -> None:
        if not self._warned_full:
            self._warned_full = True
            log.warning(
                "%s ignores HTTP Range requests (it answered 200 with the whole file): "
                "each expert read downloads the blob up to that expert; serve the repo from "
                "a server with Range support", url)


class _Retry(Exception):
    """A failure that another try may not have (``after``: seconds the
    server asked to wait)."""

    def __init__(self, what: str, after: float = 0.0):
        super().__init__(what)
        self.after = after


def _retry_after(header: Optional[str]) -> float:
    try:
        return max(0.0, float(header)) if header else 0.0
    except ValueError:
        return 0.0  # an HTTP date: fall back to our own backoff


def _status_hint(status: int) -> str:
    if status in (401, 403):
        return ("the repo is private or gated: log in with `hf auth login` or set HF_TOKEN, "
                "and accept its terms on the Hub")
    if status == 404:
        return "the repo or revision has no such file; check the repo id and revision"
    if status == 416:
        return "the blob on the server is shorter than the manifest says; re-upload it"
    return "check the repo and the server"


def _check_content_range(header: Optional[str], start: int, nbytes: int) -> None:
    want = f"bytes {start}-{start + nbytes - 1}/"
    if header is None or not header.startswith(want):
        raise _Retry(f"the server answered range {header!r}, not {want}*")


# -- disk cache --------------------------------------------------------------


class DiskCache:
    """Whole records as files under ``root``, at most ``cap_bytes`` in total.

    One process uses a cache directory at a time (an exclusive lock), so the
    cap holds; files left half-written by a killed process (``*.part``)
    are removed when the next one opens it.
    """

    def __init__(self, root: Path, cap_bytes: int):
        self.root = Path(root)
        self.cap = int(cap_bytes)
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
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.used -= nbytes
                self._writing.discard(key)
            log.warning("cannot write %s to the disk cache (%s); continuing without it",
                        key, e.strerror)
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


# -- reader ------------------------------------------------------------------


@dataclass
class RemoteBlob:
    """Where a layer's blob is served, and what its records must hash to."""

    url: str
    spec: LayerSpec
    key: str  # the blob's directory in the disk cache


class RemoteReader(PythonReader):
    """Expert records from a disk cache or HTTP range requests, into slot
    memory: ``PythonReader``'s interface (and its staging, for prefetch).

    Args:
        blobs: the blob of each layer, by the path the loader opens.
        fetcher: the HTTP side.
        cache: the disk cache, or None to keep nothing on disk.
        threads: parallel range requests.
    """

    name = "remote"

    def __init__(self, blobs: Dict[str, RemoteBlob], fetcher: RangeFetcher,
                 cache: Optional[DiskCache], threads: int):
        super().__init__(threads, direct=False)
        self.blobs_by_path = blobs
        self.fetcher = fetcher
        self.cache = cache
        self._opened: List[RemoteBlob] = []
        self.corrupt_refetches = 0

    def open(self, path: str) -> int:
        blob = self.blobs_by_path.get(str(path))
        if blob is None:
            raise ExpertReadError(f"no remote blob for {path}")
        self._opened.append(blob)
        return len(self._opened) - 1

    def close(self) -> None:
        self.fetcher.cancelled.set()  # fetches in flight give up instead of retrying
        super().close()
        if self.cache is not None:
            self.cache.close()

    def reset(self) -> None:
        """Zero the counters (``reset_stats``)."""
        self.fetcher.requests = self.fetcher.bytes = 0
        self.corrupt_refetches = 0
        if self.cache is not None:
            self.cache.hits = self.cache.misses = self.cache.evicted = 0

    def report(self) -> dict:
        """Network and disk-cache counters (``stats()["remote"]``)."""
        cache = self.cache
        return dict(
            requests=self.fetcher.requests,
            bytes_fetched=self.fetcher.bytes,
            corrupt_refetches=self.corrupt_refetches,
            disk_cache_bytes=cache.used if cache else 0,
            disk_cache_cap=cache.cap if cache else 0,
            disk_cache_hits=cache.hits if cache else 0,
            disk_cache_misses=cache.misses if cache else 0,
            disk_cache_evicted=cache.evicted if cache else 0,
        )

    def read(self, file, offsets, segments, dst, checksum, stride) -> np.ndarray:
        self._check_open()
        experts = (np.asarray(offsets, dtype=np.int64) // stride).tolist()
        records = self.records(file, experts)
        crcs = np.zeros(len(experts), dtype=np.uint32)
        for i, record in enumerate(records):
            crcs[i] = scatter_record(record, segments, dst[i], bool(checksum[i]))
        return crcs

    def read_record(self, file: int, buf: np.ndarray, offset: int) -> None:
        stride = self._opened[file].spec.stride
        buf[:] = self.records(file, [offset // stride])[0]

    def records(self, file: int, experts: List[int]) -> List[np.ndarray]:
        """The checked whole records of ``experts`` of blob ``file``, from
        the disk cache or the network (metered as one read)."""
        self.meter.begin()
        out = []
        try:
            out = self._records(self._opened[file], experts)
        finally:
            self.meter.end(sum(r.nbytes for r in out))
        return out

    def _records(self, blob: RemoteBlob, experts: List[int]) -> List[np.ndarray]:
        out: List[Optional[np.ndarray]] = [None] * len(experts)
        missing = []
        for i, e in enumerate(experts):
            record = self._cached(blob, e)
            if record is None:
                missing.append(i)
            else:
                out[i] = record
        if missing:
            fetched = self._fetch(blob, sorted({experts[i] for i in missing}))
            for i in missing:
                out[i] = fetched[experts[i]]
        return out

    def _cached(self, blob: RemoteBlob, expert: int) -> Optional[np.ndarray]:
        if self.cache is None:
            return None
        buf = aligned_empty(blob.spec.stride)
        key = f"{blob.key}/{expert:06d}"
        if not self.cache.get(key, buf):
            return None
        # Every read is checked: the files may change under a running model.
        if not self._good(blob.spec, expert, buf):
            log.warning("disk cache record %s is damaged; fetching it again", key)
            self.cache.discard(key)
            return None
        return buf

    def _fetch(self, blob: RemoteBlob, experts: List[int]) -> Dict[int, np.ndarray]:
        """Fetch sorted distinct ``experts``: one request per run of adjacent
        ids, the requests in parallel."""
        runs = _runs(experts, max(1, MAX_REQUEST_BYTES // blob.spec.stride))
        if len(runs) == 1:
            results = [self._fetch_run(blob, runs[0])]
        else:
            results = list(self._pool.map(lambda run: self._fetch_run(blob, run), runs))
        return {e: rec for part in results for e, rec in part.items()}

    def _fetch_run(self, blob: RemoteBlob, run: Tuple[int, int]) -> Dict[int, np.ndarray]:
        first, count = run
        stride = blob.spec.stride
        data = np.frombuffer(
            self.fetcher.fetch(blob.url, blob.spec.record_offset(first), count * stride),
            np.uint8)
        out = {}
        for j in range(count):
            e = first + j
            record = data[j * stride : (j + 1) * stride]
            if not self._good(blob.spec, e, record):
                record = self._refetch(blob, e)
            self._store(blob, e, record)
            out[e] = record
        return out

    def _refetch(self, blob: RemoteBlob, expert: int) -> np.ndarray:
        """A record whose bytes failed their CRC: fetched once more alone;
        wrong twice is an error, and wrong bytes are never cached."""
        self.corrupt_refetches += 1
        stride = blob.spec.stride
        log.warning("layer %d expert %d from %s failed its checksum; fetching it again",
                    blob.spec.layer, expert, blob.url)
        record = np.frombuffer(
            self.fetcher.fetch(blob.url, blob.spec.record_offset(expert), stride), np.uint8)
        if not self._good(blob.spec, expert, record):
            raise ExpertFetchError(
                f"layer {blob.spec.layer}, expert {expert}: the bytes fetched from "
                f"{blob.url} fail the manifest's checksum twice; the uploaded blob does not "
                "match its manifest (re-upload the stream directory) or something on the "
                "way alters the data"
            )
        return record

    def _store(self, blob: RemoteBlob, expert: int, record: np.ndarray) -> None:
        if self.cache is not None:
            self.cache.put(f"{blob.key}/{expert:06d}", record)

    @staticmethod
    def _good(spec: LayerSpec, expert: int, record: np.ndarray) -> bool:
        parts = (record[s.offset : s.offset + s.nbytes] for s in spec.segments)
        return record_checksum(parts) == spec.checksums[expert]


def _runs(experts: List[int], max_len: int) -> List[Tuple[int, int]]:
    """Sorted distinct ids as ``(first, count)`` runs of adjacent ids."""
    runs: List[Tuple[int, int]] = []
    for e in experts:
        if runs and runs[-1][0] + runs[-1][1] == e and runs[-1][1] < max_len:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((e, 1))
    return runs
