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
        predicted = mx.argpartition(-scores, kth=self.width - 1, axis=-1)
        predicted = predicted[..., : self.width].astype(mx.int32)  # [..., W]
        return self.launcher.launch(predicted, self.next_store, self.target)

    def issue(self, predicted) -> None:
        if not predicted:
            return
        issued = self.launcher.after_sync(predicted, self.next_store)
        layer = self.next_store.layer
        self.events.on_predict(layer, np.array(predicted[0]))
        self.events.on_prefetch(layer, issued=issued)


class PythonLauncher:
    def launch(self, predicted, store, target):
        return (predicted,)

    def after_sync(self, predicted, store) -> int:
        ids = np.unique(np.array(predicted[0])).astype(np.int64)
        ids = ids[~store.resident(ids)]
        offsets = ids.astype(np.int64) * store.spec.stride
        return store.staging.stage(store.layer, store.file, ids, offsets)


class NativeLauncher:
    def __init__(self, ext):
        self.ext = ext

    def launch(self, predicted, store, target):
        # The table as it is now: the primitive skips experts already resident.
        issued = self.ext.prefetch_on_complete(predicted, store.pool.table, target)
        return (predicted, issued)

    def after_sync(self, predicted, store) -> int:
        # The primitive ran inside the sync that just returned.
        return store.staging.pop_issued(store.layer)


class PrefetchSwitch(Observer):
    """``prefetch="auto"``: decides from measurement whether prefetch pays.

    Decode runs ``window`` tokens with prefetch off. If the share of time
    stalled on expert reads is below ``min_stall_share``, prefetch cannot pay
    and stays off. Otherwise the next ``window`` tokens run with it on, and it
    stays on only if those tokens were faster.
    """

    def __init__(self, first_layer: int, max_tokens: int, window: int = 16,
                 min_stall_share: float = 0.05, clock=time.perf_counter):
        self.clock = clock
        self.first_layer = first_layer
        self.max_tokens = max_tokens
        self.window = window
        self.min_stall_share = min_stall_share
        self.enabled = False
        self.decision = "measuring"
        self._phase = "off"
        self._start = None
        self._tokens = 0
        self._stall = 0.0
        self._off_seconds_per_token = None

    def on_call(self, layer, tokens):
        if layer != self.first_layer or tokens > self.max_tokens or self._phase == "done":
            return
        now = self.clock()
        if self._start is None:
            self._start, self._tokens, self._stall = now, 0, 0.0
            return
        self._tokens += 1
        if self._tokens >= self.window:
            self._end_window(now)

    def on_stall(self, layer, seconds):
        if self._start is not None:
            self._stall += seconds

    def _end_window(self, now):
        elapsed = now - self._start
        per_token = elapsed / self._tokens
        self._start = None
        if self._phase == "off":
            share = self._stall / elapsed if elapsed else 0.0
            if share < self.min_stall_share:
                self._finish(False, f"off: stall share {share:.1%} too small to pay")
            else:
                self._off_seconds_per_token = per_token
                self._phase = "on"
                self.enabled = True
        else:
            faster = per_token < self._off_seconds_per_token
            ratio = self._off_seconds_per_token / per_token
            self._finish(faster, f"{'on' if faster else 'off'}: {ratio:.2f}x decode speed with it")

    def _finish(self, enabled, decision):
        self.enabled = enabled
        self.decision = decision
        self._phase = "done"
