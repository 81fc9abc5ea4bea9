"""Prefetch: what it predicts, reads and learns (its bandwidth, calibration,
affinity and auto's trial), with outputs bit-identical to mlx-lm's."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_streaming
from mlx_streaming.runtime.prefetch.predict import rank_order
from mlx_streaming.testing.helpers import IO_PATHS, PROMPT, check_matches_resident, pool_sizes


def test_prefetch_order_puts_shared_experts_first():
    rng = np.random.default_rng(0)
    for rows in (1, 3, 5):
        ids = np.stack([rng.permutation(16) for _ in range(rows)])[:, :6]
        order = rank_order(ids)
        assert sorted(order.tolist()) == sorted(set(ids.ravel().tolist()))
        counts = {e: int((ids == e).sum()) for e in order.tolist()}
        assert [counts[e] for e in order.tolist()] == sorted(counts.values(), reverse=True)




class FakeMeter:
    """A reader's running (bytes read, seconds busy)."""

    def __init__(self):
        self.bytes, self.busy = 0, 0.0

    def read(self, nbytes, seconds):
        self.bytes += nbytes
        self.busy += seconds

    def __call__(self):
        return self.bytes, self.busy


def _budget(layers, clock, meter, smoothing=1.0):
    from mlx_streaming.runtime.prefetch.learn import PrefetchBandwidth

    return PrefetchBandwidth(first_layer=0, layers=layers, record_bytes=1_000_000, max_tokens=8,
                          meter=meter, clock=clock, smoothing=smoothing)


def test_prefetch_budget_follows_disk_rate_and_compute():
    clock, meter = FakeClock(), FakeMeter()
    budget = _budget(4, clock, meter)
    assert budget.records == 0  # earned by measurement
    for _ in range(3):
        budget.on_call(0, 1)
        meter.read(12_000_000, 0.06)  # the token's reads: 12 MB in 60 ms, 200 MB/s
        budget.on_stall(2, 0.06)  # all of it stalled
        clock.now += 0.1  # 40 ms of compute over 4 layers: 10 ms each
    budget.on_call(0, 1)
    assert budget.records == 2  # 200 MB/s x 10 ms / 1 MB
    meter.read(1_000_000, 0.1)  # one read in 100 ms: 10 MB/s
    budget.on_stall(1, 0.1)
    clock.now += 0.14
    budget.on_call(0, 1)
    assert budget.records == 0
    budget.on_call(0, 100)  # a prefill call measures nothing and starts no interval
    meter.read(50_000_000, 5.0)  # its reads do not count either
    clock.now += 5.0
    budget.on_call(0, 1)
    assert budget.layer_compute == pytest.approx(0.01)
    assert budget.rate == pytest.approx(10e6)


def test_prefetch_budget_counts_overlapped_reads_as_compute_time():
    """With ``Paged``'s overlap the device computes during part of a call's
    reads: the rate is the bytes over the disk's busy time, a layer's
    compute the token's time less only the device's stall."""
    clock, meter = FakeClock(), FakeMeter()
    budget = _budget(4, clock, meter)
    for _ in range(3):
        budget.on_call(0, 1)
        meter.read(12_000_000, 0.06)  # 200 MB/s...
        budget.on_stall(2, 0.02)  # ...of which the device waited 20 ms
        clock.now += 0.1
    budget.on_call(0, 1)
    assert budget.rate == pytest.approx(200e6)
    assert budget.layer_compute == pytest.approx(0.02)  # (100 - 20) ms over 4 layers
    assert budget.records == 4


def test_prefetch_budget_carries_a_read_in_flight_to_the_token_it_ends_in():
    """A read in flight through a whole token has busy seconds and no bytes
    yet: its seconds count with its bytes, in the token where it ends."""
    clock, meter = FakeClock(), FakeMeter()
    budget = _budget(1, clock, meter)
    budget.on_call(0, 1)
    meter.read(0, 0.1)  # 100 ms of a read still in flight
    clock.now += 0.2
    budget.on_call(0, 1)
    assert budget.rate is None
    meter.read(10_000_000, 0.1)  # it ends: 10 MB in 200 ms in all
    clock.now += 0.2
    budget.on_call(0, 1)
    assert budget.rate == pytest.approx(50e6)


def test_prefetch_budget_rate_is_not_led_by_burst_reads():
    """A throttled disk serves one token's reads at once from its burst
    credit and makes the next wait: the rate is bytes over busy time
    across tokens, not the mean of each token's rate."""
    clock, meter = FakeClock(), FakeMeter()
    budget = _budget(1, clock, meter, smoothing=0.5)
    budget.on_call(0, 1)
    for busy in (0.001, 0.099, 0.001, 0.099):  # 1 MB each token
        meter.read(1_000_000, busy)
        budget.on_stall(0, busy)
        clock.now += 0.2
        budget.on_call(0, 1)
    assert budget.rate < 30e6  # about 20 MB/s; a mean of ratios says ~300 MB/s


