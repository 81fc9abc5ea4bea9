"""The expert block that replaces mlx-lm's ``SwitchGLU`` / ``SwitchMLP``:
the router's expert ids become slot ids of a pool, and mlx-lm's own module
computes with them. Residencies: ``Resident``, ``Paged``, ``NativePaged``
(docs/design.md, "runtime/block.py")."""
import math
import time
from concurrent.futures import wait

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .events import Events
from .prefetch.learn import NoPrefetch
from .store import ExpertStore

# Misses expected to take this long make a call overlap, and on the CPU a
# layer's decode calls leave the graph (docs/design.md, "runtime/block.py").
OVERLAP_MIN_READ_S = 1e-3


OVERLAP_SMOOTHING = 0.2


# Back into the graph only below this share of the bar: no flapping at it.
OVERLAP_RETURN_SHARE = 0.5


# mlx-lm sorts a call of this many ids or more by expert: never split.
SORTED_GATHER_IDS = 64


def _finished(future):
    """The worker's reads, waited for even through an interrupt (re-raised
    after): they write slots the next call could hand out again."""
    interrupted = None
    while True:
        try:
            wait([future])
            break
        except KeyboardInterrupt as e:
            interrupted = e
    if interrupted is not None:
        raise interrupted
    return future.result()


class StreamingExperts(nn.Module):
    """Drop-in for ``SwitchGLU``/``SwitchMLP``, experts gathered from a slot pool."""

    def __init__(self, inner: nn.Module, residency, after_routing=None):
        super().__init__()
        self.inner = inner
        self.residency = residency
        # Called first: cache-aware routing's ``CacheAwareRouter.restore``.
        self.after_routing = after_routing

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self.after_routing is not None:
            self.after_routing()
        return self.residency(self.inner, x, indices)


def call_tokens(indices: mx.array) -> int:
    return indices.size // indices.shape[-1]


class Resident:
    """Every expert resident with slot == expert id: mlx-lm's own call."""

    def __init__(self, layer: int, events: Events):
        self.layer = layer
        self.events = events

    def __call__(self, inner, x, indices):
        self.events.on_call(self.layer, call_tokens(indices))
        self.events.on_lookup(self.layer, indices.size, 0)
        return inner(x, indices)


