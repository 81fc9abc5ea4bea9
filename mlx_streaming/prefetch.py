"""Cross-layer prefetch: predict the next MoE layer's experts from this
layer's input with the next layer's own router, and read them ahead.

While layer L runs, layer L+1's router is applied to layer L's MoE input; its
top-W experts that are not resident are read into the staging area. When
layer L+1 routes, the predicted experts it really uses are moved into slots;
the rest are dropped without evicting anything.

The reads are started by a launcher chosen at load:

- ``NativeLauncher``: the C++ primitive ``prefetch_on_complete`` queues the
  reads the moment the device has computed the prediction (a completion
  callback), inside the layer's one host sync: no extra sync from Python.
- ``PythonLauncher``: the prediction is evaluated in that same sync and
  Python queues the reads on the reader's background threads.
"""

import time

import mlx.core as mx
import numpy as np

from .stats import Events, Observer


class NoPrefetch:
    def predict(self, x, tokens):
        return ()

    def issue(self, predicted) -> None:
        pass


class AlwaysOn:
    enabled = True
    decision = "on"


class NextLayerPrefetch:
    """Prefetch of one layer's successor."""

    def __init__(
        self, scorer, next_store, target, width, max_tokens, launcher, events: Events, switch
    ):
        self.scorer = scorer
        self.next_store = next_store
        # The native staging's handle on the next layer (None for Python).
        self.target = target
        self.width = width
        self.max_tokens = max_tokens
        self.launcher = launcher
        self.events = events
        self.switch = switch

    def predict(self, x: mx.array, tokens: int):
        """The arrays to evaluate in this layer's sync, or () for none."""
        if tokens > self.max_tokens or not self.switch.enabled:
            return ()
        scores = self.scorer(x)  # [..., E]
        # Best first in each row, so that a bandwidth budget reads the
        # likeliest experts; no slice, no cast: every op added here is paid
        # per layer and token.
        ranked = mx.argsort(-scores, axis=-1)  # [..., E]
        return self.launcher.launch(ranked, self.width, self.next_store, self.target)

    def issue(self, predicted) -> None:
        if not predicted:
            return
        ids = np.array(predicted[0])[..., : self.width]
        issued = self.launcher.after_sync(ids, predicted, self.next_store)
        layer = self.next_store.layer
        self.events.on_predict(layer, ids)
        self.events.on_prefetch(layer, issued=issued)


def rank_order(ids: np.ndarray) -> np.ndarray:
    """Distinct ids of ``[rows, width]`` predictions (the native primitive's
    order): those predicted for the most rows first (a verify call needs
    the union of its tokens' experts, and shared ones serve several), then
    every row's first choice before any row's second."""
    order = np.ascontiguousarray(ids.reshape(-1, ids.shape[-1]).T).ravel()
    unique, first, counts = np.unique(order, return_index=True, return_counts=True)
    return unique[np.lexsort((first, -counts))].astype(np.int64)


class PythonLauncher:
    def __init__(self, budget: "PrefetchBudget"):
        self.budget = budget

    def launch(self, ranked, width, store, target):
        return (ranked,)

    def after_sync(self, ids, predicted, store) -> int:
        ids = rank_order(ids)
        ids = ids[~store.resident(ids)][: self.budget.records]
        offsets = ids * store.spec.stride
        return store.staging.stage(store.layer, store.file, ids, offsets)


class NativeLauncher:
    def __init__(self, ext):
        self.ext = ext

    def launch(self, ranked, width, store, target):
        # The table as it is now: the primitive skips experts already resident.
        issued = self.ext.prefetch_on_complete(ranked, width, store.pool.table, target)
        return (ranked, issued)

    def after_sync(self, ids, predicted, store) -> int:
        # The primitive ran inside the sync that just returned.
        return store.staging.pop_issued(store.layer)


