"""Cross-layer prefetch: predict the next MoE layer's experts from this
layer's input with the next layer's own router, and read them ahead.

While layer L runs, layer L+1's router is applied to layer L's MoE input,
evaluated in L's one host sync with its ids. Each expert's probability is
weighed by how often it followed the experts L chose (``Affinity``), and the
best that are not resident are read into the staging area, once L's own
demand reads are done: queued earlier, they would delay them. The reads run
while L's experts compute. When layer L+1 routes, the predicted experts it
really uses are moved into slots; the rest are dropped without evicting
anything. ``PrefetchBudget`` bounds the reads per layer by what the disk
reads in one layer's compute time; ``PrefetchCalibration`` (when asked
for) keeps to the predictions whose scores were used often enough.
"""

import time
from typing import Optional

import mlx.core as mx
import numpy as np

from .stats import Events


class Learner:
    """What a part of prefetch learns from the running model; each hook is
    a no-op unless overridden. ``PrefetchControl`` feeds them."""

    def on_call(self, layer: int, tokens: int) -> None: ...
    def on_route(self, layer: int, ids: np.ndarray, experts: np.ndarray) -> None: ...
    # Seconds the device waited for a call's reads (computed nothing).
    def on_stall(self, layer: int, seconds: float) -> None: ...


class PrefetchControl:
    """Feeds prefetch's learners (the switch, the budget, affinity, the
    calibration) from the paged calls and the stores that run them: an
    explicit channel, apart from the telemetry of ``stats.Events``, which
    only reports. Only the hooks a learner overrides are called."""

    def __init__(self, learners=()):
        def hooks(name):
            return [getattr(l, name) for l in learners
                    if getattr(type(l), name) is not getattr(Learner, name)]

        self._call, self._route = hooks("on_call"), hooks("on_route")
        self._stall = hooks("on_stall")

    def routed(self, layer: int, tokens: int, ids: np.ndarray, experts: np.ndarray) -> None:
        """A paged call of ``tokens`` tokens routed to ``ids``
        (``experts`` distinct), before it reads."""
        for hook in self._call:
            hook(layer, tokens)
        for hook in self._route:
            hook(layer, ids, experts)

    def stalled(self, layer: int, seconds: float) -> None:
        """Seconds a layer's call made the device wait for its reads."""
        for hook in self._stall:
            hook(layer, seconds)


NO_CONTROL = PrefetchControl()


class NoPrefetch:
    def predict(self, x, tokens):
        return None

    def issue(self, predicted, ids) -> None:
        pass


class AlwaysOn:
    enabled = True
    decision = "on"


