"""The adaptive eviction policy on synthetic routing: where recency wins it
follows LRU, where frequency wins decayed LFU, and it turns within a few
dozen calls when the workload changes."""

import numpy as np
import pytest

from mlx_streaming.bench.cache import simulate
from mlx_streaming.runtime.policy import LRU, Adaptive, DecayedLFU, make_policy
from mlx_streaming.testing.helpers import EXPERTS, frequency_calls, recency_calls

SLOTS = 8


def follows(calls, policy: Adaptive) -> list:
    """Which arm ``policy`` followed after each call (True: LRU)."""
    out = []
    expert_of_slot = np.full(SLOTS, -1, dtype=np.int64)
    policy.bind(expert_of_slot)
    for experts in calls:
        policy.observe(experts, experts[None])
        out.append(policy.follows_lru)
    return out


@pytest.mark.parametrize("make_calls, winner", [(recency_calls, LRU), (frequency_calls, DecayedLFU)])
def test_adaptive_reaches_the_winning_arms_hit_rate(make_calls, winner):
    calls = make_calls(600)
    rates = {name: simulate(calls, SLOTS, make(EXPERTS)) for name, make in
             (("lru", LRU), ("lfu-decay", DecayedLFU), ("adaptive", Adaptive))}
    better = max(rates["lru"], rates["lfu-decay"])
    assert rates[winner.name if winner is LRU else "lfu-decay"] == better, rates
    assert rates["adaptive"] >= better - 0.01, rates
    assert abs(rates["lru"] - rates["lfu-decay"]) > 0.03, "the arms hardly differ: no test"


def test_adaptive_turns_after_a_phase_change():
    calls = recency_calls(300) + frequency_calls(300)
    arm = follows(calls, Adaptive(EXPERTS))
    assert all(arm[200:300]), "it did not follow LRU where recency wins"
    turned = arm.index(False, 300) - 300
    assert turned <= 48, f"it followed LRU {turned} calls into the frequency phase"
    assert not any(arm[400:]), "it did not stay with decayed LFU"
    back = follows(calls[300:] + recency_calls(300, seed=1), Adaptive(EXPERTS))
    assert arm[299] and back.index(True, 300) - 300 <= 48


def test_shadow_pools_stay_the_pools_size():
    policy = Adaptive(EXPERTS)
    follows(recency_calls(100) + frequency_calls(100), policy)
    assert policy.shadow.sum(axis=1).tolist() == [SLOTS, SLOTS]


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="unknown eviction policy 'lfru'.*adaptive, lru"):
        make_policy("lfru", EXPERTS)
    from mlx_streaming import StreamConfig
    from mlx_streaming.errors import ConfigError

    with pytest.raises(ConfigError, match="adaptive"):
        StreamConfig(policy="lfru")


def test_predicted_wraps_the_adaptive_policy():
    from mlx_streaming.runtime.policy import Predicted

    policy = Predicted(Adaptive(EXPERTS))
    held = np.arange(SLOTS, dtype=np.int64)
    policy.bind(held)
    follows([c for c in frequency_calls(50)], policy.inner)
    policy.hint(np.array([7]))  # slot 7 holds the predicted expert: kept
    assert 7 not in policy.victims(SLOTS - 1, protected=np.array([], dtype=np.int64)).tolist()


@pytest.mark.parametrize("kwargs", [dict(), dict(prefetch="next-layer"),
                                    dict(io="python")])
def test_adaptive_eviction_keeps_the_output_mlx_lms_at_a_quarter_pool(qwen, kwargs):
    from mlx_streaming.format import read_manifest
    from mlx_streaming.testing.helpers import check_matches_resident

    src, stream_dir = qwen
    slots = read_manifest(stream_dir).layers[0].num_experts // 4
    check_matches_resident(src, stream_dir, slots_per_layer=slots, policy="adaptive", **kwargs)
