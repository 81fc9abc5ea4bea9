"""What the request handlers share: the served model, admission, the memo
and the record of recent requests.
"""

import collections
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from ..errors import StreamingError
from .admission import Admission, current_request
from .memo import Memo
from .stops import stop_at

RECENT_REQUESTS = 32


# /v1/stats waits this long for the forward pass in flight to end.
STATS_WAIT_S = 1.0


class Service:
    """What the handlers share: the served model's identity, admission,
    the memo and the record of recent requests."""

    def __init__(self, provider, max_queue: int, memo_mb: float, running: int = 1,
                 max_context: Optional[int] = None, approximate: str = ""):
        self.provider = provider
        self.path = str(provider.cli_args.model)
        self.model_id = Path(self.path).name
        self.admission = Admission(max_queue, running)
        self.max_context = max_context  # tokens a sequence may reach (--max-context)
        self.memo = Memo(int(memo_mb * 1e6)) if memo_mb > 0 else None
        self.recent = collections.deque(maxlen=RECENT_REQUESTS)
        self.lock = threading.Lock()
        self._longest_token = None
        # What makes the answers approximate ("": none), said in each response.
        self.approximate = approximate
        self._answering = 0  # requests whose handler is still answering

    @contextmanager
    def answering(self):
        """Around one request's handling, whatever its API."""
        with self.lock:
            self._answering += 1
        try:
            yield
        finally:
            with self.lock:
                self._answering -= 1

    def finish_answering(self) -> None:
        """After Ctrl-C stopped the listening: let the requests in flight
        finish (said so); a second Ctrl-C stops at once."""
        with self.lock:
            n = self._answering
        if not n:
            return
        print(f"[mlx_streaming] stopping: finishing {n} request{'s' * (n > 1)} in flight "
              "first (Ctrl-C again to stop now)", file=sys.stderr, flush=True)
        try:
            while True:
                with self.lock:
                    if not self._answering:
                        return
                time.sleep(0.05)
        except KeyboardInterrupt:
            print("[mlx_streaming] stopped", file=sys.stderr, flush=True)

    def known_model(self, name) -> bool:
        return name in ("default_model", self.model_id, self.path)

    def context_length(self) -> Optional[int]:
        """Tokens a sequence may reach: the model's context, or less
        (``--max-context``, which the memory plan kept room for)."""
        args = getattr(self.provider.model, "args", None)
        model = getattr(args, "max_position_embeddings", None)
        limits = [n for n in (model, self.max_context) if n is not None]
        return min(limits) if limits else None

    def longest_token_chars(self) -> Optional[int]:
        """The most characters of text one token stands for, or None where
        the tokenizer does not list its vocabulary: a token's vocabulary
        entry is at least that long (a byte-level token holds one character
        per byte of text; a byte-fallback one, ``<0xE2>``, one byte)."""
        if self._longest_token is None:
            try:
                vocab = self.provider.tokenizer.get_vocab()
                self._longest_token = max(map(len, vocab), default=0) or False
            except Exception:
                self._longest_token = False  # asked once
        return self._longest_token or None

    def record(self, tokens: int, seconds: float, first_token_s: Optional[float]) -> None:
        with self.lock:
            self.recent.append(dict(tokens=tokens, seconds=seconds, ttft_s=first_token_s))

    def stats(self) -> dict:
        from ..runtime.stats import stats

        with self.lock:
            recent = list(self.recent)
        tokens = sum(r["tokens"] for r in recent)
        seconds = sum(r["seconds"] for r in recent)
        # A long pass (a prefill, a slow remote read) must not hold a poller.
        model = self.provider.model
        report = stats(model, wait=STATS_WAIT_S) if model is not None else {}
        return dict(
            model=self.model_id,
            streaming=report,
            recent_requests=len(recent),
            recent_tokens_per_s=tokens / seconds if seconds else None,
            memo=None if self.memo is None else dict(
                entries=len(self.memo.entries), bytes=self.memo.nbytes, hits=self.memo.hits),
            queue=dict(active=self.admission.active, limit=self.admission.limit),
        )


def counting(service: Service, generate):
    """Wrap ``ResponseGenerator.generate`` to end each answer at its stop
    strings (``current_request.stops``), record its tokens, time to first
    token and duration, and give back the request's admission when its
    last token is out."""

    def wrapped(request, args, progress_callback=None):
        start = time.perf_counter()
        ticket = current_request.ticket
        current_request.failure = None
        try:
            ctx, response = generate(request, args, progress_callback)
            current_request.generation = ctx
        except (StreamingError, RuntimeError) as e:
            # mlx-lm answers any failure here with a 404; these are ours
            # (a read error, a dead generation thread), not the request's.
            current_request.failure = e
            raise

        def stopped(stop):
            current_request.stopped_by = stop

        def tokens():
            ids, first = [], None
            try:
                for item in stop_at(response, current_request.stops, stopped):
                    if first is None:
                        current_request.first_token_at = time.perf_counter()
                        first = current_request.first_token_at - start
                    ids.append(item.token)
                    yield item
            finally:
                if ticket is not None:
                    ticket.release()
                n = current_request.tokens = len(ids)
                service.record(n, time.perf_counter() - start, first)

        return ctx, tokens()

    return wrapped
