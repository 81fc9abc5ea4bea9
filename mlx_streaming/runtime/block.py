"""The streaming expert block that replaces mlx-lm's ``SwitchGLU`` /
``SwitchMLP``.

``StreamingExperts`` keeps the model's own expert module (``inner``: its
activation, biases and ``gather_qmm``/``gather_mm`` arguments), whose
projections now hold ``[slots, ...]`` pool arrays instead of
``[num_experts, ...]`` weights. The router's expert ids are turned into slot
ids and the inner module runs unchanged, so the numerics are mlx-lm's.

How ids become slots is a residency strategy chosen at load:

- ``Resident``: the pool holds every expert in the slot of its own index, so
  the ids are the slots: no remap, no host sync.
- ``Paged``: a partial pool. One host sync per call evaluates the router's
  ids; misses are read into the slots the policy values least; the ids are
  remapped to slots on the device with the layer's table. With ``overlap``,
  a call computes its resident experts while its misses are read.
- ``NativePaged``: ``Paged`` with the host's bookkeeping of a call in C++
  (``store.NativeStore``), when the extension and the policy allow it.
"""
import math
import time
from concurrent.futures import wait

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .events import Events
from .pool import distinct
from .prefetch.control import NoPrefetch
from .store import ExpertStore

# An overlapped call costs the host more than a plain one (a hand-off to the
# read worker, a second sync, a second expert call; docs/results.md,
# "overlap"), so a call overlaps only when its misses are expected to take
# longer than this to read (a decayed mean per layer of what they took).
# On the CPU backend it is also the bar at which a layer's decode calls
# leave the graph, where they cannot overlap (``NativePaged``).
OVERLAP_MIN_READ_S = 1e-3


OVERLAP_SMOOTHING = 0.2


# A layer out of the graph goes back in only when its reads fall below this
# share of the bar: a layer whose reads hover at the bar (a busy machine, a
# page cache half warm) would otherwise change paths every few calls.
OVERLAP_RETURN_SHARE = 0.5


# mlx-lm's expert call sorts a call of this many ids or more by expert
# (switch_layers: ``indices.size >= 64``), which a GPU may compute with
# another kernel than fewer ids: such a call is never split.
SORTED_GATHER_IDS = 64