class NextLayerPrefetch:
    """Prefetch of one layer's successor. The last MoE layer's successor is
    the first MoE layer of the next token: no router can see that token
    yet (``scorer`` None), so it is predicted from affinity alone.

    With ``after`` (``prefetch_depth=2``: the scorer and store of the layer
    after next), the disk time that the successor's reads leave in this
    layer's budget reads the likeliest experts of the layer after next,
    predicted by its router on this layer's input: a read queued a layer
    earlier has two layers' compute to finish in. The successor's own
    prediction of that layer, one call later, tops it up to the budget.
    """

    def __init__(self, layer: int, scorer, next_store, width: int, max_tokens: int,
                 budget: "PrefetchBudget", affinity, events: Events, switch, calibration,
                 after=None):
        self.layer = layer
        self.scorer = scorer
        self.next_store = next_store
        self.width = width
        self.max_tokens = max_tokens
        self.budget = budget
        self.affinity = affinity  # an Affinity, or None
        self.events = events
        self.switch = switch
        self.calibration = calibration  # PrefetchCalibration or ReadEveryPrediction
        self.after = after  # (scorer, store, calibration) of the layer after next, or None

    def predict(self, x: mx.array, tokens: int):
        """The arrays to evaluate in this layer's sync, or None: no prefetch
        in this call."""
        if tokens > self.max_tokens or not self.switch.enabled:
            return None
        if self.scorer is None:
            return ()
        near = self.scorer.probabilities(x)  # [..., E]
        if self.after is None:
            return (near,)
        return (near, self.after[0].probabilities(x))

    def issue(self, predicted, ids: np.ndarray) -> None:
        """Stage the best predictions of the next layer, given this layer's
        ``ids`` (called after this layer's demand reads), then those of the
        layer after next with the budget left."""
        if predicted is None:
            return
        rows = ids.reshape(-1, ids.shape[-1])
        if predicted:
            probs = np.array(predicted[0]).reshape(len(rows), -1)
        elif self.affinity.seen(self.layer):
            probs = np.ones((len(rows), self.next_store.spec.num_experts), np.float32)
        else:
            return  # affinity alone, and nothing counted yet: no guess worth a read
        # A sigmoid router's softmax is flat (scores within ~1 of each other):
        # weighed, affinity would decide alone. It keeps its own order.
        softmax = scores_calibrated(self.scorer)
        if self.affinity is not None and softmax:
            probs = probs * self.affinity.weights(self.layer, rows)
        ranked, ranked_scores, order, scores = self._candidates(probs, self.next_store)
        layer = self.next_store.layer
        picked = self.calibration.select(layer, order, scores, len(rows))
        order = within_budget(picked, self.budget.records, self.budget.spare,
                              lambda e: self.calibration.used_share(layer, e, len(rows)))
        issued = self.next_store.stage(order)
        self.events.on_predict(self.next_store.layer, ranked, ranked_scores, 1, softmax)
        self.events.on_prefetch(self.next_store.layer, issued=issued)
        # The budget is reads in this layer's compute time: those of the
        # next layer's records that the layer before staged two layers
        # early (skipped now) were read in its time.
        room = self.budget.records - issued  # below 0 where a partly covered one was read
        if self.after is not None and len(predicted) > 1 and room > 0:
            scorer, store, calibration = self.after
            probs = np.array(predicted[1]).reshape(len(rows), -1)
            ranked, ranked_scores, order, scores = self._candidates(probs, store)
            order = calibration.bar(store.layer, order, scores, len(rows))[:room]
            self.events.on_prefetch(store.layer, issued=store.stage(order))
            self.events.on_predict(store.layer, ranked, ranked_scores, 2,
                                   scores_calibrated(scorer))

    def _candidates(self, probs: np.ndarray, store):
        """The ``width`` best of each row and their scores, and the distinct
        ones that are not resident in ``store``, best first, with theirs."""
        probs = probs / probs.sum(axis=-1, keepdims=True)
        ranked = np.argsort(-probs, axis=-1, kind="stable")[:, : self.width]
        order = rank_order(ranked)
        order = order[~store.resident(order)]
        # A score of 1: the prediction cannot tell this expert from another.
        scale = probs.shape[-1]
        scores = probs.max(axis=0)[order] * scale
        return ranked, np.take_along_axis(probs, ranked, -1) * scale, order, scores


def within_budget(order: np.ndarray, records: int, spare: float, chance) -> np.ndarray:
    """The reads ahead of ``order`` (best first) that the budget allows:
    the first ``records``, which the disk reads within the layer's compute,
    and the one after them if the chance that it is used (``chance(e)``)
    is at least 1 - ``spare``. The disk reads only ``spare`` of that record
    within the compute, and the rest runs into the next layer's demand
    reads: used, it saved them ``spare`` of a read; wasted, it cost them
    the rest. This is what a disk slower than a layer's compute (a Mac's
    SSD against its GPU: no whole record) can still read ahead. Where the
    chance is not known yet (None: nothing counted) it is not read."""
    if len(order) <= records or spare <= 0:
        return order[:records]
    p = chance(int(order[records]))
    return order[: records + (p is not None and p >= 1 - spare)]


def scores_calibrated(scorer) -> bool:
    """Whether predictions from ``scorer`` (None: affinity alone) are binned
    by score: a softmax router's are, a sigmoid router's are too flat to
    bin, so the layer it predicts reads every prediction the budget allows."""
    return scorer is None or scorer.softmax


def rank_order(ids: np.ndarray) -> np.ndarray:
    """Distinct ids of ``[rows, width]`` predictions, best first: those
    predicted for the most rows first (a verify call needs the union of its
    tokens' experts, and shared ones serve several), then every row's first
    choice before any row's second."""
    order = np.ascontiguousarray(ids.reshape(-1, ids.shape[-1]).T).ravel()
    unique, first, counts = np.unique(order, return_index=True, return_counts=True)
    return unique[np.lexsort((first, -counts))].astype(np.int64)


