"""What prefetch learns from the running model, over a channel of its own
(``stats`` only reports: nothing learns from the telemetry)."""

from typing import Callable, Sequence

import numpy as np

CallHook = Callable[[int, int], None]  # (layer, tokens)
RouteHook = Callable[[int, np.ndarray, np.ndarray], None]  # (layer, ids, distinct experts)
StallHook = Callable[[int, float], None]  # (layer, seconds the device waited)


class PrefetchControl:
    """Feeds prefetch's learners (the switch, the bandwidth, affinity, the
    calibration) from the paged calls and the stores that run them. The
    factory says which learner hears what."""

    def __init__(self, on_call: Sequence[CallHook] = (), on_route: Sequence[RouteHook] = (),
                 on_stall: Sequence[StallHook] = ()):
        self._call, self._route, self._stall = list(on_call), list(on_route), list(on_stall)

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
    """A layer that prefetches nothing."""

    def predict(self, x, tokens):
        return None

    def issue(self, predicted, ids) -> None:
        pass


class AlwaysOn:
    """The switch of ``prefetch="next-layer"``: no trial."""

    enabled = True
    decision = "on"