def _finished(future):
    """The worker's reads, waited for to their end even when this thread
    is interrupted (an interrupt is re-raised after): they write slots that
    the next call could otherwise hand out again."""
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
    """Drop-in for ``SwitchGLU``/``SwitchMLP``: same ``(x, indices)`` call,
    same output, experts gathered from a slot pool."""

    def __init__(self, inner: nn.Module, residency):
        super().__init__()
        self.inner = inner
        self.residency = residency
        # Called first: cache-aware routing's ``CacheAwareRouter.restore``.
        self.after_routing = None

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
    """A partial pool: sync once, fill misses, remap ids to slots on device.

    Safety rule for writing slots in place: every output computed from the
    pool is kept in ``pending`` until the next host sync, which evaluates it
    together with the router's ids. So when ``ensure`` overwrites a slot, no
    computation that reads that slot or the table is pending or in flight:
    an overlapped call's resident experts compute meanwhile, but from slots
    that ``ensure`` never hands out in that call, named by a copy of their
    slot ids.
    """

    def __init__(self, store: ExpertStore, events: Events, prefetch=None, router=None,
                 overlap=None):
        self.store = store
        self.layer = store.layer
        self.events = events
        self.prefetch = prefetch or NoPrefetch()
        # This layer's own router scorer, applied again to the block's input
        # when the policy or a trace wants the router's probabilities.
        self.router = router
        # The thread that reads a call's misses while its resident experts
        # compute (an executor of one worker, the runtime's), or None.
        self.overlap = overlap
        # Seconds, measured (_measured): whether overlap pays.
        self.read_per_miss = 0.0
        self.read_per_call = 0.0
        self.pending = []

    # Low-bit copies a miss may read instead (low_bits.LowBitMisses), or None.
    low = None

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
        # What this layer's call did not take is dropped first, freeing its
        # staging buffers for the reads ahead. Those queue behind this
        # layer's demand reads (done by now) and run while its experts
        # compute.
        self.store.drop_staged()
        self.prefetch.issue(predicted, ids)
        return y

    # The steps of a call, small methods so that ``bench overhead`` can time
    # each one in a real decode by overriding them.

    def _start(self, inner, x, indices):
        """Start the router (and the prediction) computing, and build the
        expert call on the table while they run: the table is written in
        place by ``ensure``, before the call is evaluated."""
        predicted = self.prefetch.predict(x, call_tokens(indices))
        probs = () if self.router is None else (self.router.probabilities(x),)
        mx.async_eval(indices, *(predicted or ()), *probs)
        y = inner(x, self.store.pool.table[indices])
        return predicted, probs, y

    def _sync(self, indices, predicted, probs) -> None:
        """The one host sync of this call: the ids, the prediction for the
        next layer, and every earlier reader of this pool."""
        mx.eval(indices, *self.pending, *(predicted or ()), *probs)
        self.pending = []

    def _route(self, indices, probs):
        """The host's view of the routing: counters, trace and policy."""
        ids = np.array(indices)
        experts = distinct(ids)
        probs = np.array(probs[0]).reshape(-1, probs[0].shape[-1]) if probs else None
        hits = int(np.count_nonzero(self.store.pool.slot_of_expert[ids] >= 0))
        tokens = call_tokens(indices)
        self.events.on_paged_call(self.layer, tokens, ids, experts, hits, probs)
        self.store.control.routed(self.layer, tokens, ids, experts)
        self.store.policy.observe(experts, ids.reshape(-1, ids.shape[-1]), probs)
        return ids, experts, probs

    def _low_bit_misses(self, ids, experts, probs) -> np.ndarray:
        """The missed experts this call computes from low-bit copies (none
        without them, or when the call's experts outnumber the pool)."""
        if self.low is None:
            return experts[:0]
        missing, fits = self.low.misses(experts[~self.store.resident(experts)],
                                        len(experts) <= self.store.pool.slots)
        if not fits or not len(missing):
            return experts[:0]
        rows = ids.reshape(-1, ids.shape[-1]).astype(np.int64)
        return self.low.choose(missing, rows, probs)

    def _with_low_bits(self, inner, x, indices, ids, experts, low):
        """The call with ``low`` computed from their low-bit copies and the
        rest (hits, and misses read in full) from the pool, pair by pair
        (``_pairs``), put back in the router's order."""
        full = np.setdiff1d(experts, low, assume_unique=True)
        self._stalled(self.store.ensure(full) + self.low.load(low))
        flat = ids.reshape(-1)
        is_low = np.isin(flat, low)
        parts, positions = [], []
        for pairs, module, slots in ((np.nonzero(~is_low)[0], inner, self._slot_ids),
                                     (np.nonzero(is_low)[0], self.low.inner, self.low.slot_ids)):
            if len(pairs):
                parts.append(self._pairs(module, x, indices, pairs, slots(flat[pairs])))
                positions.append(pairs)
        self.events.on_low_bits(self.layer, int(is_low.sum()))
        return _in_router_order(parts, positions, indices)

    def _launch(self, y) -> None:
        # Start the experts now: they compute while Python builds the next
        # layer's graph, which the next sync would otherwise serialize.
        mx.async_eval(y)
        self.pending.append(y)

    def _overlapped(self, inner, x, indices, ids, experts, y):
        """The call ``y`` after its reads, or split (``_split``) when some
        of its experts are resident, some missing, and the misses are
        expected to take long enough to read."""
        missing = int(np.count_nonzero(~self.store.resident(experts)))
        if 0 < missing < len(experts) and missing * self.read_per_miss >= OVERLAP_MIN_READ_S:
            return self._split(inner, x, indices, ids, experts, missing)
        waited = self.store.ensure(experts)
        self._stalled(waited)
        self._measured(waited, missing)
        return y

    def _split(self, inner, x, indices, ids, experts, missing):
        """The resident experts compute while the worker reads the misses,
        then the rest. Each (token, expert) pair is computed as in one
        ``inner`` call over all of them (expert matmuls are independent per
        row and column, ``_pairs``), and the pairs are put back in the
        router's order, so the output is the same bits. The misses take
        slots that no resident expert of this call holds (``ensure``), so
        the compute in flight never reads a slot being written. The device
        stalled only from the end of that compute to the end of the reads."""
        flat = ids.reshape(-1)
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
            # None: interrupted around the submit, which may have queued the
            # reads all the same; a no-op queued behind them waits for them.
            waited = _finished(reading if reading is not None else self.overlap.submit(int))
        self._stalled(time.perf_counter() - computed)
        self._measured(waited, missing)
        y_rest = self._pairs(inner, x, indices, rest, self._slot_ids(flat[rest]))
        return _in_router_order([y_first, y_rest], [first, rest], indices)

    def _stalled(self, seconds: float) -> None:
        """The device waited ``seconds`` for this call's reads."""
        self.events.on_stall(self.layer, seconds)
        self.store.control.stalled(self.layer, seconds)

    def _measured(self, waited: float, missing: int) -> None:
        """Keep decayed means of the seconds a call's misses and a missing
        expert took to bring in (read, or taken from prefetch's staging)."""
        self.read_per_call += OVERLAP_SMOOTHING * (waited - self.read_per_call)
        if missing:
            per_miss = waited / missing
            self.read_per_miss += OVERLAP_SMOOTHING * (per_miss - self.read_per_miss)

    def _slot_ids(self, experts):
        """The slots of resident ``experts``, a copy taken now: the table is
        written while the experts compute."""
        return mx.array(self.store.pool.slot_of_expert[experts].astype(np.int32))

    def _pairs(self, inner, x, indices, pairs, slots):
        """``inner`` on the call's (token, expert) ``pairs`` (positions in
        its flat ids) at their ``slots``, shaped (pairs, dims): one token's
        as the columns of one call, several tokens' as one row per pair (as
        ``_chunked`` computes them)."""
        if call_tokens(indices) == 1:
            y = inner(x, slots.reshape(*indices.shape[:-1], len(pairs)))
            return y.reshape(len(pairs), y.shape[-1])
        rows = mx.array(pairs // indices.shape[-1])
        return inner(x.reshape(-1, x.shape[-1])[rows], slots[:, None])[:, 0]

    def _chunked(self, inner, x, indices, ids, experts):
        """More distinct experts than slots: run the (token, expert) pairs in
        groups of experts that fit, each group evaluated before the next one
        overwrites slots. Every pair is computed exactly as in one call
        because expert matmuls are independent per row (``_pairs``)."""
        slots = self.store.pool.slots
        flat = ids.reshape(-1)
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
    """A call's ``parts``, each computed for the (token, expert) pairs at
    ``positions`` in its flat ids, put back in the router's order and
    shape."""
    order = mx.array(np.argsort(np.concatenate(positions)))
    y = mx.concatenate(parts)[order]
    return y.reshape(*indices.shape, y.shape[-1])


def calls_in_graph() -> bool:
    """Whether paged calls can run inside the graph now: the remap
    primitive has a CPU implementation only (a GPU would need the host
    between kernels). Asked at load and again per call, since the stream a
    call runs on (``mx.stream``) is chosen by the caller."""
    return mx.default_device() == mx.cpu


class NativePaged(Paged):
    """``Paged`` on a ``NativeStore``. With ``in_graph`` (the CPU backend), a
    call of at most ``slots`` ids (decode, short verify calls) makes no host
    sync at all: its ids become slots through ``store.remap``, an MLX
    primitive that routes, reads the misses and maps them on the stream's
    thread once the router has computed the ids. That thread runs the
    stream's work in order, so the call's expert compute, queued after it,
    sees the filled slots, and every earlier reader of the pool finished
    before it. Larger calls (prefill) sync as ``Paged`` does, with the
    native route and ensure, and so do the calls of a layer whose reads are
    slow enough to overlap (``_overlap_pays``). ``Paged`` is the reference;
    the two agree call for call (tests/runtime/test_native_paging.py)."""

    def __init__(self, store, events, prefetch=None, router=None, overlap=None,
                 in_graph: bool = False):
        super().__init__(store, events, prefetch, router, overlap)
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
        """Whether this layer's misses take long enough to read (a decayed
        mean per call, at least ``_overlapped``'s bar) that its calls should
        sync: a call in the graph reads its misses on the stream's thread
        before any of its experts compute, a synced one computes its
        resident experts meanwhile. Measured on both paths, so a layer goes
        back into the graph when its reads get fast (the page cache warm):
        below ``OVERLAP_RETURN_SHARE`` of the bar, so that it does not
        change paths on every slow read."""
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
            # Readers of this pool left by a call that did not finish its
            # pass (an exception, a call outside the runtime): evaluated
            # first, or MLX might run this remap before them.
            mx.eval(self.pending)
            self.pending = []
        y = inner(x, self.store.remap(indices))
        # Evaluated by the runtime at the end of the forward pass (and by
        # this layer's next sync), before anything else may write the pool.
        self.pending.append(y)
        return y

    def _route(self, indices, probs):
        ids = np.array(indices)
        hits, experts = self.store.route(ids)
        tokens = call_tokens(indices)
        self.events.on_paged_call(self.layer, tokens, ids, experts, hits, None)
        self.store.control.routed(self.layer, tokens, ids, experts)
        return ids, experts, probs
