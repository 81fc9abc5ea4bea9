"""Memory pressure: pools shrink between calls when available memory falls
below ``pressure_gb`` and grow back when it returns; the output stays exact."""

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_streaming
from mlx_streaming.runtime.runtime import PressureWatch
from mlx_streaming.runtime.stats import stats
from mlx_streaming.testing.helpers import PROMPT, assert_same_logits, logits_trace

CGROUP = Path("/sys/fs/cgroup/memory")


@pytest.mark.parametrize("spine", [None, 0], ids=["spine-resident", "spine-streamed"])
def test_pools_shrink_and_grow_with_available_memory_and_stay_exact(qwen, spine):
    src, stream = qwen
    reference, _ = mlx_lm.load(str(src))
    want = logits_trace(reference)
    # of 16 experts; the spine's layers resident or all streamed
    model, _ = mlx_streaming.load(stream, slots_per_layer=12, pinned_layers=spine)
    runtime = model.streaming
    free = {"bytes": 10 << 30}
    per_slot = runtime.pressure.per_slot
    runtime.pressure = PressureWatch(runtime, threshold_bytes=1 << 30, per_slot=per_slot,
                                     min_slots=4, available=lambda: free["bytes"], every=1)
    sizes = []
    cache = make_prompt_cache(model)
    got = [model(mx.array([PROMPT]), cache=cache)[:, -1]]
    for step in range(32):
        if step == 8:  # another program takes memory: 10 slots' worth short
            free["bytes"] = (1 << 30) - 10 * per_slot
        if step == 20:  # and gives it back
            free["bytes"] = 10 << 30
        token = mx.argmax(got[-1], axis=-1, keepdims=True)
        got.append(model(token, cache=cache)[:, -1])
        mx.eval(got[-1])
        sizes.append(runtime.slots)
    assert_same_logits(want, got)
    assert max(sizes[:8]) == 12 and min(sizes) == 4 and sizes[-1] == 12
    assert all(s.pool.slots == runtime.slots for s in runtime.stores)
    report = stats(model)["pressure"]
    assert report["shrinks"] >= 1 and report["grows"] >= 1


def test_pressure_off_and_fully_resident_models_never_resize(qwen):
    with mlx_streaming.load(qwen[1], slots_per_layer=12, pressure_gb=0) as (model, _):
        assert stats(model)["pressure"] is None
    model, _ = mlx_streaming.load(qwen[1])  # every expert fits: nothing pages
    assert stats(model)["pressure"] is None


SCRIPT = """
import sys
import mlx.core as mx
import mlx_streaming
from mlx_lm.models.cache import make_prompt_cache
from mlx_streaming.runtime.stats import stats
from mlx_streaming.testing.helpers import PROMPT

model, _ = mlx_streaming.load(sys.argv[1], slots_per_layer=12, pressure_gb=2.0)
cache = make_prompt_cache(model)
logits = model(mx.array([PROMPT]), cache=cache)[:, -1]
tokens = []
for phase in range(3):
    for _ in range(16):
        token = mx.argmax(logits, axis=-1, keepdims=True)
        tokens.append(token.item())
        logits = model(token, cache=cache)[:, -1]
    print("slots", model.streaming.slots, flush=True)
    if phase < 2:
        sys.stdin.readline()  # the test changes the memory limit
print("tokens", *tokens, flush=True)
"""


@pytest.mark.skipif(not (CGROUP.exists() and os.access(CGROUP, os.W_OK)),
                    reason="needs a writable cgroup v1 memory controller (root on Linux)")
def test_lowering_a_cgroup_limit_mid_run_shrinks_the_pools(qwen, tmp_path):
    src, stream = qwen
    group = CGROUP / f"mlxs_pressure_{os.getpid()}"
    group.mkdir()
    limit = group / "memory.limit_in_bytes"
    try:
        limit.write_text(str(8 << 30))
        proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(stream)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
        first = proc.stdout.readline().split()
        usage = int((group / "memory.usage_in_bytes").read_text())
        # Other programs take all but 50 MB: available falls below pressure_gb.
        limit.write_text(str(usage + (50 << 20)))
        proc.stdin.write("\n")
        proc.stdin.flush()
        second = proc.stdout.readline().split()
        limit.write_text(str(8 << 30))  # they give it back
        proc.stdin.write("\n")
        proc.stdin.flush()
        third = proc.stdout.readline().split()
        tokens = [int(t) for t in proc.stdout.readline().split()[1:]]
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        group.rmdir()
    assert int(first[1]) == 12 and int(second[1]) < 12 and int(third[1]) == 12
    reference, _ = mlx_lm.load(str(src))
    cache = make_prompt_cache(reference)
    logits = reference(mx.array([PROMPT]), cache=cache)[:, -1]
    want = []
    for _ in range(48):
        token = mx.argmax(logits, axis=-1, keepdims=True)
        want.append(token.item())
        logits = reference(token, cache=cache)[:, -1]
    assert tokens == want


def test_the_default_budget_is_what_the_os_says_is_available(qwen):
    from mlx_streaming.errors import BudgetError
    from mlx_streaming.format import read_manifest
    from mlx_streaming.runtime import memory as budget

    manifest = read_manifest(qwen[1])
    per_slot = budget.bytes_per_slot(manifest)
    config = mlx_streaming.StreamConfig(reserve_gb=0)
    dense = sum(d.nbytes for d in manifest.dense)
    plan = budget.plan_memory(manifest, config, 0, available=lambda: dense + 6 * per_slot)
    assert plan.slots == 6 and plan.streamed == ()
    with pytest.raises(BudgetError, match="available memory"):
        budget.plan_memory(manifest, config, 0, available=lambda: 2 * per_slot)


def test_a_shrink_warning_starts_its_own_line_in_generate(qwen, monkeypatch, capsys):
    """The warning goes to standard error from a line start, not into the
    middle of the text streaming to standard output."""
    from mlx_streaming import generate
    from mlx_streaming.runtime import loader

    calls = {"n": 0}

    def available():
        calls["n"] += 1
        return 10 << 30 if calls["n"] < 8 else 0  # short once decoding is under way

    class Watch(PressureWatch):
        def __init__(self, runtime, threshold, per_slot, min_slots):
            super().__init__(runtime, 1 << 30, per_slot, min_slots, available=available,
                             every=1)

    monkeypatch.setattr(loader, "PressureWatch", Watch)
    assert generate.main(["--model", str(qwen[1]), "--prompt", "def f(x):", "--max-tokens",
                          "24", "--slots-per-layer", "12"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()  # text was streaming
    lines = err.splitlines()
    warned = [i for i, line in enumerate(lines) if "pools shrink" in line]
    assert warned and all(lines[i].startswith("[mlx_streaming] WARNING: available memory")
                          for i in warned)
    assert "\n[mlx_streaming] WARNING: available memory" in err