def test_prefetch_calibration_counts_predictions_two_layers_early_apart():
    """The same score means less made two layers early: ``bar`` counts
    those predictions in bins of their own and holds them to their own
    bar, and ``forget`` drops both."""
    from mlx_streaming.runtime.prefetch.learn import PrefetchCalibration

    calibration = PrefetchCalibration([1], target=0.6, window=64)
    order, scores = np.array([5, 6]), np.array([8.0, 8.0])
    for _ in range(10):
        calibration.select(1, order[:1], scores[:1], 1)  # one layer early: 5, used
        calibration.select_two_ahead(1, order, scores, 1)  # two layers early: 5 and 6, half used
        calibration.on_route(1, np.array([[5, 3]]), np.array([3, 5]))
    assert list(calibration.select(1, order, scores, 1)) == [5, 6]
    assert calibration.select_two_ahead(1, order, scores, 1).size == 0
    calibration.forget(1)
    assert calibration.lowest_scores() == {} and calibration.two_ahead.lowest_scores() == {}


def test_prefetch_calibration_reads_the_scores_that_were_used():
    """Per layer, the bins of scores read ahead are those that, from the
    highest down, were used at least the target share of the time, counted
    on every prediction, read or not."""
    from mlx_streaming.runtime.prefetch.learn import PrefetchCalibration

    calibration = PrefetchCalibration([1, 2], target=0.8, window=64)
    order = np.array([5, 6, 7, 9])
    scores = np.array([8.0, 4.0, 1.0, 0.3])
    # Nothing is counted yet: nothing is read ahead.
    assert calibration.select(1, order, scores, 1).size == 0
    calibration.on_route(1, np.array([[5, 6]]), np.array([5, 6]))
    # A layer's call with no predictions pending counts nothing.
    calibration.on_route(2, np.array([[5, 6, 7]]), np.array([5, 6, 7]))
    assert calibration.select(2, order, scores, 1).size == 0
    calibration._pending.clear()
    for i in range(40):
        calibration.select(1, order, scores, 1)
        # 8 and 4 are always used, 1 every other call, 0.3 never: read from
        # the top, 8 and 4 are used 100%, with 1 83%, with 0.3 63%.
        calibration.on_route(1, np.array([[5, 6, 7, 3]]), np.array([5, 6] + [7] * (i % 2) + [3]))
    assert list(calibration.select(1, order, scores, 1)) == [5, 6, 7]
    assert calibration.select(2, order, scores, 1).size == 0  # layer 2 counted nothing
    assert calibration.lowest_scores()[1] == 1.0  # the bin of 1.0 starts at 1.0
    assert calibration.lowest_scores()[2] is None
    # Counts halve past the window, so they follow the text: once 1 is
    # never used, the bar rises above it.
    assert calibration.predicted[(1, False)].sum() <= 64
    for _ in range(200):
        calibration.select(1, order, scores, 1)
        calibration.on_route(1, np.array([[5, 6]]), np.array([5, 6]))
    assert list(calibration.select(1, order, scores, 1)) == [5, 6]
    # Calls of several tokens are counted apart from decode, and judged only
    # by a call of as many tokens.
    before = calibration.predicted[(1, False)].sum()
    calibration.select(1, order, scores, 1)
    calibration.on_route(1, np.array([[7, 9], [7, 9]]), np.array([7, 9]))  # a prefill
    assert calibration.predicted[(1, False)].sum() == before
    calibration.select(1, order, scores, 2)
    calibration.on_route(1, np.array([[7, 9], [5, 9], [7, 6]]), np.array([5, 6, 7, 9]))
    assert calibration.predicted[(1, True)].sum() == 0
    assert calibration.select(1, order, scores, 2).size == 0  # nothing counted yet
    for _ in range(20):
        calibration.on_route(1, np.array([[7, 9], [5, 6]]), np.array([5, 6, 7, 9]))
        calibration.select(1, order, scores, 2)
    assert list(calibration.select(1, order, scores, 2)) == [5, 6, 7, 9]
    assert calibration.predicted[(1, False)].sum() == before
    # A stricter target keeps only what is always used.
    strict = PrefetchCalibration([1], target=0.95)
    for i in range(40):
        strict.select(1, order, scores, 1)
        strict.on_route(1, np.array([[5, 6, 7]]), np.array([5, 6] + [7] * (i % 2)))
    assert list(strict.select(1, order, scores, 1)) == [5, 6]


