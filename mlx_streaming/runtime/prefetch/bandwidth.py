"""How many records prefetch may read per layer: what the disk reads in one
layer's compute time.
"""

import time


class PrefetchBandwidth:
    """Bandwidth-aware prefetch: stage per layer at most the records the
    disk, at its measured rate, reads within one layer's compute time, so
    that prefetch never queues reads that the next layer's demand reads
    would wait behind.

    Both are measured per decode token: the rate as the bytes the reader
    read over the seconds in which a read was in flight (``meter``: demand
    reads and reads ahead alike; a throttled or busy disk shows up here,
    where one fast read would not show it); a layer's compute as the token's
    time less the part of its reads' waits that the device stalled (an
    overlapped call computes during the rest), over the layers. (Not the
    host's wait for a token's demand reads: that wait also holds the reads
    ahead they queued behind, whose bytes it does not count.) Decayed means
    of each set ``records``. It starts at zero: prefetch is earned by
    measurement.
    """

    def __init__(self, first_layer: int, layers: int, record_bytes: int, max_tokens: int,
                 meter, clock=time.perf_counter, smoothing: float = 0.2, fixed=None):
        self.first_layer = first_layer
        self.layers = layers
        self.record_bytes = record_bytes
        self.max_tokens = max_tokens
        self.meter = meter  # () -> (bytes read, seconds busy), running totals
        self.clock = clock
        self.smoothing = smoothing
        # Records the user fixed (load's prefetch_records) are never measured.
        self.records = 0 if fixed is None else fixed
        # The share of one more record the disk reads within a layer's
        # compute (``within_bandwidth``).
        self.partial = 0.0
        self.rate = None  # bytes per second
        self._mean_bytes = self._mean_busy = None
        self.layer_compute = None  # seconds
        self._last = None
        self._read_at_last = (0, 0.0)
        self._stall = 0.0

    def _mean(self, old, new):
        return new if old is None else old + self.smoothing * (new - old)

    def on_stall(self, layer, seconds):
        self._stall += seconds

    def on_call(self, layer, tokens):
        if layer != self.first_layer:
            return
        now = self.clock()
        read = self.meter()
        if self._last is not None and tokens <= self.max_tokens:
            compute = max(0.0, now - self._last - self._stall) / self.layers
            self.layer_compute = self._mean(self.layer_compute, compute)
            nbytes, busy = read[0] - self._read_at_last[0], read[1] - self._read_at_last[1]
            if busy > 0 and not nbytes:
                # A read in flight through the whole token: its bytes count
                # when it ends, so its seconds wait for them.
                read = self._read_at_last
            elif nbytes and busy > 0:
                # A ratio of means, not a mean of ratios: a throttled disk
                # serves a token's few reads at once from its burst credit
                # and makes the next token wait, and the fast tokens would
                # otherwise outweigh the slow ones.
                self._mean_bytes = self._mean(self._mean_bytes, nbytes)
                self._mean_busy = self._mean(self._mean_busy, busy)
                self.rate = self._mean_bytes / self._mean_busy
        # Only decode-to-decode intervals measure: a prefill call starts none.
        self._last = now if tokens <= self.max_tokens else None
        self._read_at_last = read
        self._stall = 0.0
        if self.rate is not None and self.layer_compute is not None:
            cover = self.rate * self.layer_compute / self.record_bytes
            self.records, self.partial = int(cover), cover - int(cover)
