"""The Macs predict knows: memory, memory bandwidth and SSD read rate, each
with where the number comes from. A number nobody has measured on that
machine says it is an estimate, and from what.
"""

from dataclasses import dataclass, field
from typing import Dict

from ..errors import ConfigError

GB = 1e9
# macOS lets the GPU wire about three quarters of memory by default
# (``iogpu.wired_limit_mb``): the memory a model may use.
GPU_SHARE = 0.75
# An NVMe read's fixed cost (queueing, first byte) beside its transfer: an
# estimate, as no Mac's has been published; it matters for 1 MB records.
SSD_LATENCY_S = 100e-6

APPLE_SPECS = "https://www.apple.com/mac/compare/ (unified memory bandwidth)"
VERGE_M5_MAX = ("https://www.theverge.com/ (16-inch M5 Max MacBook Pro review, 2026: "
                "4 TB SSD sustained 13.6 GB/s read, 86% faster than the M4 Max's)")


@dataclass(frozen=True)
class Machine:
    """What the speed model and the memory plan need of a Mac."""

    name: str
    memory_gb: float
    memory_gbps: float  # peak unified memory bandwidth
    ssd_gbps: float  # sustained read of large records at a deep queue
    sources: Dict[str, str] = field(default_factory=dict)
    ssd_latency_s: float = SSD_LATENCY_S

    def ssd_rate(self, record_bytes: float, queue_depth: int) -> float:
        """Bytes per second reading ``record_bytes`` records with
        ``queue_depth`` in flight: each read's latency is hidden behind
        the others' transfers as the queue deepens."""
        peak = self.ssd_gbps * GB
        inflight = queue_depth * record_bytes
        return peak * inflight / (inflight + peak * self.ssd_latency_s)

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_gb * GPU_SHARE * GB)


def _estimate(what: str) -> str:
    return f"ESTIMATE: {what}; no measurement of this configuration was found"


MACHINES = {
    "m1-pro-32gb": Machine("MacBook Pro M1 Pro 32 GB", 32, 200, 5.0, {
        "memory_gbps": APPLE_SPECS,
        "ssd_gbps": _estimate("reviewers' disk tests of 1 TB M1 Pro MacBook Pros read "
                              "about 5 GB/s sequentially")}),
    "m2-air-24gb": Machine("MacBook Air M2 24 GB", 24, 100, 2.9, {
        "memory_gbps": APPLE_SPECS,
        "ssd_gbps": _estimate("reviewers' disk tests of 512 GB+ M2 Airs read about 2.9 GB/s "
                              "(the 256 GB model, one NAND chip, about half)")}),
    "m4-air-32gb": Machine("MacBook Air M4 32 GB", 32, 120, 3.0, {
        "memory_gbps": APPLE_SPECS,
        "ssd_gbps": _estimate("taken as the M2 Air's: reviewers report M4 Air reads of "
                              "about 3 GB/s on 512 GB+")}),
    "m4-pro-48gb": Machine("MacBook Pro M4 Pro 48 GB", 48, 273, 6.0, {
        "memory_gbps": APPLE_SPECS,
        "ssd_gbps": _estimate("reviewers' disk tests of 1 TB+ M4 Pro MacBook Pros read "
                              "6-7 GB/s sequentially; the lower end taken")}),
    "m4-max-128gb": Machine("MacBook Pro M4 Max 128 GB", 128, 546, 7.3, {
        "memory_gbps": APPLE_SPECS,
        "ssd_gbps": "derived: " + VERGE_M5_MAX + " -> 13.6 / 1.86 = 7.3 GB/s (4 TB)"}),
    "m5-max-128gb": Machine("MacBook Pro M5 Max 128 GB", 128, 614, 13.6, {
        "memory_gbps": APPLE_SPECS + "; 614 GB/s for the 40-core-GPU M5 Max",
        "ssd_gbps": "measured: " + VERGE_M5_MAX}),
    "m3-ultra-256gb": Machine("Mac Studio M3 Ultra 256 GB", 256, 819, 6.5, {
        "memory_gbps": APPLE_SPECS,
        "ssd_gbps": _estimate("reviewers' disk tests of 1 TB+ M3 Ultra Mac Studios read "
                              "6-7 GB/s sequentially")}),
}


def machine(name: str) -> Machine:
    """The profile called ``name``.

    Raises:
        ConfigError: no such profile; the message lists them.
    """
    if name not in MACHINES:
        raise ConfigError(f"unknown machine {name!r}; known: {', '.join(MACHINES)} "
                          "(or --here to measure this one)")
    return MACHINES[name]