def test_affinity_counts_which_experts_follow_which():
    from mlx_streaming.runtime.prefetch.learn import Affinity

    affinity = Affinity([(0, 4, 1, 3), (1, 3, 2, 4)], prior=1.0)
    uniform = affinity.weights(0, np.array([[0, 1]]))
    assert np.allclose(uniform, 1 / 3)  # nothing seen: the prior alone
    for _ in range(4):  # experts 0 and 1 at layer 0 are followed by 2 at layer 1
        affinity.on_route(0, np.array([[0, 1]]), None)
        affinity.on_route(1, np.array([[2, 0]]), None)
    w = affinity.weights(0, np.array([[0, 1], [3, 2]]))
    assert w.shape == (2, 3) and np.allclose(w.sum(axis=1), 1)
    assert w[0, 2] == w[0, 0] > w[0, 1]  # 2 and 0 followed 4 times, 1 never
    assert np.allclose(w[1], 1 / 3)  # experts 3 and 2 never seen
    # A prefill call of several tokens counts each token's pairs.
    affinity.on_route(0, np.array([[3, 2], [3, 0]]), None)
    affinity.on_route(1, np.array([[1, 2], [0, 2]]), None)
    assert affinity.counts[0][3, 2] == 1 + 2 and affinity.counts[0][3, 1] == 1 + 1
    assert affinity.counts[0][2, 1] == 1 + 1 and affinity.counts[0][0, 2] == 1 + 4 + 1
    # Layer 1's own calls fill the counts of the pair (1, 2).
    affinity.on_route(2, np.array([[3, 0], [1, 2]]), None)
    assert affinity.counts[1][1, 3] == 1 + 1 and affinity.counts[1][2, 1] == 1 + 1
    assert affinity.counts[1][0, 3] == 1
    # Calls of another length (a new prompt after a decode) pair nothing.
    affinity.on_route(0, np.array([[0, 1]]), None)
    before = affinity.counts[0].copy()
    affinity.on_route(1, np.array([[2, 0], [1, 0]]), None)
    assert np.array_equal(affinity.counts[0], before)
    assert affinity.seen(0) == 4 + 2 and affinity.seen(1) == 2


def test_affinity_wraps_from_the_last_layer_on_decode_only():
    from mlx_streaming.runtime.prefetch.learn import Affinity

    affinity = Affinity([(0, 4, 1, 4), (1, 4, 0, 4)], prior=0.0)
    # A two-token prefill: row i of layer 1 is not followed by row i of the
    # next call's layer 0, so the wrap counts nothing.
    affinity.on_route(0, np.array([[0, 1], [2, 3]]), None)
    affinity.on_route(1, np.array([[1, 2], [0, 3]]), None)
    affinity.on_route(0, np.array([[3, 2], [1, 0]]), None)
    assert affinity.seen(1) == 0 and affinity.seen(0) == 2
    # Decode: the last layer's experts, then the first layer's of the next token.
    affinity.on_route(1, np.array([[1, 2]]), None)
    affinity.on_route(0, np.array([[3, 0]]), None)
    assert affinity.seen(1) == 1
    assert affinity.counts[1][1, 3] == affinity.counts[1][2, 0] == 1
    assert affinity.counts[1].sum() == 4


class StagingSpy:
    """A staging area that reports each ``stage`` (layer, experts, reads
    issued) and ``take`` (layer, expert, CRC or None); the native one's
    methods are read-only, so it is wrapped, not patched."""

    def __init__(self, inner, on_stage, on_take=None):
        self.inner, self.on_stage, self.on_take = inner, on_stage, on_take

    def stage(self, layer, file, experts, offsets):
        issued = self.inner.stage(layer, file, experts, offsets)
        self.on_stage(layer, experts, issued)
        return issued

    def take(self, layer, expert, *args):
        crc = self.inner.take(layer, expert, *args)
        if self.on_take is not None:
            self.on_take(layer, expert, crc)
        return crc

    def __getattr__(self, name):
        return getattr(self.inner, name)


def spy_on_prefetch(runtime, on_issue, on_stage, on_take=None):
    """Report each prefetcher's ``issue`` (its layer) before it runs, and
    every stage and take of the stores' staging."""
    for residency in runtime.residencies:
        def issue(predicted, ids, inner=residency.prefetch.issue, layer=residency.layer):
            on_issue(layer)
            return inner(predicted, ids)

        residency.prefetch.issue = issue
    for store in runtime.stores:
        store.staging = StagingSpy(store.staging, on_stage, on_take)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("io", IO_PATHS)
def test_prefetch_queues_after_the_layers_demand_reads(models, io, depth):
    """A layer's reads ahead (for the next layer, and with depth 2 the one
    after) are staged once its own demand reads are done, never before."""
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=4, io=io, prefetch="next-layer",
                                  prefetch_records=8, prefetch_precision=0,
                                  prefetch_depth=depth)
    runtime = model.streaming
    assert runtime.prefetch.calibration.lowest_scores() == {}
    log = []
    for store in runtime.stores:
        read = store._read

        def logged_read(experts, slots, want_crc, read=read, layer=store.layer):
            log.append(("read", layer))
            return read(experts, slots, want_crc)

        store._read = logged_read
    spy_on_prefetch(runtime, on_issue=lambda layer: log.append(("issue", layer)),
                    on_stage=lambda layer, experts, issued: log.append(("stage", layer)))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    token = mx.array([[3]])
    demand_reads = 0
    layers = [s.layer for s in runtime.stores]
    for _ in range(6):
        log.clear()
        token = mx.argmax(model(token, cache=cache)[:, -1], axis=-1, keepdims=True)
        mx.eval(token)
        issues = [k for k, e in enumerate(log) if e[0] == "issue"]
        for k, end in zip(issues, issues[1:] + [len(log)]):
            layer = log[k][1]
            staged = [e[1] for e in log[k:end] if e[0] == "stage"]
            i = layers.index(layer)
            if i + 1 < len(layers):
                assert staged[0] == layers[i + 1], "the next layer's reads come first"
                assert set(staged) <= set(layers[i + 1 : i + 1 + depth])
            reads = [j for j, e in enumerate(log) if e == ("read", layer)]
            assert not reads or max(reads) < k
            demand_reads += len(reads)
    assert demand_reads > 0, "the test saw no demand read to order against"


