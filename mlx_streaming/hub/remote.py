"""The reader of a stream directory on the Hub: a miss is looked up in the
disk cache, else fetched by HTTP range (adjacent records of one call in
one request, requests in parallel), checked against the manifest's CRC-32
before it is used or cached; a record read back from the disk cache is
checked again each time.
"""

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import ExpertReadError
from ..format import LayerSpec, record_checksum
from ..io.python import PythonReader, aligned_empty, scatter_record
from .disk_cache import DiskCache
from .ranges import MAX_REQUEST_BYTES, ExpertFetchError, RangeFetcher

log = logging.getLogger(__name__)



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
    local = False

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
