"""``prefetch="auto"``: a trial decides whether prefetch pays."""

import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TrialPlan:
    """How ``prefetch="auto"`` times prefetch against no prefetch, field by
    field as docs/prefetch.md's "Auto" tells it."""

    tokens: int = 64
    block: int = 16
    settle: int = 4
    warmup: int = 8
    min_stall_share: float = 0.05
    margin: float = 0.02
    early: float = 0.1
    stop_after: int = 4

    def __post_init__(self):
        # Each block must be timed; the first token has no start, so it is warmup.
        if (self.tokens < 2 * self.block or self.warmup < 1
                or not 0 <= self.settle < self.block or self.stop_after < 1):
            raise ValueError(
                f"a trial of {self.tokens} tokens needs two blocks of {self.block} or more, "
                f"a warmup of one token or more (got {self.warmup}), fewer settling tokens "
                f"than a block (got {self.settle}) and a stop after one timed token or more "
                f"(got {self.stop_after})")


class PrefetchTrial:
    """``prefetch="auto"``: decides from a ``TrialPlan`` whether prefetch pays."""

    def __init__(self, first_layer: int, max_tokens: int, plan: TrialPlan = TrialPlan(),
                 clock=time.perf_counter):
        self.first_layer = first_layer
        self.max_tokens = max_tokens
        self.trial_tokens = plan.tokens
        self.block = plan.block
        self.settle = plan.settle
        self.warmup = plan.warmup
        self.min_stall_share = plan.min_stall_share
        self.margin = plan.margin
        self.early = plan.early
        self.stop_after = plan.stop_after
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
            # A prefill (a new request): the next token is timed from its own start.
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
        if trial_step >= self.trial_tokens or self._clear(trial_step, timed):
            self._decide()
        elif trial_step >= 0:
            self.enabled = (trial_step // self.block) % 2 == 1

    def on_stall(self, layer, seconds):
        self._stall += seconds

    def _clear(self, trial_step: int, timed: bool) -> bool:
        """Whether the trial already decides: halfway, by ``early`` or more; or
        at ``stop_after`` timed tokens with prefetch, at ``1 - early`` or less."""
        if not all(self._tokens.values()):
            return False
        speedup = self._speedup()
        if timed and self.enabled and len(self._tokens[True]) == self.stop_after \
                and speedup <= 1 - self.early:
            return True
        return trial_step == self.trial_tokens // 2 and abs(speedup - 1) >= self.early

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