@pytest.mark.parametrize("io", IO_PATHS)
def test_prefetch_depth_two_reads_the_layer_after_next_with_the_room_left(models, io):
    """With ``prefetch_depth=2`` a layer stages its successor's predictions,
    then, in the same issue, the layer after next's with the budget left,
    never more new reads than the budget; the layer after next takes some of
    them. Depth 1 never stages two layers ahead."""
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    budget = 5  # more than the 4 experts predicted per token: room is left
    for depth in (1, 2):
        with mlx_streaming.load(stream_dir, slots_per_layer=4, io=io,
                                prefetch="next-layer", prefetch_records=budget,
                                prefetch_precision=0, prefetch_depth=depth) as (model, _):
            runtime = model.streaming
            layers = [s.layer for s in runtime.stores]
            issues = []  # per issue, (layer staged, reads issued) in order
            ahead = set()  # (layer, expert) staged two layers early
            taken_ahead = []

            def on_stage(layer, experts, issued):
                if issues[-1]:  # the second stage of an issue: two layers ahead
                    ahead.update((layer, int(e)) for e in experts)
                issues[-1].append((layer, issued))

            def on_take(layer, expert, crc):
                if crc is not None and (layer, expert) in ahead:
                    taken_ahead.append((layer, expert))

            spy_on_prefetch(runtime, lambda layer: issues.append([]), on_stage, on_take)
            _stats_of_decode(model, 8)
            staged = [i for i in issues if i]
            assert all(sum(n for _, n in i) <= budget for i in staged)
            two = {tuple(layer for layer, _ in i) for i in staged if len(i) == 2}
            if depth == 1:
                assert not two and not ahead
            else:
                # Every layer but the last two reads for the two layers after it.
                assert {(a, b) for a, b in zip(layers[1:], layers[2:])} <= two
                assert taken_ahead, "no record read two layers early was used"


@pytest.mark.parametrize("io", IO_PATHS)
def test_outputs_identical_with_prefetch_two_layers_ahead(models, io):
    src, stream_dir = models.get("qwen3_moe", quantized=True)
    model = check_matches_resident(src, stream_dir, slots_per_layer=pool_sizes(stream_dir)[0],
                                   io=io, prefetch="next-layer", prefetch_records=8,
                                   prefetch_precision=0, prefetch_depth=2)
    assert mlx_streaming.stats(model)["total"]["prefetch_useful"] > 0


@pytest.mark.parametrize("io", IO_PATHS)
def test_prefetch_calibration_gates_the_reads_of_each_layer(models, io):
    """Either reader stages only the predictions a layer's calibration lets
    it read, and a layer that may read none stages none."""
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=4, io=io, prefetch="next-layer",
                                  prefetch_records=8, prefetch_precision=0.5)
    runtime = model.streaming
    layers = [s.layer for s in runtime.stores]
    calibration = runtime.prefetch.calibration
    bins = len(calibration.EDGES) + 1
    # Hold each layer's threshold, for predictions one and two layers early:
    # layer 1 reads every prediction, the rest none.
    for held in (calibration, calibration.two_ahead):
        held._lowest = lambda key: 0 if key[0] == layers[1] else bins
        held.lowest.update({k: held._lowest(k) for k in held.lowest})
    steps = 10
    s = _stats_of_decode(model, steps)
    assert s["layers"][layers[1]]["prefetch_issued"] > 0
    assert all(s["layers"][layer]["prefetch_issued"] == 0 for layer in layers[2:])
    assert s["prefetch_bandwidth"]["lowest_score"][layers[1]] == 0.0
    assert s["prefetch_bandwidth"]["lowest_score"][layers[2]] is None


def test_within_bandwidth_reads_a_partly_covered_record_when_likely_used():
    """The whole records the compute reads, then one more if its chance of
    use is at least the share of it the compute does not cover."""
    from mlx_streaming.runtime.prefetch.predict import within_bandwidth

    order = np.array([5, 3, 9])
    chance = {5: 0.9, 3: 0.7, 9: 0.1}.get
    assert within_bandwidth(order, 1, 0.0, chance).tolist() == [5]  # covered: none
    assert within_bandwidth(order, 1, 0.25, chance).tolist() == [5]  # 3: 0.7 < 0.75
    assert within_bandwidth(order, 1, 0.35, chance).tolist() == [5, 3]  # 0.7 >= 0.65
    assert within_bandwidth(order, 0, 0.2, chance).tolist() == [5]  # 0.9 >= 0.8
    assert within_bandwidth(order, 0, 0.05, chance).tolist() == []  # 0.9 < 0.95
    assert within_bandwidth(order, 0, 0.9, lambda e: None).tolist() == []  # not known: not read
    assert within_bandwidth(order, 5, 0.9, chance).tolist() == [5, 3, 9]


