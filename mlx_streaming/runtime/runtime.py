"""What a streaming model carries besides its modules (``model.streaming``),
and the watch that resizes its pools under memory pressure."""

import logging
import math
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import List, Optional, Tuple

import mlx.core as mx

from ..config import StreamConfig
from ..errors import BudgetError
from ..format import Manifest
from ..system import available_memory_bytes
from .block import Paged
from .events import Events
from .memory import GB, MemoryPlan, max_slots, reserved_plan
from .prefetch.factory import make_prefetch
from .stats import SpecStats, Stats
from .store import ExpertStore, NativeStore
from .trace import TraceWriter

log = logging.getLogger(__name__)

# Every Runtime not yet closed (the tests close what a test left open).
OPEN: "weakref.WeakSet[Runtime]" = weakref.WeakSet()


class Runtime:
    """``model.streaming``: config, reader, stores, prefetch, observers. It owns
    the lock of one forward pass at a time, each pass's end, resizing, ``close``."""

    def __init__(self, config: StreamConfig, manifest: Manifest, plan: MemoryPlan, reader,
                 reasons: Tuple[str, str]):
        self.config = config
        self.manifest = manifest
        self.plan = plan
        self.reader = reader
        # Why this reader, and why (not) uncached reads.
        self.io_reason, self.direct_io_reason = reasons
        self.slots = plan.slots
        # A trace needs each call's ids, which only paged blocks sync for.
        self.paged = plan.slots < max_slots(manifest) or config.trace is not None
        # Paged pools are rewritten in place: one forward pass at a time.
        self.lock = threading.RLock()
        self.closed = False
        self.stores: List[ExpertStore] = []
        self.residencies: List[Paged] = []
        # cache_aware.CacheAwareRouter of each layer: paged ones when not exact, all for top-k-cut.
        self.routers = []
        # Compares the routers' choices across tensor-parallel ranks, or None.
        self.routing_check = None
        self.path = None  # residency.HotPath, chosen when the blocks are installed
        self.ring = None  # the SpineRing of streamed spine layers, if any
        self.sharding = None  # sharding.Sharding of a model split over ranks, if any
        self.spine_reader = None  # the ring's own reader, when the experts' is remote
        self._overlap = None  # the thread that reads misses while experts compute
        self._cache_limit = None  # MLX's buffer cache limit before cap_buffer_cache
        self.stats = Stats([spec.layer for spec in manifest.layers])
        self.speculative = SpecStats()  # drafts through this model
        # Prefetch's staging is the reader's: a failure here releases the reader.
        try:
            self.prefetch = make_prefetch(config, manifest, reader, self.paged)
            self.trace = TraceWriter(config.trace) if config.trace else None
        except BaseException:
            reader.close()
            raise
        # Who hears the paged calls: the counters, the trace, prefetch's learners.
        self.events = Events([self.stats] + ([self.trace] if self.trace else [])
                             + ([self.prefetch.control] if self.paged else []))
        self.pressure = None  # a PressureWatch once the pools exist (paged only)
        OPEN.add(self)

    def overlap_reads(self) -> Optional[ThreadPoolExecutor]:
        """The one worker that reads misses while experts compute (None: ``overlap`` off)."""
        if self.config.overlap and self._overlap is None:
            self._overlap = ThreadPoolExecutor(1, thread_name_prefix="mlx_streaming-reads")
        return self._overlap

    @property
    def pool_bytes(self) -> int:
        return sum(s.pool.nbytes for s in self.stores)

    def close(self) -> None:
        """Release files, reader threads and staging (waits for reads ahead); idempotent."""
        with self.lock:  # never under a forward pass of another thread
            if self.closed:
                return
            self.closed = True
            OPEN.discard(self)
            if self.trace is not None:
                self.trace.close()
            if self.ring is not None:
                self.ring.close()
            if self.spine_reader is not None:
                self.spine_reader.close()
            if self._overlap is not None:
                for residency in self.residencies:
                    residency.overlap = None  # later calls fail as a closed model's do
                self._overlap.shutdown(wait=True)
            for store in self.stores:
                if isinstance(store, NativeStore):
                    store.index.unbind()  # a lazy graph left behind reads nothing
            self.reader.close()
            if self._cache_limit is not None:
                mx.set_cache_limit(self._cache_limit)

    def cap_buffer_cache(self, nbytes: int) -> None:
        """Keep at most ``nbytes`` of freed buffers in MLX's cache (process-wide, put
        back at ``close``): with a small headroom, a prefill's would stay there."""
        previous = mx.set_cache_limit(nbytes)
        if self._cache_limit is None:
            self._cache_limit = previous

    @contextmanager
    def call(self):
        """One forward pass over the pools, from any thread: under the lock, after
        the pressure watch, with every pool reader evaluated at the end."""
        with self.lock:
            if self.pressure is not None:
                self.pressure.between_calls()
            try:
                yield
            except BaseException:
                # Finish the failed pass's pool readers now, their failures unreported.
                self.finish_pending(report=False)
                raise
            self.finish_pending()

    def reserve(self, nbytes: int, what: str) -> None:
        """Keep ``nbytes`` of the plan's room for ``what`` (a batch's KV caches):
        the pools give up the slots it needs, for good; BudgetError where even
        the smallest pools (or every expert resident) leave too little."""
        plan = reserved_plan(self.plan, self.manifest, nbytes, what)
        if plan.slots < self.slots:
            if not self.paged:
                raise BudgetError(
                    f"{what} needs {nbytes / 1e9:.3g} GB beside every expert resident: load "
                    f"fewer with --slots-per-layer {plan.slots} or less")
            self.resize(plan.slots)
            if self.pressure is not None:
                self.pressure.cap(plan.slots)
        self.plan = plan

    def resize(self, slots: int) -> None:
        """Give every paged pool ``slots`` slots (``PressureWatch``)."""
        with self.lock:  # the native step writes the tables without the GIL
            self._resize(slots)

    def _resize(self, slots: int) -> None:
        self.finish_pending()
        if self.prefetch.staging is not None:
            for store in self.stores:
                store.drop_staged()
        for store in self.stores:
            store.resize(slots)
        self.slots = slots
        mx.clear_cache()  # hand the freed buffers back to the OS

    def finish_pending(self, report: bool = True) -> None:
        """Evaluate every computation that still reads a pool, then report the graph's
        calls and raise the first failure (``report=False``: drop them)."""
        pending = [y for p in self.residencies for y in p.pending]
        for p in self.residencies:
            p.pending = []
        counts = [r.take_counts() for r in self.routers]
        for router in self.routers:
            router.restore()  # a pass that raised between a router and its block
        try:
            mx.eval(pending, counts)
            for router, taken in zip(self.routers, counts):
                router.passed_over += sum(int(c.item()) for c in taken)
        except Exception:
            if report:
                raise
        if self.ring is not None:
            self.ring.finish()
        failure = None
        for store in self.stores:
            if isinstance(store, NativeStore):
                # Every store, even after a failure: none may keep an error for a later pass.
                try:
                    store.flush()
                except Exception as e:
                    failure = failure or e
        if failure is not None and report:
            raise failure
        if self.routing_check is not None:
            self.routing_check.finish(report)


