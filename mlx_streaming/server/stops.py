"""Stop strings matched on the generated text, as OpenAI's ``stop`` means:
the answer ends before the first occurrence of any of them, wherever it
falls among the tokens. (mlx-lm matches them as token sequences and cuts
every occurrence out of the text, so the server gives it none.)
"""

import dataclasses
from typing import Iterator, Optional


class StopText:
    """The text of an answer, fed in pieces, released up to a stop string
    (``stopped`` then names it); a tail that may begin one is held back
    until the next piece decides."""

    def __init__(self, stops: list):
        self.stops = [s for s in stops if s]
        self.seen = ""
        self.released = 0  # characters of ``seen`` given out
        self.stopped: Optional[str] = None

    def feed(self, text: str) -> str:
        """The text that may go out after ``text``."""
        start = max(0, self.released - max(map(len, self.stops), default=0))
        self.seen += text
        # The first stop string to be complete, as if the text came a character
        # at a time (however it is cut into tokens); of two, the longer.
        matches = [(at + len(s), at, s) for s in self.stops
                   if (at := self.seen.find(s, start)) >= 0]
        if matches:
            _, at, self.stopped = min(matches)
            return self._release(at)
        return self._release(self._held_from())

    def rest(self) -> str:
        """What is held back, once no more text comes."""
        return self._release(len(self.seen))

    def _held_from(self) -> int:
        """Where the longest tail of the text that begins a stop string starts."""
        for at in range(max(self.released, len(self.seen) - max(map(len, self.stops)) + 1),
                        len(self.seen)):
            tail = self.seen[at:]
            if any(s.startswith(tail) for s in self.stops):
                return at
        return len(self.seen)

    def _release(self, end: int) -> str:
        out, self.released = self.seen[self.released:end], end
        return out


def stop_at(responses: Iterator, stops: list, on_stop=lambda stop: None) -> Iterator:
    """mlx-lm's generated ``Response``s, their text ending before the first
    stop string (``on_stop`` is told which); the generation then ends with
    OpenAI's finish reason ``stop``. An item whose text a stop string may
    begin waits for the next one, so that an answer ending there (an end of
    text, whose own text mlx-lm drops) gets it back."""
    if not stops:
        yield from responses
        return
    text, waiting = StopText(stops), None
    try:
        for item in responses:
            if item.finish_reason == "stop":  # the end of text: nothing held is a stop
                if waiting is not None:
                    yield dataclasses.replace(waiting, text=waiting.text + text.rest())
                yield item
                return
            released = text.feed(item.text)
            if text.stopped is not None:
                if waiting is not None:
                    yield waiting
                # A finish reason of None: mlx-lm keeps this item's text and ends "stop".
                yield dataclasses.replace(item, text=released, finish_reason=None)
                on_stop(text.stopped)
                return
            if item.finish_reason is not None:
                released += text.rest()
            item = dataclasses.replace(item, text=released)
            if waiting is not None:
                yield waiting
                waiting = None
            if text.released < len(text.seen):
                waiting = item
            else:
                yield item
        if waiting is not None:
            yield dataclasses.replace(waiting, text=waiting.text + text.rest())
    finally:
        close = getattr(responses, "close", None)
        if close is not None:
            close()