def test_prefetch_budget_keeps_the_share_of_a_record_its_compute_covers():
    clock, meter = FakeClock(), FakeMeter()
    budget = _budget(4, clock, meter)
    for _ in range(2):
        budget.on_call(0, 1)
        meter.read(12_000_000, 0.06)  # 200 MB/s
        budget.on_stall(2, 0.06)
        clock.now += 0.11  # 50 ms of compute over 4 layers: 12.5 ms each
    budget.on_call(0, 1)
    assert budget.records == 2 and budget.partial == pytest.approx(0.5)  # 2.5 records


def test_calibration_chance_of_use_is_smoothed_per_bin():
    from mlx_streaming.runtime.prefetch.learn import PrefetchCalibration

    calibration = PrefetchCalibration([0], target=0.5)
    assert calibration.used_share(0, 1, 1) is None  # nothing selected yet
    for _ in range(8):  # score 8 always used, score 1.5 never
        calibration.select(0, np.array([1, 2]), np.array([8.0, 1.5]), 1)
        calibration.on_route(0, np.array([[1, 4]]), np.array([1, 4]))
    calibration.select(0, np.array([5, 6, 7]), np.array([1.5, 8.0, 100.0]), 1)
    assert calibration.used_share(0, 6, 1) == pytest.approx(9 / 10)
    assert calibration.used_share(0, 5, 1) == pytest.approx(1 / 10)
    assert calibration.used_share(0, 7, 1) == pytest.approx(1 / 2)  # a bin not counted yet
    calibration.select(0, np.array([6]), np.array([8.0]), 2)
    assert calibration.used_share(0, 6, 2) == pytest.approx(1 / 2)  # several tokens: apart


def test_every_prediction_read_counts_the_chance_of_each_position():
    """Where scores are not binned (precision 0, a sigmoid router), the
    chance of the partly covered record is its rank's share used."""
    from mlx_streaming.runtime.prefetch.learn import ReadEveryPrediction

    by_position = ReadEveryPrediction()
    assert by_position.select(3, np.array([4, 5]), None, 1).tolist() == [4, 5]  # reads them all
    assert by_position.used_share(3, 4, 1) is None  # nothing counted
    for i in range(4):  # the first candidate used every time, the second never
        by_position.select(3, np.array([10 + i, 20 + i]), None, 1)
        by_position.on_route(3, np.array([[10 + i, 0]]), np.array([0, 10 + i]))
    by_position.select(3, np.array([7, 8, 9]), None, 1)
    assert by_position.used_share(3, 7, 1) == pytest.approx(5 / 6)
    assert by_position.used_share(3, 8, 1) == pytest.approx(1 / 6)
    assert by_position.used_share(3, 9, 1) == pytest.approx(1 / 2)  # position 2: none counted
    by_position.select_two_ahead(3, np.array([1]), None, 1)  # two layers early: not counted
    by_position.on_route(3, np.array([[7, 1]]), np.array([1, 7]))  # [7, 8, 9] judged, not [1]
    by_position.select(3, np.array([7, 8]), None, 1)
    assert by_position.used_share(3, 7, 1) == pytest.approx(6 / 7)
    assert by_position.used_share(3, 8, 1) == pytest.approx(1 / 7)  # none of 5 used
    assert by_position.used_share(3, 99, 1) is None  # not a candidate of that selection


@pytest.mark.parametrize("io", IO_PATHS)
def test_prefetch_reads_a_partly_covered_record_where_whole_ones_do_not_fit(models, io):
    """A budget of no whole record (a disk slower than a layer's compute)
    still reads ahead one record a call where its chance of use is high
    enough for the share of it the compute covers; none where it is not."""
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=4, io=io, prefetch="next-layer",
                                  prefetch_records=0, prefetch_precision=0.5,
                                  prefetch_depth=1)
    runtime = model.streaming
    layers = [s.layer for s in runtime.stores]
    calibration = runtime.prefetch.calibration
    calibration._lowest = lambda key: 0  # every prediction passes the bar
    calibration.lowest.update({k: 0 for k in calibration.lowest})
    calibration.used_share = lambda layer, expert, rows: 0.9 if layer == layers[1] else 0.5
    steps = 10
    assert all(s["prefetch_issued"] == 0 for s in _stats_of_decode(model, steps)["layers"]
               .values())  # no share of a record covered: nothing
    runtime.prefetch.bandwidth.partial = 0.2  # 0.9 >= 1 - 0.2; 0.5 is not
    s = _stats_of_decode(model, steps)
    assert 0 < s["layers"][layers[1]]["prefetch_issued"] <= steps
    assert all(s["layers"][layer]["prefetch_issued"] == 0 for layer in layers[2:])


