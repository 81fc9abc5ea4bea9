"""The expert store of one MoE layer: ``ensure(experts)`` brings experts into
its slot pool, from prefetch's staging or from the blob
(docs/design.md, "runtime/store.py")."""

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import CorruptExpertError, ExpertReadError
from ..format import LayerSpec
from .events import Events
from .policy import LRU, Adaptive, DecayedLFU, Policy
from .pool import SlotPool, distinct


class BlobWatch:
    """Notices a blob rewritten or replaced on disk after it was opened."""

    def __init__(self, path):
        self.path = path
        self.identity = self._identity()

    def _identity(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        # ctime too: a file rewritten with its mtime put back still changes it.
        return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def changed(self) -> bool:
        """True once per change (the new state becomes the reference)."""
        now = self._identity()
        if now == self.identity:
            return False
        self.identity = now
        return True


@dataclass(frozen=True)
class RecordSource:
    """Where a layer's records come from: the reader and blob handle, prefetch's
    staging (or None), the blob's path to watch (None: the reader checks)."""

    reader: object
    file: int
    staging: object = None
    blob: Optional[Path] = None


class ExpertStore:
    """Brings one layer's experts into its pool, checking their CRC-32 as
    ``checksums`` says (docs/design.md, "Reads")."""

    def __init__(self, spec: LayerSpec, pool: SlotPool, source: RecordSource,
                 policy: Optional[Policy] = None, checksums: str = "first-read",
                 events: Events = Events(())):
        self.spec = spec
        self.layer = spec.layer
        self.pool = pool
        self.source = source
        self.policy = (policy or LRU(spec.num_experts)).bind(pool.expert_of_slot)
        self.reader = source.reader
        self.file = source.file
        self.staging = source.staging
        self.events = events
        self.crcs = np.array(spec.checksums, dtype=np.uint32)
        self.expert_nbytes = spec.expert_nbytes
        self.checksums = checksums
        # Experts whose checksum still has to be checked on their next read.
        self.unchecked = np.full(spec.num_experts, checksums != "off", dtype=bool)
        # A blob rewritten mid-run must give an error, never bytes checked before.
        self.watch = (BlobWatch(source.blob)
                      if source.blob is not None and checksums == "first-read" else None)

    def resize(self, slots: int) -> None:
        """Resize the pool to ``slots``, keeping what the policy values most."""
        slots = min(slots, self.spec.num_experts)
        held = np.nonzero(self.pool.expert_of_slot >= 0)[0]
        if self.pool.slots > slots:
            # Empty slots go first, then the least valuable experts.
            drop = self.policy.victims(self.pool.slots - slots, np.array([], np.int64))
            held = np.setdiff1d(held, drop)
        self.pool.resize(slots, held)
        self.policy.bind(self.pool.expert_of_slot)

    def resident(self, experts: np.ndarray) -> np.ndarray:
        return self.pool.slot_of_expert[experts] >= 0

    def route(self, ids: np.ndarray, probs: Optional[np.ndarray] = None):
        """``(hits per (token, expert) pair, distinct experts)`` of ``ids`` [..., top_k]."""
        experts = distinct(ids)
        hits = int(np.count_nonzero(self.pool.slot_of_expert[ids] >= 0))
        self.policy.observe(experts, ids.reshape(-1, ids.shape[-1]), probs)
        return hits, experts

    def ensure(self, experts: np.ndarray, last: bool = True) -> float:
        """Make the distinct ``experts`` resident; returns the seconds it took.
        The caller guarantees that no pending computation reads the slots the
        misses take (never those of ``experts``)."""
        slots = self.pool.slot_of_expert[experts]
        hit = slots >= 0
        missing = experts[~hit]
        if not len(missing):
            return 0.0
        victims = self.policy.victims(len(missing), protected=slots[hit])
        return self.load(missing, victims, last)

    def load(self, experts: np.ndarray, slots: np.ndarray, last: bool = True) -> float:
        """Read ``experts`` into ``slots`` and map them; returns the seconds."""
        start = time.perf_counter()
        # Unmapped until read and checked: if anything raises, nothing maps here.
        self.pool.evict(slots)
        want_crc = self._want_crc(experts)
        crcs = self._fill(experts, slots, want_crc, last)
        if self.watch is not None and self.watch.changed():
            # The blob changed: check these bytes, and later first reads, again.
            self.unchecked[:] = True
            want_crc = self._want_crc(experts)
            crcs = self._fill(experts, slots, want_crc)
        self._check(experts, want_crc, crcs)
        self.pool.assign(experts, slots)
        self.policy.filled(experts)
        return time.perf_counter() - start

    def _want_crc(self, experts: np.ndarray) -> np.ndarray:
        if self.checksums == "always":
            return np.ones(len(experts), dtype=bool)
        return self.unchecked[experts]

    def preload(self) -> None:
        """Read every expert into the slot of the same index (all resident)."""
        experts = np.arange(self.spec.num_experts)
        self.events.on_stall(self.layer, self.load(experts, experts))  # at load

    def _fill(self, experts, slots, want_crc, last=True) -> np.ndarray:
        if self.staging is None:
            return self._read(experts, slots, want_crc)
        crcs = np.zeros(len(experts), dtype=np.uint32)
        from_disk = np.ones(len(experts), dtype=bool)
        useful = self._take_staged(experts, slots, want_crc, crcs, from_disk)
        self.events.on_prefetch(self.layer, useful=useful)
        if last:
            # The rest of this layer's staging is wasted (a chunked call keeps it).
            self.drop_staged()
        if from_disk.any():
            crcs[from_disk] = self._read(
                experts[from_disk], slots[from_disk], want_crc[from_disk]
            )
        return crcs

    def _read(self, experts, slots, want_crc) -> np.ndarray:
        start = time.perf_counter()
        crcs = self.reader.read(
            self.file,
            self._offsets(experts),
            self.pool.segments,
            self.pool.addresses[slots],  # [experts, segments] destination addresses
            want_crc,
            self.spec.stride,
        )
        nbytes = len(experts) * self.expert_nbytes
        self.events.on_read(self.layer, len(experts), nbytes, time.perf_counter() - start)
        return crcs

    def stage(self, experts: np.ndarray) -> int:
        """Start reading ``experts`` into staging (prefetch); returns reads issued."""
        return self.staging.stage(self.layer, self.file, experts, self._offsets(experts))

    def _offsets(self, experts: np.ndarray) -> np.ndarray:
        return self.spec.record_offset(experts.astype(np.int64))

    def _take_staged(self, experts, slots, want_crc, crcs, from_disk) -> int:
        useful = 0
        for i, (e, s) in enumerate(zip(experts.tolist(), slots.tolist())):
            crc = self.staging.take(
                self.layer, e, self.pool.segments, self.pool.addresses[s], bool(want_crc[i])
            )
            if crc is not None:
                crcs[i] = crc
                from_disk[i] = False
                useful += 1
        return useful

    def _check(self, experts, want_crc, crcs) -> None:
        if not want_crc.any():
            return
        bad = want_crc & (crcs != self.crcs[experts])
        if bad.any():
            raise CorruptExpertError(
                self.layer, int(experts[bad][0]), "checksum mismatch"
            )
        self.unchecked[experts] = False

    def drain_counters(self) -> None:
        """Forget counts not yet reported (the native store's graph calls)."""

    def drop_staged(self) -> None:
        if self.staging is not None:
            dropped = self.staging.drop(self.layer)
            if dropped:
                self.events.on_prefetch(self.layer, wasted=dropped)


NATIVE_POLICIES = (LRU, DecayedLFU, Adaptive)


class NativeStore(ExpertStore):
    """``ExpertStore`` with ``route`` and ``ensure`` as one C++ step each
    (native/paged.cpp), on the same arrays (docs/design.md, "runtime/store.py")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        reader = self.reader
        # The native step watches the blob (after its reads, as load() does).
        blob = str(self.watch.path) if self.watch is not None else ""
        self.watch = None
        self.ext = reader.ext
        self.index = reader.native_handle.paged_index(
            self.file, self.spec.stride, self.pool.segments,
            getattr(self.policy, "decay", 1.0), getattr(self.policy, "regret_decay", 1.0),
            getattr(self.policy, "lru_margin", 1.0),
            getattr(self.ext.Checksums, self.checksums.replace("-", "_")), blob)
        self.index.clock = self.policy.clock
        # (calls, records read, seconds) of graph calls since ``take_graph_reads``.
        self._graph_reads = (0, 0, 0.0)
        self._bind()

    def _bind(self) -> None:
        pool, policy = self.pool, self.policy
        self.index.bind(pool.slot_of_expert, pool.expert_of_slot, pool.addresses,
                        policy.last_use, getattr(policy, "score", None), self.crcs,
                        self.unchecked, getattr(policy, "shadow", None),
                        getattr(policy, "misses", None))

    def resize(self, slots: int) -> None:
        try:
            super().resize(slots)
        finally:
            self._bind()  # the pool's arrays were reallocated (or kept, if it failed)

    def route(self, ids: np.ndarray, probs: Optional[np.ndarray] = None):
        # The native policies do not weigh the router's probabilities.
        if ids.dtype != np.uint32:
            ids = ids.astype(np.uint32)
        try:
            out = self.index.route(ids)
        except self.ext.ReadError as e:
            raise self._read_error(str(e)) from None
        self.policy.clock = self.index.clock
        return out

    def ensure(self, experts: np.ndarray, last: bool = True) -> float:
        try:
            done = self.index.ensure(experts)
        except self.ext.ReadError as e:
            raise self._read_error(str(e)) from None
        read, bad, read_s, load_s = done.read, done.bad, done.read_s, done.load_s
        if not read:
            return 0.0
        self.events.on_read(self.layer, read, read * self.expert_nbytes, read_s)
        if bad >= 0:
            raise CorruptExpertError(self.layer, bad, "checksum mismatch")
        return load_s

    def _read_error(self, message: str) -> ExpertReadError:
        if self.reader.closed:
            return ExpertReadError("this model was closed; load it again to use it")
        return ExpertReadError(message)

    def remap(self, indices):
        """The slots of ``indices`` (at most ``pool.slots``) as a graph array: no
        host sync; ``flush`` reports the calls and raises failures after the pass."""
        return self.ext.paged_remap(indices, self.pool.table, self.index)

    def take_graph_reads(self):
        """(calls, records, seconds) of the graph's calls since the last take."""
        reads, self._graph_reads = self._graph_reads, (0, 0, 0.0)
        return reads

    def drain_counters(self) -> None:
        """Forget the calls made inside the graph not yet reported."""
        self.index.take_counters()

    def flush(self) -> None:
        """After a pass: report the graph's calls and raise the first failure."""
        c = self.index.take_counters()
        self.policy.clock = self.index.clock
        done = self._graph_reads
        self._graph_reads = (done[0] + c.calls, done[1] + c.records, done[2] + c.stall_s)
        if c.calls:
            self.events.on_graph_calls(self.layer, c.calls, c.tokens, c.hits, c.misses,
                                       c.distinct, c.records, c.records * self.expert_nbytes,
                                       c.read_s, c.stall_s)
        error = self.index.take_error()
        if error is None:
            return
        if error.kind == self.ext.Failure.checksum:
            raise CorruptExpertError(self.layer, error.expert, error.message)
        if error.kind == self.ext.Failure.read:
            raise self._read_error(error.message)
        raise ExpertReadError(f"layer {self.layer}: {error.message}")
