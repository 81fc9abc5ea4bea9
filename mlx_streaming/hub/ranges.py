"""HTTP range requests for expert records: retried with backoff, bounded
in time, checked against what was asked.
"""

import logging
import threading
import time
from typing import Optional
from urllib.parse import urlparse

from ..errors import ExpertReadError, first_line

log = logging.getLogger(__name__)


# One request never asks for more than this many bytes: a long run of
# adjacent misses becomes several requests, which run in parallel.
MAX_REQUEST_BYTES = 64 << 20


RETRY_STATUS = (429, 500, 502, 503, 504)


# A server's Retry-After is honoured up to this many seconds.
MAX_RETRY_AFTER = 60.0


# A try fails when its body arrives slower than this (after fetch_timeout).
MIN_RATE = 256e3


class ExpertFetchError(ExpertReadError):
    """Fetching expert records over HTTP failed."""


class RangeFetcher:
    """Byte ranges of URLs, with retries, backoff and a timeout on every
    network wait. The session, headers and token are huggingface_hub's."""

    def __init__(self, headers: dict, timeout: float, retries: int, backoff: float = 0.5):
        import httpx2

        self.httpx = httpx2
        self.headers = dict(headers)
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.requests = 0
        self.bytes = 0
        self._warned_full = False
        self._lock = threading.Lock()
        # Set when the model closes: fetches stop retrying and waiting.
        self.cancelled = threading.Event()

    def fetch(self, url: str, start: int, nbytes: int) -> bytearray:
        """Bytes ``[start, start + nbytes)`` of ``url``.

        Raises:
            ExpertFetchError: no complete answer after ``retries`` retries,
                or an answer that retrying cannot change (401, 404, ...).
        """
        last, wait = None, 0.0
        for attempt in range(self.retries + 1):
            if attempt and self.cancelled.wait(max(wait, self.backoff * 2 ** (attempt - 1))):
                break
            if self.cancelled.is_set():
                break
            try:
                data = self._once(url, start, nbytes)
            except _Retry as e:
                last, wait = str(e), min(MAX_RETRY_AFTER, e.after)
                log.warning("range %d+%d of %s: %s (try %d of %d)", start, nbytes, url,
                            last, attempt + 1, self.retries + 1)
                continue
            with self._lock:
                self.requests += 1
                self.bytes += nbytes
            return data
        if self.cancelled.is_set():
            raise ExpertFetchError("the model was closed while an expert was being fetched")
        host = urlparse(url).netloc
        raise ExpertFetchError(
            f"could not fetch bytes {start}-{start + nbytes - 1} of {url} after "
            f"{self.retries + 1} tries (last: {last}); check the network and {host}, or raise "
            "fetch_timeout / fetch_retries"
        )

    def _once(self, url: str, start: int, nbytes: int) -> bytearray:
        from huggingface_hub.utils import get_session, hf_raise_for_status

        headers = {**self.headers, "Range": f"bytes={start}-{start + nbytes - 1}",
                   "Accept-Encoding": "identity"}
        try:
            with get_session().stream("GET", url, headers=headers, timeout=self.timeout,
                                      follow_redirects=True) as r:
                if r.status_code in RETRY_STATUS:
                    after = _retry_after(r.headers.get("Retry-After"))
                    what = "rate limited" if r.status_code == 429 else "server error"
                    raise _Retry(f"HTTP {r.status_code} ({what}"
                                 + (f", retry after {after:g} s)" if after else ")"), after)
                if r.status_code not in (200, 206):
                    r.read()
                    try:
                        hf_raise_for_status(r)
                    except Exception as e:
                        raise ExpertFetchError(
                            f"{url} answered HTTP {r.status_code} ({first_line(e)}); "
                            f"{_status_hint(r.status_code)}") from None
                    raise ExpertFetchError(f"{url} answered HTTP {r.status_code}")
                skip = 0
                if r.status_code == 200:
                    skip = start
                    self._warn_full(url)
                else:
                    _check_content_range(r.headers.get("Content-Range"), start, nbytes)
                return self._body(r, skip, nbytes, self._deadline(skip + nbytes))
        except self.httpx.TimeoutException:
            raise _Retry(f"no answer within {self.timeout:g} s") from None
        except self.httpx.TransportError as e:
            raise _Retry(f"{type(e).__name__}: {first_line(e)}") from None

    def _deadline(self, nbytes: int) -> float:
        """When a try that reads ``nbytes`` gives up: a server that trickles
        bytes never lets a read time out, so the whole body has a deadline."""
        return time.monotonic() + self.timeout + nbytes / MIN_RATE

    def _body(self, r, skip: int, nbytes: int, deadline: float) -> bytearray:
        """``nbytes`` of the body after its first ``skip`` bytes."""
        out = bytearray(nbytes)
        pos = -skip
        for chunk in r.iter_raw():
            if time.monotonic() > deadline or self.cancelled.is_set():
                raise _Retry(f"slower than {MIN_RATE / 1e3:g} KB/s after the first "
                             f"{self.timeout:g} s")
            lo = max(0, -pos)
            if lo < len(chunk):
                take = chunk[lo : lo + nbytes - max(pos, 0)]
                out[max(pos, 0) : max(pos, 0) + len(take)] = take
            pos += len(chunk)
            if pos >= nbytes:
                return out
        raise _Retry(f"the answer ended after {max(pos, 0)} of {nbytes} bytes")

    def _warn_full(self, url: str) -> None:
        if not self._warned_full:
            self._warned_full = True
            log.warning(
                "%s ignores HTTP Range requests (it answered 200 with the whole file): "
                "each expert read downloads the blob up to that expert; serve the repo from "
                "a server with Range support", url)


class _Retry(Exception):
    """A failure that another try may not have (``after``: seconds the
    server asked to wait)."""

    def __init__(self, what: str, after: float = 0.0):
        super().__init__(what)
        self.after = after


def _retry_after(header: Optional[str]) -> float:
    try:
        return max(0.0, float(header)) if header else 0.0
    except ValueError:
        return 0.0  # an HTTP date: fall back to our own backoff


def _status_hint(status: int) -> str:
    if status in (401, 403):
        return ("the repo is private or gated: log in with `hf auth login` or set HF_TOKEN, "
                "and accept its terms on the Hub")
    if status == 404:
        return "the repo or revision has no such file; check the repo id and revision"
    if status == 416:
        return "the blob on the server is shorter than the manifest says; re-upload it"
    return "check the repo and the server"


def _check_content_range(header: Optional[str], start: int, nbytes: int) -> None:
    want = f"bytes {start}-{start + nbytes - 1}/"
    if header is None or not header.startswith(want):
        raise _Retry(f"the server answered range {header!r}, not {want}*")