@pytest.mark.parametrize("family, precision", [("deepseek_v3", 0.7), ("qwen3_moe", 0.0)])
def test_a_partly_covered_record_by_its_positions_chance(models, family, precision):
    """Where scores are not binned (a sigmoid router's layers; every layer
    at precision 0) the record the budget covers only in part is read where
    its rank's counted chance is enough, and not where it is not."""
    _, stream_dir = models.get(family, quantized=True)
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=4, prefetch="next-layer",
                                  prefetch_records=0, prefetch_depth=1,
                                  prefetch_precision=precision)
    runtime = model.streaming
    by_position = runtime.prefetch.by_position
    steps = 10
    assert all(s["prefetch_issued"] == 0 for s in _stats_of_decode(model, steps)["layers"]
               .values())  # no share of a record covered: nothing
    counted = {layer for layer, _ in by_position.predicted}
    first = runtime.stores[0].layer  # predicted by affinity alone: score bins above 0
    assert counted and (first in counted) == (precision == 0)
    runtime.prefetch.bandwidth.partial = 0.99  # a counted chance above 1% reads it
    s = _stats_of_decode(model, steps)
    read = [s["layers"][layer]["prefetch_issued"] for layer in counted]
    assert sum(read) > 0 and max(read) <= steps  # one record a call at most
    by_position.used_share = lambda layer, expert, rows: 0.009  # below 1%: none
    s = _stats_of_decode(model, steps)
    assert all(s["layers"][layer]["prefetch_issued"] == 0 for layer in counted)




@pytest.mark.parametrize("prefetch", ["off", "next-layer", "auto"])
@pytest.mark.parametrize("io", IO_PATHS)
def test_outputs_identical_with_prefetch_and_io(models, io, prefetch):
    src, stream_dir = models.get("qwen3_moe", quantized=True)
    for slots in pool_sizes(stream_dir):
        model = check_matches_resident(src, stream_dir, slots_per_layer=slots, io=io,
                                       prefetch=prefetch)
        assert mlx_streaming.stats(model)["io"] == io


@pytest.mark.parametrize("io", IO_PATHS)
def test_outputs_identical_with_calibrated_prefetch(models, io):
    """Reads ahead kept to the predictions scored likely enough change no
    output (the reads it makes are checked, not merely allowed)."""
    src, stream_dir = models.get("qwen3_moe", quantized=True)
    model = check_matches_resident(src, stream_dir, slots_per_layer=pool_sizes(stream_dir)[0],
                                   io=io, prefetch="next-layer", prefetch_records=8,
                                   prefetch_precision=0.3)
    s = mlx_streaming.stats(model)
    assert s["total"]["prefetch_issued"] > 0
    assert any(v is not None for v in s["prefetch_bandwidth"]["lowest_score"].values())
    # Predictions two layers early (the default depth) counted on their own.
    two_ahead = model.streaming.prefetch.calibration.two_ahead
    assert any(two_ahead.predicted[key].sum() > 0 for key in two_ahead.predicted)
    assert set(s["prefetch_bandwidth"]["lowest_score_two_ahead"])


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k3"])
def test_sigmoid_routers_read_every_prediction_at_the_default_precision(models, family,
                                                                       tmp_path):
    """A sigmoid router's scores are too flat to calibrate: its layers read
    what the budget allows, as at precision 0."""
    from mlx_streaming.bench.cache import decode_records

    src, stream_dir = models.get(family, quantized=True)
    trace = tmp_path / "trace.jsonl"
    model = check_matches_resident(src, stream_dir, slots_per_layer=pool_sizes(stream_dir)[0],
                                   prefetch="next-layer", prefetch_records=8, trace=trace)
    runtime = model.streaming
    assert runtime.prefetch.calibration.target == 0.7
    layers = [s.layer for s in runtime.stores]
    s = mlx_streaming.stats(model)
    assert all(s["layers"][layer]["prefetch_issued"] > 0 for layer in layers[1:])
    # Reported as reading every prediction, not as reading none.
    assert not set(s["prefetch_bandwidth"]["lowest_score"]) & set(layers[1:])
    # The trace says so, for bench simulate to replay them alike.
    calls = decode_records(trace)
    assert all(c.ranked is not None and c.sigmoid_router
               for layer in layers[1:] for c in calls[layer])
    # The first is predicted across tokens from affinity alone, calibrated.
    assert not any(c.sigmoid_router for c in calls[layers[0]])


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "kimi_k3"])
def test_prefetch_across_router_kinds(models, family):
    """Sigmoid routers with a selection bias, routers with a bias term."""
    src, stream_dir = models.get(family, quantized=True)
    slots = pool_sizes(stream_dir)[0]
    # A fixed budget: this tiny model's decode may read too little to measure
    # one; every prediction read, too few for a calibration to count.
    model = check_matches_resident(src, stream_dir, slots_per_layer=slots,
                                   prefetch="next-layer", prefetch_records=8,
                                   prefetch_precision=0)
    t = mlx_streaming.stats(model)["total"]
    assert t["prefetch_issued"] > 0 and t["routed"] > 0


@pytest.mark.parametrize("io", IO_PATHS)
def test_prefetch_adds_no_sync_and_reports_telemetry(models, io):
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    model, _ = mlx_streaming.load(stream_dir, slots_per_layer=4, io=io, prefetch="next-layer",
                                  prefetch_records=8)
    steps = 12
    s = _stats_of_decode(model, steps)
    t = s["total"]
    assert t["syncs"] == steps * s["moe_layers"], "one sync per MoE layer per token"
    assert t["prefetch_issued"] > 0
    assert t["prefetch_useful"] + t["prefetch_wasted"] <= t["prefetch_issued"]
    assert 0.0 <= t["prefetch_recall"] <= 1.0
    # The last MoE layer predicts the first one's experts for the next token.
    first = s["layers"][model.streaming.stores[0].layer]
    assert first["prefetch_issued"] > 0 and first["routed"] > 0


