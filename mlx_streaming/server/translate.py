"""The Ollama and Anthropic APIs on the OpenAI one: their requests become
an OpenAI chat request the handler serves (one queue, one memory plan),
and the OpenAI answer it writes is rewritten, as it goes out, into the
API asked for by a ``Renderer`` of that API.
"""

import json
from typing import Optional


class Wrapped:
    """A handler's output stream wrapped: flushing and closing go to the
    stream underneath (``out``)."""

    out = None

    def flush(self):
        return self.out.flush()

    @property
    def closed(self):
        return self.out.closed

    def close(self):
        return self.out.close()


class RequestError(ValueError):
    """A request the API refuses: its status, and the field at fault."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class Renderer:
    """One API's answer, made from the OpenAI one; subclasses override."""

    stream_type = "text/event-stream"
    prompt_tokens = 0  # the prompt's length, once the handler counted it
    cached_tokens = 0  # of those, found in the prompt cache, once generation began
    first_token_at = None  # perf_counter() at the first token, once the handler knows it

    def error(self, status: int, message: str, kind: str) -> dict:
        """The body of an error reply (``kind``: OpenAI's error type)."""
        raise NotImplementedError

    def whole(self, response: dict) -> dict:
        """The body of a non-streamed answer."""
        raise NotImplementedError

    def start(self) -> bytes:
        """What a streamed answer begins with, as its headers go out."""
        return b""

    def chunk(self, chunk: dict) -> bytes:
        """A streamed OpenAI chunk (text, tool calls, finish reason, usage)."""
        raise NotImplementedError

    def take(self, chunk: dict) -> Optional[dict]:
        """A streamed chunk's usage and finish reason kept (``usage``,
        ``finish_reason``); its first choice, or None."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if not chunk.get("choices"):
            return None
        choice = chunk["choices"][0]
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return choice

    def keepalive(self) -> bytes:
        """Something harmless to send while a long prompt is processed."""
        return b""

    def end(self) -> bytes:
        """What a streamed answer ends with."""
        return b""

    def failed(self, message: str) -> bytes:
        """A failure after a streamed answer began."""
        raise NotImplementedError


# Headers the translation rewrites (the body changes).
REWRITTEN = (b"content-type:", b"content-length:")


class Translator(Wrapped):
    """A handler's output stream: the OpenAI response written to it (status
    line and headers, then a JSON body or server-sent events) goes out as
    ``renderer``'s API answers it (without one, as it is). ``finish`` ends a
    body sent without a length (mlx-lm's own error replies)."""

    def __init__(self, out, renderer: Optional[Renderer]):
        self.out, self.renderer = out, renderer
        self.buffer = b""
        self.mode = None  # None (head pending), "json", "events" or "done"
        self.head: list = []
        self.status = 200
        self.length: Optional[int] = None

    def write(self, b) -> int:
        b = bytes(b)
        if self.renderer is None:  # an answer of the API's own shape already
            return self.out.write(b)
        self.buffer += b
        if self.mode is None and b"\r\n\r\n" in self.buffer:
            head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
            self._read_head(head)
        if self.mode == "events":
            while b"\n\n" in self.buffer:
                event, _, self.buffer = self.buffer.partition(b"\n\n")
                self._send(self._event(event))
        elif self.mode == "json" and self.length is not None and \
                len(self.buffer) >= self.length:
            self._body(self.buffer[:self.length])
        return len(b)

    def finish(self) -> None:
        if self.mode == "json":
            self._body(self.buffer)


    def _read_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        self.status = int(lines[0].split(b" ", 2)[1])
        self.head = [lines[0]] + [line for line in lines[1:] if not line.lower().startswith(REWRITTEN)]
        for line in lines[1:]:
            if line.lower().startswith(b"content-length:"):
                self.length = int(line.split(b":", 1)[1])
            if line.lower().startswith(b"content-type:") and b"event-stream" in line:
                self.mode = "events"
        if self.mode == "events":
            self._send(self._headers(self.renderer.stream_type) + self.renderer.start())
        else:
            self.mode = "json"

    def _headers(self, content_type: str, length: Optional[int] = None) -> bytes:
        extra = [f"Content-Type: {content_type}".encode()]
        if length is not None:
            extra.append(f"Content-Length: {length}".encode())
        return b"\r\n".join(self.head + extra) + b"\r\n\r\n"

    def _body(self, raw: bytes) -> None:
        self.mode = "done"
        try:
            response = json.loads(raw)
        except ValueError:
            response = {"error": raw.decode("utf-8", "replace").strip()}
        if self.status >= 400 or "error" in response:
            error = response.get("error")
            message = error.get("message") if isinstance(error, dict) else str(error)
            kind = error.get("type", "") if isinstance(error, dict) else ""
            body = self.renderer.error(self.status, message, kind)
        else:
            body = self.renderer.whole(response)
        data = json.dumps(body).encode()
        self._send(self._headers("application/json", len(data)) + data)

    def _event(self, event: bytes) -> bytes:
        text = event.decode("utf-8", "replace").strip()
        if text.startswith(":"):
            return self.renderer.keepalive()
        data = text[len("data:"):].strip() if text.startswith("data:") else ""
        if data == "[DONE]":
            return self.renderer.end()
        try:
            chunk = json.loads(data)
        except ValueError:
            return b""
        if "error" in chunk:
            error = chunk["error"]
            return self.renderer.failed(error.get("message", "") if isinstance(error, dict)
                                        else str(error))
        return self.renderer.chunk(chunk)

    def _send(self, data: bytes) -> None:
        if data:
            self.out.write(data)
            self.out.flush()


def tool_call_of(call: dict) -> tuple:
    """``(id, name, arguments as an object)`` of an OpenAI tool call."""
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:
        arguments = {}
    return call.get("id"), function.get("name", ""), arguments


def choice_parts(choice: dict) -> tuple:
    """``(text, reasoning, tool calls)`` of an OpenAI choice, chat or
    completion, streamed or not."""
    message = choice.get("delta") or choice.get("message") or {}
    text = choice.get("text") if "text" in choice else message.get("content")
    return text or "", message.get("reasoning") or "", message.get("tool_calls") or []
