"""Anthropic's Messages API: ``POST /v1/messages`` as an OpenAI chat
request, answered as a message (content blocks, stop reason, usage) or as
its event stream; errors in its shape.
"""

import json
import uuid

from .translate import Renderer, RequestError, choice_parts, tool_call_of

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# Anthropic's error types, by status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               411: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}


def _text(content, where: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
            for b in content):
        return "".join(b["text"] for b in content)
    raise RequestError(f"'{where}' must be a string or a list of text blocks", where)


def _blocks(message, uses: set) -> list:
    """One Anthropic message as OpenAI messages (its tool results become
    tool messages, before its text); ``uses``: the ids of the tool_use
    blocks so far, which its tool results must answer."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise RequestError("each message must be an object with a 'role' of 'user' or "
                           "'assistant'", "messages")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": message["role"], "content": content}]
    if not isinstance(content, list) or not content or not all(
            isinstance(b, dict) for b in content):
        raise RequestError("a message's 'content' must be a string or a non-empty list of "
                           "blocks", "messages")
    text, calls, results = [], [], []
    for block in content:
        kind = block.get("type")
        if kind == "text":
            text.append(_text([block], "messages"))
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not (isinstance(name, str) and isinstance(arguments, dict)):
                raise RequestError("a tool_use block needs a string 'name' and an object "
                                   "'input'", "messages")
            calls.append({"id": block.get("id") or "", "type": "function", "function": {
                "name": name, "arguments": json.dumps(arguments)}})
            if block.get("id"):
                uses.add(block["id"])
        elif kind == "tool_result":
            if block.get("tool_use_id") not in uses:
                raise RequestError("a tool_result block needs the 'tool_use_id' of a tool_use "
                                   f"block before it, got {block.get('tool_use_id')!r}",
                                   "messages")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _text(block.get("content", ""), "messages")})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # the model's earlier reasoning: not part of the prompt
        elif kind in ("image", "document"):
            raise RequestError("this model takes text only: remove the image and document "
                               "blocks", "messages")
        else:
            raise RequestError(f"a content block of type {kind!r} is not supported (text, "
                               "tool_use, tool_result)", "messages")
    out = results
    if text or calls or not results:
        reply = {"role": message["role"], "content": "".join(text)}
        if calls:
            reply["tool_calls"] = calls
        out = out + [reply]
    return out


def _tools(tools) -> list:
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("input_schema", {}), dict) for t in tools):
        raise RequestError("'tools' must be a list of objects with a 'name' and an object "
                           "'input_schema'", "tools")
    return [{"type": "function", "function": {
        "name": t["name"], "description": t.get("description", ""),
        "parameters": t.get("input_schema", {"type": "object"})}} for t in tools]


def prompt_request(body: dict) -> dict:
    """The prompt part of a request (``count_tokens`` takes just this): an
    OpenAI chat request's model, messages and tools."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' is required", "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    uses: set = set()
    converted = [m for message in messages for m in _blocks(message, uses)]
    if body.get("system") is not None:
        converted.insert(0, {"role": "system", "content": _text(body["system"], "system")})
    request = dict(model=model, messages=converted)
    choice = body.get("tool_choice") or {}
    tools = _tools(body["tools"]) if body.get("tools") is not None else []
    if tools and not (isinstance(choice, dict) and choice.get("type") == "none"):
        request["tools"] = tools
    return request


def messages_request(body: dict) -> dict:
    """A ``/v1/messages`` body as an OpenAI chat request; fields that change
    nothing here (``metadata``, ``thinking``, ``cache_control`` ...) are
    left out."""
    if body.get("max_tokens") is None:
        raise RequestError("max_tokens: Field required (a positive integer)", "max_tokens")
    request = prompt_request(body)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
            raise RequestError("'stop_sequences' must be a list of strings", "stop_sequences")
        request["stop"] = stops
    for name in ("max_tokens", "temperature", "top_p", "top_k", "stream"):
        if body.get(name) is not None:
            request[name] = body[name]
    return request