class Paged:
    """A partial pool: one host sync per call, misses read into slots, ids
    remapped to slots on the device (docs/design.md, "runtime/block.py")."""

    def __init__(self, store: ExpertStore, events: Events, prefetch=None, router=None,
                 overlap=None, copies=None):
        self.store = store
        self.layer = store.layer
        self.events = events
        self.prefetch = prefetch or NoPrefetch()
        # This layer's router scorer, for a policy or trace that wants probabilities.
        self.router = router
        self.overlap = overlap  # one worker that reads misses while experts compute
        # Seconds, measured (_measured): whether overlap pays.
        self.read_per_miss = 0.0
        self.read_per_call = 0.0
        self.pending = []
        self.copies = copies  # low-bit copies a miss may read (low_bits.LowBitMisses), or None

    def __call__(self, inner, x, indices):
        predicted, probs, y = self._start(inner, x, indices)
        self._sync(indices, predicted, probs)
        ids, experts, probs = self._route(indices, probs)
        low = self._low_bit_misses(ids, experts, probs)
        if len(low):
            y = self._with_low_bits(inner, x, indices, ids, experts, low)
            self._launch(y)
        elif len(experts) <= self.store.pool.slots:
            if self.overlap is not None and indices.size < SORTED_GATHER_IDS:
                y = self._overlapped(inner, x, indices, ids, experts, y)
            else:
                self._stalled(self.store.ensure(experts))
            self._launch(y)
        else:
            y = self._chunked(inner, x, indices, ids, experts)
        # Unused staging goes first: the reads ahead need its buffers.
        self.store.drop_staged()
        self.prefetch.issue(predicted, ids)
        return y

    # Small steps, so that ``bench overhead`` can time each by overriding it.

    def _start(self, inner, x, indices):
        """Start the router and the prediction; build the expert call on the
        table meanwhile (``ensure`` writes it in place before evaluation)."""
        predicted = self.prefetch.predict(x, call_tokens(indices))
        probs = () if self.router is None else (self.router.probabilities(x),)
        mx.async_eval(indices, *(predicted or ()), *probs)
        y = inner(x, self.store.pool.table[indices])
        return predicted, probs, y

    def _sync(self, indices, predicted, probs) -> None:
        """The call's one host sync: ids, prediction, earlier pool readers."""
        mx.eval(indices, *self.pending, *(predicted or ()), *probs)
        self.pending = []

    def _route(self, indices, probs):
        """The host's view of the routing: policy, counters, trace, learners."""
        # ids [..., top_k]; probs [tokens, experts] or None
        ids = np.array(indices)
        probs = np.array(probs[0]).reshape(-1, probs[0].shape[-1]) if probs else None
        hits, experts = self.store.route(ids, probs)
        self.events.on_paged_call(self.layer, call_tokens(indices), ids, experts, hits, probs)
        return ids, experts, probs

    def _low_bit_misses(self, ids, experts, probs) -> np.ndarray:
        """The misses computed from low-bit copies (none when the call outgrows the pool)."""
        if self.copies is None:
            return experts[:0]
        missing, fits = self.copies.misses(experts[~self.store.resident(experts)],
                                        len(experts) <= self.store.pool.slots)
        if not fits or not len(missing):
            return experts[:0]
        rows = ids.reshape(-1, ids.shape[-1]).astype(np.int64)  # [tokens, top_k]
        return self.copies.choose(missing, rows, probs)

    def _with_low_bits(self, inner, x, indices, ids, experts, low):
        """``low`` from low-bit copies, the rest from the pool, in router order."""
        full = np.setdiff1d(experts, low, assume_unique=True)
        self._stalled(self.store.ensure(full) + self.copies.load(low))
        flat = ids.reshape(-1)  # [tokens * top_k]
        is_low = np.isin(flat, low)
        parts, positions = [], []
        for pairs, module, slots in ((np.nonzero(~is_low)[0], inner, self._slot_ids),
                                     (np.nonzero(is_low)[0], self.copies.inner, self.copies.slot_ids)):
            if len(pairs):
                parts.append(self._pairs(module, x, indices, pairs, slots(flat[pairs])))
                positions.append(pairs)
        self.events.on_low_bits(self.layer, int(is_low.sum()))
        return _in_router_order(parts, positions, indices)

    def _launch(self, y) -> None:
        # The experts compute while Python builds the next layer's graph.
        mx.async_eval(y)
        self.pending.append(y)

    def _overlapped(self, inner, x, indices, ids, experts, y):
        """``y`` after its reads, or ``_split`` when overlapping pays."""
        missing = int(np.count_nonzero(~self.store.resident(experts)))
        if 0 < missing < len(experts) and missing * self.read_per_miss >= OVERLAP_MIN_READ_S:
            return self._split(inner, x, indices, ids, experts, missing)
        waited = self.store.ensure(experts)
        self._stalled(waited)
        self._measured(waited, missing)
        return y

    def _split(self, inner, x, indices, ids, experts, missing):
        """Resident experts compute while the worker reads the misses, then the
        rest: the same bits as one call (docs/design.md, "Overlap")."""
        flat = ids.reshape(-1)  # [tokens * top_k]
        resident = self.store.resident(flat)
        first, rest = np.nonzero(resident)[0], np.nonzero(~resident)[0]
        slots_first = self._slot_ids(flat[first])
        reading = None
        try:
            reading = self.overlap.submit(self.store.ensure, experts)
            y_first = self._pairs(inner, x, indices, first, slots_first)
            mx.eval(y_first)
            computed = time.perf_counter()
        finally:
            # No future (interrupted at submit): a no-op queued behind waits for the reads.
            waited = _finished(reading if reading is not None else self.overlap.submit(int))
        self._stalled(time.perf_counter() - computed)
        self._measured(waited, missing)
        y_rest = self._pairs(inner, x, indices, rest, self._slot_ids(flat[rest]))
        return _in_router_order([y_first, y_rest], [first, rest], indices)

    def _stalled(self, seconds: float) -> None:
        self.events.on_stall(self.layer, seconds)

    def _measured(self, waited: float, missing: int) -> None:
        self.read_per_call += OVERLAP_SMOOTHING * (waited - self.read_per_call)
        if missing:
            per_miss = waited / missing
            self.read_per_miss += OVERLAP_SMOOTHING * (per_miss - self.read_per_miss)

    def _slot_ids(self, experts):
        """Slots of resident ``experts``, copied now: the table changes in compute."""
        return mx.array(self.store.pool.slot_of_expert[experts].astype(np.int32))

    def _pairs(self, inner, x, indices, pairs, slots):
        """``inner`` on the (token, expert) ``pairs`` (positions in the flat ids)
        at their ``slots``, ``[pairs, dims]``: one token as columns, else rows."""
        if call_tokens(indices) == 1:
            y = inner(x, slots.reshape(*indices.shape[:-1], len(pairs)))
            return y.reshape(len(pairs), y.shape[-1])
        rows = mx.array(pairs // indices.shape[-1])
        return inner(x.reshape(-1, x.shape[-1])[rows], slots[:, None])[:, 0]

    def _chunked(self, inner, x, indices, ids, experts):
        """More distinct experts than slots: groups that fit, each evaluated
        before the next overwrites slots (exact: rows are independent)."""
        slots = self.store.pool.slots
        flat = ids.reshape(-1)  # [tokens * top_k]
        # Resident experts first: the first group then reads nothing.
        resident = self.store.resident(experts)
        order = np.concatenate([experts[resident], experts[~resident]])
        outputs, positions = [], []
        groups = math.ceil(len(order) / slots)
        for c in range(groups):
            group = order[c * slots : (c + 1) * slots]
            self._stalled(self.store.ensure(group, last=c == groups - 1))
            pairs = np.nonzero(np.isin(flat, group))[0]
            y = self._pairs(inner, x, indices, pairs, self._slot_ids(flat[pairs]))
            mx.eval(y)
            outputs.append(y)
            positions.append(pairs)
        return _in_router_order(outputs, positions, indices)


def _in_router_order(parts, positions, indices):
    """``parts`` of the pairs at ``positions``, in the router's order and shape."""
    order = mx.array(np.argsort(np.concatenate(positions)))
    y = mx.concatenate(parts)[order]
    return y.reshape(*indices.shape, y.shape[-1])


def calls_in_graph() -> bool:
    """Whether paged calls can run in the graph (CPU only); asked per call."""
    return mx.default_device() == mx.cpu


class NativePaged(Paged):
    """``Paged`` on a ``NativeStore``: with ``in_graph`` (CPU), a call of at
    most ``slots`` ids makes no host sync (docs/design.md, "runtime/block.py")."""

    def __init__(self, store, events, prefetch=None, router=None, overlap=None, copies=None,
                 in_graph: bool = False):
        super().__init__(store, events, prefetch, router, overlap, copies)
        self.in_graph = in_graph
        # Whether this layer's decode calls sync (``_overlap_pays``).
        self.synced = False

    def __call__(self, inner, x, indices):
        if (self.in_graph and indices.size <= self.store.pool.slots
                and indices.dtype in (mx.uint32, mx.int32) and calls_in_graph()
                and not (indices.size < SORTED_GATHER_IDS and self._overlap_pays())):
            return self._in_graph(inner, x, indices)
        return super().__call__(inner, x, indices)

    def _overlap_pays(self) -> bool:
        """Whether this layer's misses are slow enough that its calls should
        sync and overlap; back in the graph below ``OVERLAP_RETURN_SHARE``."""
        if self.overlap is None:
            return False
        calls, records, seconds = self.store.take_graph_reads()
        if calls:
            self.read_per_call += OVERLAP_SMOOTHING * (seconds / calls - self.read_per_call)
            if records:  # so that the first synced call overlaps already
                self.read_per_miss += OVERLAP_SMOOTHING * (seconds / records
                                                           - self.read_per_miss)
        bar = OVERLAP_MIN_READ_S * (OVERLAP_RETURN_SHARE if self.synced else 1.0)
        self.synced = self.read_per_call >= bar
        return self.synced

    def _in_graph(self, inner, x, indices):
        if self.pending:
            # Readers left by an unfinished pass first, or this remap might run before them.
            mx.eval(self.pending)
            self.pending = []
        y = inner(x, self.store.remap(indices))
        # Evaluated at the pass's end (or the next sync), before the pool is written.
        self.pending.append(y)
        return y
