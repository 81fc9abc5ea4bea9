"""``--memo-mb``: greedy responses kept whole, in a bounded LRU.
"""

import collections
import re
import threading
import time
import uuid
from typing import Optional

# Marks a response answered from the memo (hit) or recorded into it (miss).
MEMO_HEADER = "X-MLX-Streaming-Memo"


class Memo:
    """A bounded LRU of whole HTTP responses (status line, headers, body)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: "collections.OrderedDict[str, bytes]" = collections.OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.lock = threading.Lock()

    def get(self, key: str) -> Optional[bytes]:
        with self.lock:
            data = self.entries.get(key)
            if data is not None:
                self.entries.move_to_end(key)
                self.hits += 1
            return data

    def put(self, key: str, data: bytes) -> None:
        size = len(key.encode()) + len(data)
        if size > self.max_bytes:
            return
        with self.lock:
            if key in self.entries:
                self.nbytes -= self._size(key, self.entries.pop(key))
            self.entries[key] = data
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                self.nbytes -= self._size(*self.entries.popitem(last=False))

    @staticmethod
    def _size(key: str, data: bytes) -> int:
        return len(key.encode()) + len(data)


# A response's id and its tool calls' ids: new ones in each answer.
_ID = re.compile(rb'"id": "((?:chat)?cmpl-)?([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-'
                 rb'[0-9a-f]{4}-[0-9a-f]{12})"')


_CREATED = re.compile(rb'"created": \d{10}\b')


def fresh(data: bytes) -> bytes:
    """A memoised response as a new one: its own id, tool-call ids and
    creation time (as long as the old ones, so Content-Length holds); an id
    repeated in a stream's chunks is replaced by the same new one."""
    new: dict = {}

    def renamed(m):
        uid = new.setdefault(m.group(2), str(uuid.uuid4()).encode())
        return b'"id": "' + (m.group(1) or b"") + uid + b'"'

    data = _ID.sub(renamed, data)
    now = str(int(time.time())).encode()
    return _CREATED.sub(b'"created": ' + now, data) if len(now) == 10 else data


def without_request_headers(data: bytes) -> bytes:
    """A response to store: without the headers that belong to one request
    (the memo marker, CORS for its origin, its date)."""
    head, sep, body = data.partition(b"\r\n\r\n")
    skip = (MEMO_HEADER.lower().encode(), b"access-control-", b"vary:", b"date:")
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(skip)]
    return b"\r\n".join(lines) + sep + body
