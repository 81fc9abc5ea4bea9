"""The machines and models ``bench simulate --project`` projects: predict's
Mac profiles, and the shapes of large MoE models.
"""

from dataclasses import dataclass, field
from typing import Dict

from ...predict.machines import MACHINES
from ...predict.speed import BANDWIDTH_SHARE, CALL_S


@dataclass(frozen=True)
class Profile:
    """What the projection needs of a machine."""

    name: str
    ssd_gbps: float  # sustained random reads of expert-sized records
    ssd_latency_s: float  # added once per call that reads
    weight_gbps: float  # bandwidth the compute reaches on weights (decode)
    sync_s: float  # one host sync of a paged MoE call, with its bookkeeping
    miss_s: float = 0.0  # host work per missed record beyond the read (tables, checks)
    memory_gb: float = 0.0
    sources: Dict[str, str] = field(default_factory=dict)


# The Macs and the fitted costs of predict's speed model (predict/machines.py,
# predict/speed.py; docs/predict.md checks them against published runs), so
# that a projection and a forecast start from the same numbers.
MISS_S = 1e-5  # host work per missed record with the native step (an estimate)


def _profile(machine) -> Profile:
    return Profile(machine.name, machine.ssd_gbps, machine.ssd_latency_s,
                   BANDWIDTH_SHARE * machine.memory_gbps, CALL_S, MISS_S, machine.memory_gb,
                   dict(machine.sources, weight_gbps=f"{BANDWIDTH_SHARE} x memory_gbps "
                        "(fitted, docs/predict.md)", sync_s="fitted, docs/predict.md"))


PROFILES = {key: _profile(m) for key, m in MACHINES.items()}


@dataclass(frozen=True)
class ModelShape:
    """A MoE model's sizes at 4 bits (group 64: ~4.5 bits per weight)."""

    name: str
    moe_layers: int
    experts: int
    top_k: int
    expert_params: float
    dense_active_params: float  # per token: attention, shared experts, dense layers, head
    total_params: float

    @property
    def num_experts(self) -> int:  # as a layer's spec names it (budget.prefetch_width)
        return self.experts

    def expert_bytes(self) -> float:
        return self.expert_params * 4.5 / 8

    def spine_bytes(self) -> float:
        return (self.total_params - self.moe_layers * self.experts * self.expert_params) * 4.5 / 8


# From each model's config.json on the Hub (layers, experts, top-k, widths).
SHAPES = {
    "qwen3-30b-a3b": ModelShape("Qwen3-30B-A3B", 48, 128, 8, 3 * 2048 * 768, 1.6e9, 30.5e9),
    "qwen3-235b-a22b": ModelShape("Qwen3-235B-A22B", 94, 128, 8, 3 * 4096 * 1536, 7.8e9,
                                  235e9),
    "deepseek-v3": ModelShape("DeepSeek-V3 (671B)", 58, 256, 8, 3 * 7168 * 2048, 16.5e9, 671e9),
}
