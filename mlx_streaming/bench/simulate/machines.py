"""The machines and models ``bench simulate --project`` projects: published
figures of Apple Silicon Macs, and the shapes of large MoE models.
"""

from dataclasses import dataclass, field
from typing import Dict


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


# Published figures. Memory bandwidth: Apple's product pages; MLX decode on
# these machines reaches roughly 60-70% of it on 4-bit weights (an
# assumption we apply as weight_gbps = 0.65 x peak). SSD: sequential read
# speeds reported by reviews of each machine (Blackmagic/AmorphousDiskMark,
# ~4-7 GB/s); we take 4 MiB+ random reads at that rate. Sync: the cost of one
# command buffer commit-and-wait plus our bookkeeping, ~100 us, an estimate
# (this machine's CPU backend measures ~50-80 us; Metal adds the GPU round
# trip).
_APPLE_SOURCES = {
    "weight_gbps": "0.65 x Apple's published unified memory bandwidth (apple.com tech specs)",
    "ssd_gbps": "reviewers' disk-speed tests of the internal SSD (1-2 TB configurations)",
    "ssd_latency_s": "NVMe queue + first byte, ~100 us (assumption)",
    "sync_s": "Metal commit + wait + bookkeeping, ~100 us (assumption)",
    "miss_s": "host work per missed record with the native step, 10 us (assumption; "
              "this 2-core x86 VM measured 2.1-6.5 us on 16 KiB records in bench simulate "
              "--validate; an expert's first-read checksum is paid once, not per miss)",
}


PROFILES = {
    "m4-pro-48gb": Profile("MacBook Pro M4 Pro 48 GB", 5.0, 1e-4, 0.65 * 273, 1e-4, 1e-5, 48,
                           _APPLE_SOURCES),
    "m4-max-128gb": Profile("MacBook Pro M4 Max 128 GB", 6.0, 1e-4, 0.65 * 546, 1e-4, 1e-5, 128,
                            _APPLE_SOURCES),
    "m3-ultra-256gb": Profile("Mac Studio M3 Ultra 256 GB", 6.5, 1e-4, 0.65 * 819, 1e-4, 1e-5, 256,
                              _APPLE_SOURCES),
    "m2-air-24gb": Profile("MacBook Air M2 24 GB", 3.0, 1e-4, 0.65 * 100, 1e-4, 1e-5, 24,
                           _APPLE_SOURCES),
}


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