CHECK_EVERY = 8  # model calls between reads of the available memory


class PressureWatch:
    """Shrinks ``runtime``'s pools when other programs need the memory, and grows
    them back when it returns (docs/design.md, "Memory pressure")."""

    def __init__(self, runtime, threshold_bytes: int, per_slot: int, min_slots: int,
                 available=available_memory_bytes, every: int = CHECK_EVERY):
        self.runtime = runtime
        self.threshold = threshold_bytes
        self.per_slot = per_slot
        self.min_slots = min_slots
        self.max_slots = runtime.slots  # what load chose; never grown beyond
        self.available = available
        self.every = every
        self.calls = 0
        self.shrinks = self.grows = 0
        self.lowest = None

    def between_calls(self) -> None:
        self.calls += 1
        if self.calls % self.every:
            return
        available = self.available()
        self.lowest = available if self.lowest is None else min(self.lowest, available)
        slots = self.runtime.slots
        if available < self.threshold and slots > self.min_slots:
            short = math.ceil((self.threshold - available) / self.per_slot)
            target = max(self.min_slots, slots - short)
            log.warning("available memory %.3g GB is below %.3g GB: expert pools shrink "
                        "from %d to %d slots per layer", available / GB, self.threshold / GB,
                        slots, target)
            self.runtime.resize(target)
            self.shrinks += 1
        elif slots < self.max_slots:
            # Half the room: a second program growing too does not push us back under.
            room = (available - self.threshold) // 2
            target = min(self.max_slots, slots + int(room // self.per_slot))
            if target > slots:
                self.runtime.resize(target)
                self.grows += 1

    def cap(self, slots: int) -> None:
        """Grow the pools back no further than ``slots``."""
        self.max_slots = min(self.max_slots, slots)

    def report(self) -> dict:
        return dict(threshold_gb=self.threshold / GB, shrinks=self.shrinks, grows=self.grows,
                    slots_at_load=self.max_slots,
                    lowest_available_gb=None if self.lowest is None else self.lowest / GB)
