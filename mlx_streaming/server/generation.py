"""mlx-lm's generation thread, kept alive through a failure.

A streamed model can fail where a resident one does not (a damaged record,
a Hub that stops answering). mlx-lm's batch loop has no way to fail one
request: the exception ends its generation thread, and the server answers
nothing after. Here each request in flight gets the error, and the thread
starts its loop again for the requests that follow.
"""

import logging
import os
import threading

from ..errors import first_line
from ..mlx_lm_adapter import ResponseGenerator

log = logging.getLogger(__name__)


class _Tracked:
    """A request's response queue that knows when its answer has ended
    (``None``) or failed (an exception)."""

    def __init__(self, queue, open_set: set, lock: threading.Lock):
        self.queue, self.open, self.lock = queue, open_set, lock
        with lock:
            open_set.add(self)

    def put(self, item, *args, **kwargs):
        if item is None or isinstance(item, Exception):
            with self.lock:
                self.open.discard(self)
        return self.queue.put(item, *args, **kwargs)

    def __getattr__(self, name):  # get, get_nowait ... as the queue's
        return getattr(self.queue, name)


class ResilientResponseGenerator(ResponseGenerator):
    """mlx-lm's ``ResponseGenerator`` whose generation thread survives a
    failure of the model: the requests in flight get the error."""

    def __init__(self, *args, **kwargs):
        self._in_flight = set()  # before the thread starts
        self._in_flight_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def tokenize(self, tokenizer, request, args):
        """mlx-lm's, its failures (a chat template on fields it did not
        expect) turned into the request's error, a 400."""
        try:
            out = super().tokenize(tokenizer, request, args)
        except Exception as e:  # a template may raise anything
            raise ValueError("the chat template could not be applied to this request "
                             f"({type(e).__name__}: {first_line(e)})") from None
        if not len(out[0]):
            raise ValueError("the request makes an empty prompt")
        return out

    def next_request(self, timeout=None):
        request = super().next_request(timeout)
        if request is None:
            return None
        queue, *rest = request
        return (_Tracked(queue, self._in_flight, self._in_flight_lock), *rest)

    def generation_failed(self, error: Exception) -> None:
        if self.is_distributed:
            # Ranks decode in lockstep: one that goes on alone would
            # wait for the others forever, or meet them mid-pass.
            log.error("generation failed on rank %d: %s; every rank stops",
                      self.rank, " ".join(str(error).split()))
            os._exit(1)
        log.error("generation failed: %s; the requests in flight get the error, "
                  "the next ones are served", " ".join(str(error).split()))
        with self._in_flight_lock:
            failed, self._in_flight = list(self._in_flight), set()
        for queue in failed:
            queue.queue.put(error)