class MessagesRenderer(Renderer):
    """``/v1/messages``' answers: a message, or its event stream."""

    def __init__(self, model: str, approximate: str = ""):
        self.model, self.approximate = model, approximate
        self.stop_sequence = None  # the stop sequence that ended the answer, if one did
        self.id = f"msg_{uuid.uuid4().hex}"
        self.index = -1
        self.open = None  # the type of the content block streaming, if any
        self.call = None  # (index, id) of the tool call the open tool_use block streams
        self.finish_reason = "stop"
        self.usage = {}
        self.cached_tokens = 0  # of the prompt, found in mlx-lm's prompt cache
        self.started = False  # message_start sent

    def error(self, status, message, kind):
        kind = ERROR_TYPES.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}

    def _usage(self, usage: dict) -> dict:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens",
                                                                self.cached_tokens) or 0
        return {"input_tokens": usage.get("prompt_tokens", self.prompt_tokens) - cached,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
                "output_tokens": usage.get("completion_tokens", 0)}

    def _stop(self, finish_reason) -> dict:
        """``stop_reason`` and ``stop_sequence`` of an OpenAI finish reason
        (and the stop string that ended the answer, if one did)."""
        sequence = self.stop_sequence if finish_reason == "stop" else None
        reason = "stop_sequence" if sequence is not None else \
            STOP_REASONS.get(finish_reason, "end_turn")
        return {"stop_reason": reason, "stop_sequence": sequence}

    def _message(self, content: list, finish_reason, usage: dict) -> dict:
        stop = self._stop(finish_reason) if finish_reason else \
            {"stop_reason": None, "stop_sequence": None}
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                   "content": content, **stop, "usage": self._usage(usage)}
        if self.approximate:
            message["approximate"] = self.approximate
        return message

    def whole(self, response):
        choice = response["choices"][0]
        self.stop_sequence = choice.get("stop_reason")
        text, reasoning, calls = choice_parts(choice)
        content = [{"type": "thinking", "thinking": reasoning, "signature": ""}] \
            if reasoning else []
        content += [{"type": "text", "text": text}] if text else []
        content += [_tool_use(call) for call in calls]
        return self._message(content, choice.get("finish_reason") or "stop",
                             response.get("usage", {}))

    def _event(self, kind: str, **data) -> bytes:
        return f"event: {kind}\ndata: {json.dumps(dict(type=kind, **data))}\n\n".encode()

    def _begin(self) -> bytes:
        """``message_start``, sent with the first token: then its usage (the
        prompt cache's share) is known, and agrees with ``message_delta``'s."""
        if self.started:
            return b""
        self.started = True
        return self._event("message_start", message=self._message([], None, {}))

    def keepalive(self):
        # Before message_start an SSE comment: an event then would come first.
        return self._event("ping") if self.started else b": keepalive\n\n"

    def _block(self, kind: str, block: dict) -> bytes:
        """Start a content block of ``kind`` (ending the one open)."""
        out = self._close()
        self.index += 1
        self.open = kind
        return out + self._event("content_block_start", index=self.index, content_block=block)

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return self._event("content_block_stop", index=self.index)

    def chunk(self, chunk):
        choice = self.take(chunk)
        if choice is None:
            return b""
        self.stop_sequence = choice.get("stop_reason") or self.stop_sequence
        text, reasoning, calls = choice_parts(choice)
        out = self._begin()
        if reasoning:
            if self.open != "thinking":
                out += self._block("thinking", {"type": "thinking", "thinking": "",
                                                "signature": ""})
            out += self._event("content_block_delta", index=self.index,
                               delta={"type": "thinking_delta", "thinking": reasoning})
        if text:
            if self.open != "text":
                out += self._block("text", {"type": "text", "text": ""})
            out += self._event("content_block_delta", index=self.index,
                               delta={"type": "text_delta", "text": text})
        for call in calls:
            out += self._tool_call(call)
        return out

    def _tool_call(self, call: dict) -> bytes:
        """A streamed tool call, or a fragment of one (OpenAI's deltas after
        the first carry its ``index`` and more of its arguments only)."""
        index, call_id = call.get("index"), call.get("id")
        out = b""
        if self.open != "tool_use" or index != self.call[0] or \
                call_id not in (None, self.call[1]):
            out += self._block("tool_use", dict(_tool_use(call), input={}))
            self.call = (index, call_id)
        fragment = (call.get("function") or {}).get("arguments") or ""
        if fragment:
            out += self._event("content_block_delta", index=self.index, delta={
                "type": "input_json_delta", "partial_json": fragment})
        return out

    def end(self):
        delta = self._stop(self.finish_reason)
        extra = {"approximate": self.approximate} if self.approximate else {}
        return self._begin() + self._close() + self._event("message_delta", delta=delta,
                                           usage=self._usage(self.usage), **extra) + \
            self._event("message_stop")

    def failed(self, message):
        return self._begin() + self._event("error", error={"type": "api_error", "message": message})


def _tool_use(call: dict) -> dict:
    call_id, name, arguments = tool_call_of(call)
    if not call_id or not str(call_id).startswith("toolu_"):
        call_id = f"toolu_{str(call_id or uuid.uuid4().hex).replace('-', '')}"
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}
