"""Admission: at most ``--decode-concurrency`` running requests (one without
batching) and ``--max-queue`` waiting ones; the rest get HTTP 429.
"""

import threading
from typing import Optional


class Admission:
    """At most ``running`` requests at once and ``max_queue`` waiting ones."""

    def __init__(self, max_queue: int, running: int = 1):
        self.limit = running + max_queue
        self.active = 0
        self.lock = threading.Lock()

    def enter(self) -> Optional["Ticket"]:
        """A place for one request, or None when all are taken."""
        with self.lock:
            if self.active >= self.limit:
                return None
            self.active += 1
        return Ticket(self)


class Ticket:
    """One admitted request's place. It is given back before the answer's
    last bytes go out (when the request's last token is generated, or as an
    error reply is written): a client that has its whole answer and asks
    again must find the place free (released after the write, it raced the
    next request into a 429 with ``--max-queue 0``). Releasing twice gives
    it back once."""

    def __init__(self, admission: Admission):
        self.admission = admission
        self.held = True

    def release(self) -> None:
        with self.admission.lock:
            if self.held:
                self.held = False
                self.admission.active -= 1


class _Request(threading.local):
    """Per handler thread: the admitted request's ticket, and the
    server-side failure behind mlx-lm's error reply."""

    ticket: Optional[Ticket] = None
    failure: Optional[Exception] = None
    tokens: int = 0  # generated for the request (its log line)
    first_token_at: Optional[float] = None  # perf_counter() as its first token came
    generation: object = None  # mlx-lm's GenerationContext of the request, once known
    stops: tuple = ()  # the request's stop strings, matched on its text (stops.py)
    stopped_by: Optional[str] = None  # the stop string that ended the answer
    status: Optional[int] = None  # the status an error reply was rewritten to


current_request = _Request()


def release_admission() -> None:
    """Give back this thread's request's place before its answer's last
    bytes go out (see ``Ticket``); an error reply is all of its answer."""
    if current_request.ticket is not None:
        current_request.ticket.release()
