"""The memory plan against the memory there is: what does not fit is refused
at load with the number that fits, and what loads, runs."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_streaming
from mlx_streaming.config import StreamConfig
from mlx_streaming.errors import (
    BudgetError,
)
from mlx_streaming.format import read_manifest
from mlx_streaming.runtime import memory as budget
from mlx_streaming.testing.helpers import assert_one_line_error


def test_explicit_pool_beyond_available_memory_is_refused(qwen):
    manifest = read_manifest(qwen[1])
    per_slot = budget.bytes_per_slot(manifest)
    spine = 10_000
    dense = sum(d.nbytes for d in manifest.dense)  # fits beside the pool: stays resident
    # A quarter of what is available stays free for the rest of the process.
    available = lambda: int((spine + dense + 6 * per_slot) / 0.75) + 100  # noqa: E731
    plan = lambda config: budget.plan_memory(manifest, config, spine, available)  # noqa: E731
    assert plan(StreamConfig(slots_per_layer=6)).slots == 6
    # Refused, naming the most slots that fit and leave that room; that
    # number loads.
    with pytest.raises(BudgetError, match=r"can go to the model .*: use "
                                          r"--slots-per-layer (\d+) ") as e:
        plan(StreamConfig(slots_per_layer=8))
    most = int(str(e.value).split("--slots-per-layer ")[1].split()[0])
    assert 4 <= most < 8
    assert plan(StreamConfig(slots_per_layer=most)).total <= available() * 3 / 4
    # cache_gb covers the spine too: the advice is what is available, less
    # the same room.
    with pytest.raises(BudgetError, match=r"can go to the model .*: use --cache-gb 0\.000\d+ or") as e:
        plan(StreamConfig(cache_gb=(spine + dense + 8 * per_slot) / 1e9))
    advised = float(str(e.value).split("--cache-gb ")[1].split()[0])
    assert available() * 0.74 < advised * 1e9 <= available() * 3 / 4
    assert plan(StreamConfig(cache_gb=advised)).total <= available() * 3 / 4


def test_prefetchs_staging_area_is_in_the_memory_plan(qwen):
    """The staging area comes out of the budget: a cache_gb that holds n
    slots per layer without prefetch holds fewer with it, the plan's total
    stays within the budget, and the loaded model's staging is the size the
    plan counted. With every expert resident there is nothing to stage."""
    manifest = read_manifest(qwen[1])
    per_slot = budget.bytes_per_slot(manifest)
    spine = 10_000
    dense = sum(d.nbytes for d in manifest.dense)
    plan = lambda **kw: budget.plan_memory(  # noqa: E731
        manifest, StreamConfig(**kw), spine, lambda: 1 << 40)
    records, stride = budget.staging_shape(manifest, StreamConfig(prefetch="next-layer"))
    staged_slots = math.ceil(records * stride / per_slot)  # slots the staging costs
    n = budget.min_slots(manifest) + staged_slots + 1
    assert n < budget.max_slots(manifest)
    off = plan(cache_gb=(spine + dense + n * per_slot) / 1e9)
    on = plan(cache_gb=(spine + dense + n * per_slot) / 1e9, prefetch="next-layer")
    assert off.slots == n and off.staging == 0
    assert on.staging == records * stride > 0
    assert on.slots == n - staged_slots
    assert on.total <= on.budget
    everything = budget.max_slots(manifest)
    assert plan(cache_gb=1e3, prefetch="next-layer").slots == everything
    assert plan(cache_gb=1e3, prefetch="next-layer").staging == 0
    # An explicit pool is as asked; the staging is added to what it needs.
    asked = plan(slots_per_layer=4, prefetch="next-layer")
    assert asked.staging == on.staging
    assert asked.total == plan(slots_per_layer=4).total + on.staging

    with mlx_streaming.load(qwen[1], slots_per_layer=4, prefetch="next-layer") as (model, _):
        assert model.streaming.plan.staging == on.staging
        assert mlx_streaming.stats(model)["memory"]["staging_gb"] == on.staging / 1e9


def test_what_loads_in_a_small_cgroup_runs(tmp_path, tokenizer_dir):
    """In a 0.5 GB memory cgroup, 0.8 GB of experts: a size that would eat
    into what the rest of the process needs is refused, naming the number
    that fits (once, --cache-gb 0.44 on a 0.77 GB model loaded and was
    killed); the sizes advised, and the defaults, load and run without a
    kill and without the pools shrinking at once (the advice left nothing
    for the pressure bar)."""
    from mlx_streaming.bench.inputs import BenchError
    from mlx_streaming.bench.limits import MemoryLimit
    from mlx_streaming.testing import synthetic

    stream = synthetic.make_synthetic(
        tmp_path / "big", tokenizer_dir, hidden_size=1024, num_hidden_layers=2,
        num_experts=64, num_experts_per_tok=2, moe_intermediate_size=4096)
    assert read_manifest(stream).expert_nbytes > 0.8e9
    try:
        limit = MemoryLimit(0.5)
    except BenchError as e:
        pytest.skip(str(e))

    def generate(*flags):
        proc = subprocess.run(
            [sys.executable, "-m", "mlx_streaming.generate", "--model", str(stream),
             "--max-tokens", "24", *flags],
            capture_output=True, text=True, preexec_fn=limit.enter, timeout=300)
        assert limit.oom_kills() == 0, proc.stderr
        return proc

    try:
        refused = generate("--slots-per-layer", "64")
        assert_one_line_error(refused, r"slots_per_layer=64 needs .* use --slots-per-layer \d+")
        most = refused.stderr.split("--slots-per-layer ")[-1].split()[0]
        refused = generate("--cache-gb", "0.44")
        assert_one_line_error(refused, r"cache_gb=0.44 needs .* use --cache-gb [\d.]+ or less")
        advised = refused.stderr.split("--cache-gb ")[-1].split()[0]
        for flags in (["--slots-per-layer", most], ["--cache-gb", advised]):
            proc = generate(*flags)
            assert proc.returncode == 0, (flags, proc.stderr)
            assert "pools shrink" not in proc.stderr, (flags, proc.stderr)
        # With the defaults, a long prompt goes through in steps the
        # headroom holds (mlx-lm's 2048 at once was killed).
        proc = generate("--prompt", " ".join(f"word{i}" for i in range(150)),
                        "--ignore-chat-template", "--max-tokens", "8",
                        "--stats-json", str(tmp_path / "s.json"))
        assert proc.returncode == 0, proc.stderr
        assert "pools shrink" not in proc.stderr, proc.stderr
        stats = json.loads((tmp_path / "s.json").read_text())
        assert stats["summary"]["prompt_tokens"] > 600, stats["summary"]
        assert stats["stats"]["memory"]["prefill_step"] < 600, stats["stats"]["memory"]
    finally:
        limit.close()


def test_the_spine_ring_shrinks_to_one_before_a_refusal(qwen):
    """A model whose streamed spine fits with a ring of one buffer and not
    two loads with the defaults (the ring shrinks); asked for two, it is
    refused."""
    manifest = read_manifest(qwen[1])
    base = 10_000
    largest = max(d.nbytes for d in manifest.dense)
    least_one = base + largest + budget.min_slots(manifest) * budget.bytes_per_slot(manifest)
    available = lambda: int(least_one / 0.75) + 100  # noqa: E731 (a quarter is headroom)
    plan = budget.plan_memory(manifest, StreamConfig(), base, available)
    assert plan.ring_buffers == 1 and plan.streamed
    with pytest.raises(BudgetError, match="the model needs at least"):
        budget.plan_memory(manifest, StreamConfig(spine_ring=2), base, available)
    assert budget.plan_memory(manifest, StreamConfig(spine_ring=1), base,
                              available).ring_buffers == 1


def test_the_prefill_step_is_what_the_headroom_holds(qwen):
    """mlx-lm's 2048 tokens at once where the headroom holds their
    activations, fewer (halving) where it does not, and a headroom grown
    to hold the least step; MLX's buffer cache is capped on a small
    machine and put back when the model closes."""
    import mlx.core as mx

    from mlx_streaming.runtime.memory import plan_memory
    from mlx_streaming.runtime.prefill_step import MIN_PREFILL_STEP, PREFILL_STEP, bytes_per_token

    _, stream_dir = qwen
    manifest = read_manifest(stream_dir)
    model_config = json.loads((Path(stream_dir) / "config.json").read_text())
    model_config.update(hidden_size=1024, moe_intermediate_size=768, num_attention_heads=16)
    per_token = bytes_per_token(model_config, manifest)
    steps = []
    for avail in (40e9, 2e9, 0.6e9, 0.3e9, 0.1e9):
        plan = plan_memory(manifest, StreamConfig(), 0, lambda a=avail: int(a),
                           model_config=model_config)
        assert plan.prefill_step == PREFILL_STEP or \
            2 * plan.prefill_step * per_token(2 * plan.prefill_step) > plan.headroom // 2
        assert plan.prefill_step * per_token(plan.prefill_step) <= plan.headroom // 2
        steps.append(plan.prefill_step)
    assert steps[0] == PREFILL_STEP and steps == sorted(steps, reverse=True)
    assert steps[-1] == MIN_PREFILL_STEP < steps[2] < PREFILL_STEP
    # Without the sizes in the config, mlx-lm's step.
    assert plan_memory(manifest, StreamConfig(), 0, lambda: int(0.1e9)).prefill_step == \
        PREFILL_STEP

    before = mx.set_cache_limit(1 << 40)
    try:
        with mlx_streaming.load(stream_dir, slots_per_layer=4):
            assert mx.set_cache_limit(1 << 40) == 1 << 40  # a large machine: untouched
        with mlx_streaming.load(stream_dir, slots_per_layer=4, reserve_gb=1000) as (model, _):
            capped = mx.set_cache_limit(1 << 40)
            assert capped == model.streaming.plan.headroom // 4
            mx.set_cache_limit(capped)
        assert mx.set_cache_limit(1 << 40) == 1 << 40  # closing the model lifts the cap
    finally:
        mx.set_cache_limit(before)


def test_a_reserve_below_what_the_process_needs_is_raised_to_it(qwen):
    """reserve_gb 0 (or any reserve below the least prefill step's
    activations) keeps that much free all the same, and the buffer cache
    capped: in a 0.3 GB cgroup, --reserve-gb 0 gave the pools every byte
    available and the process was killed."""
    import mlx.core as mx

    from mlx_streaming.runtime.memory import plan_memory
    from mlx_streaming.runtime.prefill_step import MIN_PREFILL_STEP, bytes_per_token, room_for

    _, stream_dir = qwen
    manifest = read_manifest(stream_dir)
    model_config = json.loads((Path(stream_dir) / "config.json").read_text())
    model_config.update(hidden_size=1024, moe_intermediate_size=768, num_attention_heads=16)
    needed = room_for(MIN_PREFILL_STEP, bytes_per_token(model_config, manifest))
    available = lambda: int(0.3e9)  # noqa: E731
    for reserve in (0, needed / 2 / 1e9):
        plan = plan_memory(manifest, StreamConfig(reserve_gb=reserve), 0, available,
                           model_config=model_config)
        assert plan.headroom >= needed, reserve
        assert plan.total <= available() - needed
        assert plan.prefill_step == MIN_PREFILL_STEP

    before = mx.set_cache_limit(1 << 40)
    try:
        with mlx_streaming.load(stream_dir, slots_per_layer=4, reserve_gb=0) as (model, _):
            headroom = model.streaming.plan.headroom
            assert headroom > 0
            assert mx.set_cache_limit(1 << 40) == headroom // 4
    finally:
        mx.set_cache_limit(before)