class Affinity(Learner):
    """How often each expert of a layer followed each expert of the layer
    before it, counted on this model's routing so far (every paged call).

    The next layer's router applied one layer early misses what this
    layer's experts add to the hidden state; which experts this layer chose
    carries part of that. On the trained model it raised the share of the
    first prediction of the second MoE layer that is routed from 41% to
    56%, and left the later layers' (95-97%) as they were. Counts start at
    ``prior`` so that an expert never seen is not ruled out.
    """

    def __init__(self, pairs, prior: float = 1.0):
        # pairs: (layer, its experts, next layer, the next layer's experts);
        # the last pair may wrap around, from the last layer to the first.
        self.counts = {a: np.full((ea, eb), prior, np.float32) for a, ea, _, eb in pairs}
        self.before = {b: a for a, _, b, _ in pairs}
        self.wraps = {b for a, _, b, _ in pairs if b <= a}
        self.pairs_seen = dict.fromkeys(self.counts, 0)
        self._last = {}  # layer -> [rows, k] ids of its last call

    def on_route(self, layer, ids, experts):
        rows = ids.reshape(-1, ids.shape[-1])
        before = self.before.get(layer)
        if before is not None:
            last = self._last.pop(before, None)
            # Row i of both calls is the same token, except across the wrap:
            # there only one-token calls follow each other (decode).
            if last is not None and len(last) == len(rows) and (
                    layer not in self.wraps or len(rows) == 1):
                self._count(before, last, rows)
        if layer in self.counts:
            self._last[layer] = rows

    def _count(self, layer, before, after):
        """Add every (expert before, expert after) pair of each token."""
        counts = self.counts[layer]
        width = counts.shape[1]
        pairs = (before[:, :, None] * width + after[:, None, :]).ravel()
        counts += np.bincount(pairs, minlength=counts.size).reshape(counts.shape)
        self.pairs_seen[layer] += len(before)

    def seen(self, layer: int) -> int:
        """Tokens counted for the pair that starts at ``layer``."""
        return self.pairs_seen[layer]

    def weights(self, layer: int, rows: np.ndarray) -> np.ndarray:
        """``[len(rows), next experts]``: per token, the mean over its
        experts at ``layer`` of the share of their successors that each
        next-layer expert was."""
        counts = self.counts[layer][rows]  # [rows, k, E']
        return (counts / counts.sum(axis=-1, keepdims=True)).mean(axis=1)