class PrefetchBudget(Observer):
    """Bandwidth-aware prefetch: stage per layer at most the records the
    disk, at its measured rate, reads within one layer's compute time, so
    that prefetch never queues reads that the next layer's demand reads
    would wait behind.

    Both are measured per decode token: the rate as the bytes of the
    token's demand reads over the time it stalled on them (a throttled or
    busy disk shows up here, where one fast read would not show it); a
    layer's compute as the token's time less its stalls, over the layers.
    Decayed means of each set the budget. It starts at zero: prefetch is
    earned by measurement. Native targets get each new budget; the Python
    launcher reads it.
    """

    UNLIMITED = 1 << 30

    def __init__(self, first_layer: int, layers: int, record_bytes: int, max_tokens: int,
                 clock=time.perf_counter, smoothing: float = 0.2, fixed=None):
        self.first_layer = first_layer
        self.layers = layers
        self.record_bytes = record_bytes
        self.max_tokens = max_tokens
        self.clock = clock
        self.smoothing = smoothing
        # A budget the user fixed (load's prefetch_budget) is never measured.
        self.records = 0 if fixed is None else fixed
        self.targets = []
        self.rate = None  # bytes per second
        self.layer_compute = None  # seconds
        self._last = None
        self._stall = 0.0
        self._bytes = 0

    def _mean(self, old, new):
        return new if old is None else old + self.smoothing * (new - old)

    def on_read(self, layer, records, nbytes, seconds):
        self._bytes += nbytes

    def on_stall(self, layer, seconds):
        self._stall += seconds

    def on_call(self, layer, tokens):
        if layer != self.first_layer:
            return
        now = self.clock()
        if self._last is not None and tokens <= self.max_tokens:
            compute = max(0.0, now - self._last - self._stall) / self.layers
            self.layer_compute = self._mean(self.layer_compute, compute)
            if self._bytes and self._stall > 0:
                self.rate = self._mean(self.rate, self._bytes / self._stall)
        # Only decode-to-decode intervals measure: a prefill call starts none.
        self._last = now if tokens <= self.max_tokens else None
        self._stall, self._bytes = 0.0, 0
        if self.rate is not None and self.layer_compute is not None:
            self._set(int(self.rate * self.layer_compute // self.record_bytes))

    def _set(self, records: int) -> None:
        if records != self.records:
            self.records = records
            for t in self.targets:
                t.budget = records


class PrefetchSwitch(Observer):
    """``prefetch="auto"``: decides from measurement whether prefetch pays.

    After ``warmup`` decode tokens (a cold pool stalls on every first read),
    a trial of ``trial`` tokens turns prefetch on and off every ``block``
    tokens, so that slow spells of a shared machine and changes in the text
    hit both alike. Prefetch stays on only if the median token with it was at
    least ``margin`` faster than the median token without it, and the tokens
    without it spent at least ``min_stall_share`` of their time stalled on
    reads (else there is nothing for prefetch to win).
    """

    def __init__(self, first_layer: int, max_tokens: int, trial: int = 64, block: int = 4,
                 warmup: int = 8, min_stall_share: float = 0.05, margin: float = 0.02,
                 clock=time.perf_counter):
        self.first_layer = first_layer
        self.max_tokens = max_tokens
        self.trial = trial
        self.block = block
        self.warmup = warmup
        self.min_stall_share = min_stall_share
        self.margin = margin
        self.clock = clock
        self.enabled = False
        self.decision = "measuring"
        self._last = None
        self._seen = 0
        self._stall = 0.0
        self._tokens = {True: [], False: []}  # seconds of each trial token
        self._off_stall = 0.0  # stalled seconds of the tokens without it

    def on_call(self, layer, tokens):
        if layer != self.first_layer or tokens > self.max_tokens or self.decision != "measuring":
            return
        now = self.clock()
        if self._last is not None and self._seen >= self.warmup:
            # The token that just ended ran with the state set at its start.
            self._tokens[self.enabled].append(now - self._last)
            if not self.enabled:
                self._off_stall += self._stall
        self._last, self._stall = now, 0.0
        self._seen += 1
        trial_step = self._seen - self.warmup
        if trial_step >= self.trial:
            self._decide()
        elif trial_step >= 0:
            self.enabled = (trial_step // self.block) % 2 == 1

    def on_stall(self, layer, seconds):
        self._stall += seconds

    def _decide(self):
        off, on = np.median(self._tokens[False]), np.median(self._tokens[True])
        share = self._off_stall / sum(self._tokens[False])
        if share < self.min_stall_share:
            self._finish(False, f"off: stall share {share:.1%} too small to pay")
            return
        speedup = off / on
        keep = bool(speedup >= 1 + self.margin)
        self._finish(keep, f"{'on' if keep else 'off'}: {speedup:.2f}x decode speed with it")

    def _finish(self, enabled, decision):
        self.enabled = enabled
        self.decision = decision