def test_first_layer_is_predicted_only_by_affinity(models):
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    for affinity, predicted in ((False, False), (True, True)):
        model, _ = mlx_streaming.load(stream_dir, slots_per_layer=4, prefetch="next-layer",
                                      prefetch_records=8, prefetch_affinity=affinity)
        cache = make_prompt_cache(model)
        token = mx.array([PROMPT])
        for _ in range(6):
            token = mx.argmax(model(token, cache=cache)[:, -1], axis=-1, keepdims=True)
        mx.eval(token)
        first = mlx_streaming.stats(model)["layers"][model.streaming.stores[0].layer]
        assert (first["routed"] > 0) == predicted, affinity


def _stats_of_decode(model, steps: int) -> dict:
    """``stats`` of ``steps`` greedy decode tokens after the prompt."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    mlx_streaming.reset_stats(model)
    token = mx.array([[3]])
    for _ in range(steps):
        token = mx.argmax(model(token, cache=cache)[:, -1], axis=-1, keepdims=True)
    mx.eval(token)
    return mlx_streaming.stats(model)


def test_prefetch_learners_hear_the_paged_calls_through_one_observer(qwen):
    """What prefetch learns (calls, routes, stalls) reaches its learners
    through ``PrefetchControl``, one observer of the paged calls' events,
    each hook only where the factory wired it; the learners are not
    observers themselves."""
    from mlx_streaming.runtime.prefetch.learn import PrefetchControl

    seen = []
    control = PrefetchControl(on_route=[lambda layer, ids, experts: seen.append(
        (layer, experts.tolist()))])
    control.on_paged_call(3, 1, np.array([[4, 2]]), np.array([2, 4]), 0)
    control.on_stall(3, 0.5)
    assert seen == [(3, [2, 4])]

    model, _ = mlx_streaming.load(qwen[1], slots_per_layer=4, prefetch="auto")
    runtime = model.streaming
    prefetch = runtime.prefetch
    learners = (prefetch.trial, prefetch.bandwidth, prefetch.affinity, prefetch.calibration)
    assert not any(o in learners for o in runtime.events.observers)
    assert runtime.events.observers.count(prefetch.control) == 1
    _stats_of_decode(model, 12)
    assert prefetch.trial._seen == 12  # the trial counted each decode token
    assert prefetch.affinity.seen(runtime.stores[0].layer) > 0
    assert prefetch.bandwidth.rate is not None  # reads and stalls reached the bandwidth


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _decode(trial, clock, tokens, seconds, stall):
    """Decode ``tokens`` tokens; each takes ``seconds(on)`` and stalls
    ``stall(on)`` where ``on`` is whether prefetch was enabled for it."""
    for _ in range(tokens):
        trial.on_call(0, 1)
        on = trial.enabled
        trial.on_stall(5, stall(on))
        clock.now += seconds(on)


def test_auto_prefetch_stays_off_when_reads_do_not_stall():
    from mlx_streaming.runtime.prefetch.trial import PrefetchTrial, TrialPlan

    clock = FakeClock()
    trial = PrefetchTrial(first_layer=0, max_tokens=8, plan=TrialPlan(tokens=16, block=2, settle=0, warmup=2), clock=clock)
    _decode(trial, clock, 30, lambda on: 0.1, lambda on: 0.001)
    assert not trial.enabled and trial.decision.startswith("off: stall share 1.0%")


def test_auto_prefetch_refuses_a_trial_it_cannot_time():
    from mlx_streaming.runtime.prefetch.trial import TrialPlan

    # Fewer than two blocks, no warmup token (the first has no start to
    # time it from), or blocks that are all settling: a side of the trial
    # would have no token to judge.
    for bad in (dict(tokens=6, block=4), dict(warmup=0), dict(block=4, settle=4),
                dict(settle=-1), dict(stop_after=0)):
        with pytest.raises(ValueError, match="two blocks"):
            TrialPlan(**bad)


def test_auto_prefetch_judges_a_block_after_the_last_ones_debt():
    from mlx_streaming.runtime.prefetch.trial import PrefetchTrial, TrialPlan

    # A disk that lends (the blkio throttle): a token with prefetch takes
    # 0.08 s but leaves 0.04 s of reads that the token four later pays, so
    # prefetch runs at 0.12 s a token against 0.1 without it. Timed whole,
    # blocks of 4 (the old trial) or 8 bill its debt to the blocks without
    # it and keep it; untimed first tokens as long as the lag leave each
    # side its own cost.
    def trial(block, settle):
        clock = FakeClock()
        trial = PrefetchTrial(first_layer=0, max_tokens=8, plan=TrialPlan(tokens=64, block=block, settle=settle, warmup=2), clock=clock)
        lent = [0.0] * 4
        for _ in range(80):
            trial.on_call(0, 1)
            on = trial.enabled
            trial.on_stall(5, 0.05)
            clock.now += (0.08 if on else 0.1) + lent.pop(0)
            lent.append(0.04 if on else 0.0)
        assert trial.decision != "measuring"
        # The seconds of the tokens it timed with prefetch.
        return trial.enabled, {round(t, 6) for t in trial._tokens[True]}

    assert trial(block=4, settle=0) == (True, {0.08})  # the old trial: every token lent
    assert trial(block=16, settle=0)[1] == {0.08, 0.12}
    assert trial(block=8, settle=4) == (False, {0.12})
    assert trial(block=16, settle=4) == (False, {0.12})
    default = PrefetchTrial(first_layer=0, max_tokens=8)
    assert (default.block, default.settle) == (16, 4)


def test_auto_prefetch_stops_a_trial_it_clearly_loses():
    from mlx_streaming.runtime.prefetch.trial import PrefetchTrial, TrialPlan

    # The default trial (blocks of 16, the first 4 untimed): prefetch 10%
    # or more slower is dropped once 4 tokens with it are timed, 8 tokens
    # into its first block; a smaller loss, or a gain, runs on to halfway
    # or the end. Each token with prefetch that loses is paid for.
    def run(on_seconds):
        clock = FakeClock()
        trial = PrefetchTrial(first_layer=0, max_tokens=8, plan=TrialPlan(warmup=2), clock=clock)
        with_it = 0
        for _ in range(80):
            trial.on_call(0, 1)
            on = trial.enabled
            with_it += on
            trial.on_stall(5, 0.0 if on else 0.05)
            if on:
                clock.now += on_seconds() if callable(on_seconds) else on_seconds
            else:
                clock.now += 0.1
        return trial.enabled, with_it, len(trial._tokens[True])

    assert run(0.12) == (False, 8, 4)
    assert run(0.112) == (False, 8, 4)
    assert run(0.105) == (False, 32, 24)  # 0.95x: the whole trial
    assert run(0.07) == (True, 80 - 17, 12)  # from its first block on, kept halfway
    # Judged once, at the fourth: its first timed tokens at 0.95x, the
    # rest slower, it decides at halfway (a stop judged again at each token
    # with prefetch would stop at the eighth).
    timed = iter([0.105] * 8 + [0.13] * 60)  # the first 4 settle
    assert run(lambda: next(timed)) == (False, 16, 12)


def test_auto_prefetch_does_not_time_a_prefill_as_a_token():
    from mlx_streaming.runtime.prefetch.trial import PrefetchTrial, TrialPlan

    # Prefetch is faster (0.06 against 0.1 s); a 5 s prefill of a new
    # request after every fourth token, with it or not, must not count as
    # a token's time.
    clock = FakeClock()
    trial = PrefetchTrial(first_layer=0, max_tokens=8, plan=TrialPlan(tokens=32, block=4, settle=0, warmup=2), clock=clock)
    for token in range(50):
        trial.on_call(0, 1)
        on = trial.enabled
        trial.on_stall(5, 0.0 if on else 0.05)
        clock.now += 0.06 if on else 0.1
        if token % 4 == 3:
            trial.on_call(0, 100)  # the prefill
            clock.now += 5.0
    assert all(t < 1 for side in trial._tokens.values() for t in side)
    assert trial.enabled and trial.decision.startswith("on")
    # Prefills after every token of one side leave it untimed: off, said so.
    clock = FakeClock()
    trial = PrefetchTrial(first_layer=0, max_tokens=8, plan=TrialPlan(tokens=16, block=2, settle=0, warmup=2), clock=clock)
    for token in range(30):
        trial.on_call(0, 1)
        clock.now += 0.1
        if trial.enabled:
            trial.on_call(0, 100)
    assert not trial.enabled and "timed no decode token" in trial.decision


def test_auto_prefetch_keeps_what_measures_faster():
    from mlx_streaming.runtime.prefetch.trial import PrefetchTrial, TrialPlan

    # Faster with it: kept. Slower, or within the 2% margin: dropped. A
    # difference of 10% or more decides halfway (after token 10).
    for on_seconds, expected, decided_at in ((0.06, True, 10), (0.13, False, 10),
                                             (0.115, False, 10), (0.088, True, 10),
                                             (0.099, False, None), (0.095, True, None)):
        clock = FakeClock()
        trial = PrefetchTrial(first_layer=0, max_tokens=8, plan=TrialPlan(tokens=16, block=2, settle=0, warmup=2), clock=clock)

        def seconds(on, on_seconds=on_seconds):
            return on_seconds if on else 0.1

        def stall(on):
            return 0.0 if on else 0.05

        for token in range(1, 18):  # the whole trial ends at token 18
            _decode(trial, clock, 1, seconds, stall)
            decided = trial.decision != "measuring"
            assert decided == (decided_at is not None and token >= decided_at), token
        _decode(trial, clock, 2, seconds, stall)
        assert trial.enabled is expected, trial.decision
        assert trial.decision.startswith("on" if expected else "off")
        # Prefill calls and other layers change nothing once decided.
        trial.on_call(0, 100)
        trial.on_call(3, 1)
        _decode(trial, clock, 5, lambda on: 0.1, lambda on: 0.0)
        assert trial.enabled is expected