class PrefetchBudget(Learner):
    """Bandwidth-aware prefetch: stage per layer at most the records the
    disk, at its measured rate, reads within one layer's compute time, so
    that prefetch never queues reads that the next layer's demand reads
    would wait behind.

    Both are measured per decode token: the rate as the bytes the reader
    read over the seconds in which a read was in flight (``meter``: demand
    reads and reads ahead alike; a throttled or busy disk shows up here,
    where one fast read would not show it); a layer's compute as the token's
    time less the part of its reads' waits that the device stalled (an
    overlapped call computes during the rest), over the layers.
    (The rate was once a token's demand bytes over the host's wait for
    them; but that wait also holds the reads ahead that the demand reads
    queued behind or took from staging, whose bytes it did not count: on
    the padded model with reads paced to 700 MB/s it measured 0.46-0.48
    GB/s and held the budget to 2-3 records of the 4 the disk could read.)
    Decayed means of each set the budget. It starts at zero: prefetch is
    earned by measurement.
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
        # A budget the user fixed (load's prefetch_budget) is never measured.
        self.records = 0 if fixed is None else fixed
        # The share of one more record the disk reads within a layer's
        # compute (``within_budget``).
        self.spare = 0.0
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
            self.records, self.spare = int(cover), cover - int(cover)


class PrefetchSwitch(Learner):
    """``prefetch="auto"``: decides from measurement whether prefetch pays.

    After ``warmup`` decode tokens (a cold pool stalls on every first read),
    a trial of ``trial`` tokens turns prefetch off and on every ``block``
    tokens, so that slow spells of a shared machine and changes in the text
    hit both alike. The first ``settle`` tokens of each block are not timed:
    a disk that lends and banks (the cgroup blkio throttle) bills the reads
    ahead of a block with prefetch to the block after it. Timed whole in
    blocks of 4, the trial measured 1.09-1.13x with prefetch on the padded
    model throttled to 400 MB/s, where whole runs of it were 0.88-0.94x of
    off; in blocks of 16 with 4 settling it measured 0.86-0.88x. Prefetch
    stays on only if the median timed token with it was at least ``margin``
    faster than the median one without it, and the tokens without it spent
    at least ``min_stall_share`` of their time stalled on reads (else there
    is nothing for prefetch to win). A clear difference (``early``) decides
    halfway, and a prefetch that clearly loses (``1 - early`` of the speed
    without it, or less) stops the trial as soon as ``stop_after`` tokens
    with it are timed (``_clear``): every trial token with a prefetch that
    loses is paid for. A disk that lends makes the first timed tokens with
    prefetch look faster, if anything, so the stop should rarely end a
    trial that prefetch would win (a slow spell of a shared machine can);
    through the throttle it fired in one of two rounds (README, "Auto's
    trial, in longer blocks").
    """

    def __init__(self, first_layer: int, max_tokens: int, trial: int = 64, block: int = 16,
                 settle: int = 4, warmup: int = 8, min_stall_share: float = 0.05,
                 margin: float = 0.02, early: float = 0.1, stop_after: int = 4,
                 clock=time.perf_counter):
        # Each block of the trial must be timed: the first token has no
        # start to time it from, so it is warmup.
        if trial < 2 * block or warmup < 1 or not 0 <= settle < block or stop_after < 1:
            raise ValueError(f"a trial of {trial} tokens needs two blocks of {block} or more, "
                             f"a warmup of one token or more (got {warmup}), fewer "
                             f"settling tokens than a block (got {settle}) and a stop after "
                             f"one timed token or more (got {stop_after})")
        self.first_layer = first_layer
        self.max_tokens = max_tokens
        self.trial = trial
        self.block = block
        self.settle = settle
        self.warmup = warmup
        self.min_stall_share = min_stall_share
        self.margin = margin
        self.early = early
        self.stop_after = stop_after
        self.clock = clock
        self.enabled = False
        self.decision = "measuring"
        self._last = None
        self._seen = 0
        self._stall = 0.0
        self._tokens = {True: [], False: []}  # seconds of each trial token
        self._off_stall = 0.0  # stalled seconds of the tokens without it

    def on_call(self, layer, tokens):
        if layer != self.first_layer or self.decision != "measuring":
            return
        if tokens > self.max_tokens:
            # A prefill (a new request) between decode tokens: the next
            # token is timed from its own start, not across the prefill.
            self._last = None
            return
        now = self.clock()
        step = self._seen - self.warmup  # the trial step of the token that just ended
        timed = self._last is not None and step >= 0 and step % self.block >= self.settle
        if timed:
            # The token that just ended ran with the state set at its start.
            self._tokens[self.enabled].append(now - self._last)
            if not self.enabled:
                self._off_stall += self._stall
        self._last, self._stall = now, 0.0
        self._seen += 1
        trial_step = self._seen - self.warmup
        if trial_step >= self.trial or self._clear(trial_step, timed):
            self._decide()
        elif trial_step >= 0:
            self.enabled = (trial_step // self.block) % 2 == 1

    def on_stall(self, layer, seconds):
        self._stall += seconds

    def _clear(self, trial_step: int, timed: bool) -> bool:
        """Whether the trial so far already decides: halfway, with a
        difference of ``early`` or more; or once ``stop_after`` tokens with
        prefetch are timed, at ``1 - early`` of the speed without it or
        less (checked once, as the last of them is timed)."""
        if not all(self._tokens.values()):
            return False
        speedup = self._speedup()
        if timed and self.enabled and len(self._tokens[True]) == self.stop_after \
                and speedup <= 1 - self.early:
            return True
        return trial_step == self.trial // 2 and abs(speedup - 1) >= self.early

    def _speedup(self) -> float:
        """Median token without prefetch over median token with it."""
        return float(np.median(self._tokens[False]) / np.median(self._tokens[True]))

    def _decide(self):
        if not all(self._tokens.values()):  # prefills cut every timed token of a side
            self._finish(False, "off: the trial timed no decode token on one side")
            return
        share = self._off_stall / sum(self._tokens[False])
        if share < self.min_stall_share:
            self._finish(False, f"off: stall share {share:.1%} too small to pay")
            return
        speedup = self._speedup()
        keep = bool(speedup >= 1 + self.margin)
        self._finish(keep, f"{'on' if keep else 'off'}: {speedup:.2f}x decode speed with it")

    def _finish(self, enabled, decision):
        self.enabled = enabled
        self.decision = decision


class UseCounts(Learner):
    """How often a layer's predictions were used, counted per bucket (a
    score's bin, a rank): every candidate of a selection, read or not,
    counts in its bucket, and the layer's next call says whether it was
    used. Calls of several tokens (verifying drafts) are counted apart, and
    judged only by a call of as many tokens (not by the prefill that
    follows a request's last token). A layer's counts halve whenever they
    pass ``window`` predictions, so that the text can move them.
    Subclasses say which bucket a candidate falls in and which are read."""

    def __init__(self, buckets: int, window: int = 4096):
        self.buckets = buckets
        self.window = window
        # Keyed by (layer, whether the calls have several tokens).
        self.predicted = {}
        self.used = {}
        self._pending = {}  # layer -> (candidates, their buckets, tokens)

    def _bucket(self, order, scores) -> np.ndarray: ...

    def _read(self, layer, order, buckets, rows) -> np.ndarray: ...

    def _counted(self, key) -> None:
        """A layer's counts changed."""

    def select(self, layer, order, scores, rows):
        """The candidates of ``order`` (best first) worth reading ahead into
        ``layer``, predicted from a call of ``rows`` tokens; counted when
        ``layer`` routes."""
        buckets = self._bucket(order, scores)
        self._pending[layer] = (order, buckets, rows)
        return self._read(layer, order, buckets, rows)

    def on_route(self, layer, ids, experts):
        pending = self._pending.pop(layer, None)
        if pending is None:
            return
        order, buckets, rows = pending
        if ids.reshape(-1, ids.shape[-1]).shape[0] != rows:
            return
        key = (layer, rows > 1)
        routed = set(experts.tolist())  # sets: np.isin costs ~150 us on a few ids
        used = np.fromiter((e in routed for e in order.tolist()), bool, len(order))
        predicted = self.predicted.setdefault(key, np.zeros(self.buckets))
        np.add.at(predicted, buckets, 1.0)
        np.add.at(self.used.setdefault(key, np.zeros(self.buckets)), buckets, used)
        if predicted.sum() > self.window:
            predicted /= 2
            self.used[key] /= 2
        self._counted(key)

    def used_share(self, layer, expert, rows) -> Optional[float]:
        """The chance that ``expert``, a candidate of ``layer``'s last
        selection (from a call of ``rows`` tokens), is used: the share used
        of the predictions in its bucket, with one used and one unused more
        (a bucket of few counts, common early and in a short text, is
        neither trusted nor refused outright); None where the layer counts
        nothing."""
        key = (layer, rows > 1)
        pending = self._pending.get(layer)
        if key not in self.predicted or pending is None:
            return None
        order, buckets, _ = pending
        at = np.flatnonzero(order == expert)
        if not len(at):
            return None
        b = buckets[at[0]]
        return float((self.used[key][b] + 1) / (self.predicted[key][b] + 2))


class ReadEveryPrediction(UseCounts):
    """``prefetch_precision=0``, and the layers a sigmoid router predicts:
    every prediction is worth a read (within the bandwidth budget). For the
    record that the budget covers only in part (``within_budget``) it counts
    how often each rank of a layer's candidates was used: its chance."""

    RANKS = 64  # ranks counted; those past it count as the last

    def __init__(self, window: int = 4096):
        super().__init__(self.RANKS, window)

    def _bucket(self, order, scores):
        return np.minimum(np.arange(len(order)), self.RANKS - 1)

    def _read(self, layer, order, buckets, rows):
        return order

    def bar(self, layer, order, scores, rows):
        return order  # two layers early: not counted (no partly covered read)

    def forget(self, layer) -> None:
        pass

    def lowest_scores(self) -> dict:
        return {}


class PrefetchCalibration(UseCounts):
    """``prefetch_precision > 0``: reads ahead only predictions likely
    enough to be used, so that at least ``target`` of what a layer reads
    ahead is used.

    A prediction's score is its share of the row's (affinity-weighed)
    probability, times the number of experts: 1 is an expert the
    prediction cannot tell from any other. Per layer, every prediction of
    an expert not resident, read or not, counts in a bin of its score
    (``UseCounts``; calls of several tokens predict and use the union of
    their tokens' experts, each scored by its best row). A layer reads the
    bins from the highest down to the lowest whose predictions together
    were used at least ``target`` of the time. Predictions made two layers
    early (``bar``) are counted apart, in a calibration of their own
    (``far``).

    Softmax routers only: a sigmoid router's probabilities lie within a
    factor of ~3 of each other, too few bins to tell (the loader gives
    those layers ``ReadEveryPrediction``).

    Scores tell more than ranks (``scripts/prefetch_scores.py`` on the
    trained 12-layer T12 of the README, 400 tokens, 8 of 32 slots):
    predictions scoring 1-2 were used 26% of the time, 2-4 63%, 4-8 94%;
    a bar at 2 read 1.95 records a call, 1.51 of them used (77%), where the
    first two ranks read 1.98, 1.38 used (70%).

    Nothing is read ahead until a layer's predictions have been counted,
    and the lowest bin read always has counts.
    """

    # Half-octave bins of scores from 1/4 to 512 (a score is at most the
    # number of experts).
    EDGES = 2.0 ** (np.arange(-4, 19) / 2)

    def __init__(self, layers, target: float, window: int = 4096, far: bool = True):
        super().__init__(len(self.EDGES) + 1, window)
        self.target = target
        # A layer's predictions made two layers early (prefetch_depth 2) are
        # used less often at the same score: counted apart, in bins of
        # their own (on the trained TW12's trace, the simulator projects
        # 16% of depth 2's reads ahead wasted against 21% with them held to
        # the near bar). Counted where the budget leaves them room.
        self.far = PrefetchCalibration(layers, target, window, far=False) if far else None
        keys = [(l, multi) for l in layers for multi in (False, True)]
        self.predicted = {k: np.zeros(self.buckets) for k in keys}
        self.used = {k: np.zeros(self.buckets) for k in keys}
        self.lowest = dict.fromkeys(keys, self.buckets)  # lowest bin read: none yet

    def forget(self, layer) -> None:
        """``layer`` reads every prediction: nothing of it to count or report."""
        for multi in (False, True):
            for table in (self.predicted, self.used, self.lowest):
                table.pop((layer, multi), None)
        if self.far is not None:
            self.far.forget(layer)

    def _bucket(self, order, scores):
        return np.searchsorted(self.EDGES, scores, side="right")

    def _read(self, layer, order, bins, rows):
        return order[bins >= self.lowest[(layer, rows > 1)]]

    def bar(self, layer, order, scores, rows):
        """``select`` for the predictions of a layer made two layers early
        (``prefetch_depth=2``), counted and held to a bar of their own."""
        if self.far is None:  # this is the far calibration itself
            return self.select(layer, order, scores, rows)
        return self.far.select(layer, order, scores, rows)

    def on_route(self, layer, ids, experts):
        if self.far is not None:
            self.far.on_route(layer, ids, experts)
        super().on_route(layer, ids, experts)

    def _counted(self, key) -> None:
        self.lowest[key] = self._lowest(key)

    def _lowest(self, key) -> int:
        # For each bin, the share used of every prediction in it or above.
        used = np.cumsum(self.used[key][::-1])[::-1]
        predicted = np.cumsum(self.predicted[key][::-1])[::-1]
        ok = np.flatnonzero((used >= self.target * predicted) & (self.predicted[key] > 0))
        return int(ok[0]) if len(ok) else len(predicted)

    def lowest_scores(self) -> dict:
        """Per layer, the least score its decode calls read ahead (None:
        nothing is)."""
        edges = np.concatenate([[0.0], self.EDGES])
        return {l: float(edges[b]) if b < len(edges) else None
                for (l, multi), b in sorted(self.lowest.items()) if not multi}
