"""Memory pressure: shrink the expert pools when other programs need the
memory, grow them back when it returns, instead of being killed.

Between two calls of the model (nothing then reads a pool), every
``CHECK_EVERY`` calls the watch reads the memory the OS says is available
(``system.available_memory_bytes``: MemAvailable, or what the memory
cgroup has left). Below ``pressure_gb`` it drops as many slots per layer as
free the shortfall, down to one call's minimum, keeping the experts the
eviction policy values most. Once available memory is back above the
threshold with room for more, it grows the pools again, half the room at a
time, up to the size chosen at load. The output never changes: a smaller
pool only misses more.
"""

import logging
import math

from ..system import available_memory_bytes
from .memory import GB

log = logging.getLogger(__name__)

CHECK_EVERY = 8  # model calls; reading /proc/meminfo costs ~50 us


class NoWatch:
    def between_calls(self) -> None:
        pass

    def cap(self, slots: int) -> None:
        pass

    def report(self):
        return None


class PressureWatch:
    """Resizes ``runtime``'s pools from available memory."""

    def __init__(self, runtime, threshold_bytes: int, per_slot: int, min_slots: int,
                 available=available_memory_bytes, every: int = CHECK_EVERY):
        self.runtime = runtime
        self.threshold = threshold_bytes
        self.per_slot = per_slot
        self.min_slots = min_slots
        self.max_slots = runtime.slots  # what load chose; never grown beyond
        self.available = available
        self.every = every
        self.calls = 0
        self.shrinks = self.grows = 0
        self.lowest = None

    def between_calls(self) -> None:
        self.calls += 1
        if self.calls % self.every:
            return
        available = self.available()
        self.lowest = available if self.lowest is None else min(self.lowest, available)
        slots = self.runtime.slots
        if available < self.threshold and slots > self.min_slots:
            short = math.ceil((self.threshold - available) / self.per_slot)
            target = max(self.min_slots, slots - short)
            log.warning("available memory %.3g GB is below %.3g GB: expert pools shrink "
                        "from %d to %d slots per layer", available / GB, self.threshold / GB,
                        slots, target)
            self.runtime.resize(target)
            self.shrinks += 1
        elif slots < self.max_slots:
            # Half the room above the threshold, so that a second program
            # growing too does not push us straight back under.
            room = (available - self.threshold) // 2
            target = min(self.max_slots, slots + int(room // self.per_slot))
            if target > slots:
                self.runtime.resize(target)
                self.grows += 1

    def cap(self, slots: int) -> None:
        """Grow the pools back no further than ``slots``."""
        self.max_slots = min(self.max_slots, slots)

    def report(self) -> dict:
        return dict(threshold_gb=self.threshold / GB, shrinks=self.shrinks, grows=self.grows,
                    slots_at_load=self.max_slots,
                    lowest_available_gb=None if self.lowest is None else self.lowest / GB)
