"""Ollama's API: ``/api/chat`` and ``/api/generate`` as OpenAI chat (or,
``raw``, completions) requests, answered in NDJSON (streamed, the default)
or one JSON object; ``/api/tags``, ``/api/show``, ``/api/ps`` and
``/api/version`` describe the one model served.
"""

import json
import re
import time
from datetime import datetime, timezone
from pathlib import Path

from .translate import Renderer, RequestError, choice_parts, tool_call_of

# The Ollama release whose API these endpoints follow (tools check it).
OLLAMA_VERSION = "0.6.0"

# Ollama's options and the OpenAI fields they set.
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
           "repeat_last_n": "repetition_context_size", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty"}
# The OpenAI fields' names in an error as the Ollama options they came from.
OPTION_NAMES = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty",
                "repetition_context_size": "repeat_last_n"}
_OPENAI_NAME = re.compile(r"\b(" + "|".join(OPTION_NAMES) + r")\b")
# Options taken as whole numbers (Ollama's clients may send 5.0).
INTEGER_OPTIONS = ("num_predict", "num_ctx", "top_k", "repeat_last_n", "seed")
# Options of samplers not here: accepted at the value that turns them off.
OFF_OPTIONS = {"typical_p": 1.0, "tfs_z": 1.0}
# Options about where and how Ollama runs a model: nothing to do here.
RUNTIME_OPTIONS = ("num_gpu", "main_gpu", "num_thread", "num_batch", "use_mmap", "use_mlock",
                   "numa", "low_vram", "f16_kv", "vocab_only", "num_keep")


_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}


def keep_alive_seconds(value) -> float:
    """Ollama's ``keep_alive``: seconds, or a Go duration (``"5m"``,
    ``"1h30m"``, ``"0"``; negative: forever); the model stays loaded here
    either way."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = value.strip() if isinstance(value, str) else ""
    sign, body = (-1, text[1:]) if text.startswith("-") else (1, text.removeprefix("+"))
    parts = _DURATION.findall(body)
    if not body or body != "0" and "".join(n + unit for n, unit in parts) != body:
        raise RequestError(f"'keep_alive' must be a duration (\"5m\", \"1h30m\", \"0\") or "
                           f"seconds, got {value!r}", "keep_alive")
    return sign * sum(float(n) * _SECONDS[unit] for n, unit in parts)


def model_name(body: dict) -> str:
    """The model asked for, as the server knows it (Ollama's ``:latest``
    tag is its default)."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise RequestError("'model' is required: name the model /api/tags lists", "model")
    return name[:-len(":latest")] if name.endswith(":latest") else name


def _sampling(body: dict, context: int) -> dict:
    """The OpenAI sampling fields of a request's ``options``."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise RequestError("'options' must be an object", "options")
    fields = {}
    for name, value in options.items():
        if value is None or name in RUNTIME_OPTIONS:
            continue
        if name in INTEGER_OPTIONS and isinstance(value, float) and value.is_integer():
            value = int(value)
        if name in OFF_OPTIONS:
            if value != OFF_OPTIONS[name]:
                raise RequestError(f"the option {name!r} is not supported by this server: "
                                   f"leave it out, or send {OFF_OPTIONS[name]}", name)
        elif name == "seed" and value == -1:
            continue  # Ollama's random seed: none
        elif name == "repeat_last_n" and value == -1:  # Ollama's "the whole context"
            continue  # set below, once num_ctx is known
        elif name in OPTIONS:
            fields[OPTIONS[name]] = value
        elif name == "num_predict":
            if value not in (-1, -2):  # no limit, fill the context: the server's default
                if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                    raise RequestError("'num_predict' must be a positive integer, or -1",
                                       "num_predict")
                fields["max_tokens"] = value
        elif name == "num_ctx":
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise RequestError("'num_ctx' must be a positive integer", "num_ctx")
            if value > context:
                raise RequestError(
                    f"num_ctx {value} exceeds this server's context of {context} tokens, "
                    "fixed at start by its memory plan (--max-context): send a num_ctx of "
                    f"at most {context}, or leave it out", "num_ctx")
            fields["num_ctx"] = value
        else:
            raise RequestError(f"the option {name!r} is not supported by this server", name)
    if options.get("repeat_last_n") == -1:
        fields["repetition_context_size"] = fields.get("num_ctx", context)
    if body.get("keep_alive") is not None:  # the model stays loaded: checked, nothing to do
        keep_alive_seconds(body["keep_alive"])
    if body.get("format") not in (None, ""):
        raise RequestError("'format' (structured output) is not supported by this server",
                           "format")
    if not isinstance(body.get("stream", True), bool):
        raise RequestError("'stream' must be true or false", "stream")
    return fields


def _message(m) -> dict:
    """An Ollama chat message as an OpenAI one."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError("'messages' must be a list of objects with a 'role'", "messages")
    if m.get("images"):
        raise RequestError("this model takes text only: remove the images", "messages")
    content = m.get("content", "")
    if not isinstance(content, str):
        raise RequestError("a message's 'content' must be a string", "messages")
    out = {"role": m["role"], "content": content}
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
            raise RequestError("'tool_calls' must be a list of objects with a 'function'",
                               "messages")
        out["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {
            "name": c["function"].get("name"), "arguments": c["function"].get("arguments")}}
            for i, c in enumerate(calls)]
    if m.get("tool_name"):
        out["name"] = m["tool_name"]
    return out


def chat_request(body: dict, context: int) -> dict:
    """An ``/api/chat`` body as an OpenAI chat request."""
    messages = body.get("messages")
    if messages is None or not isinstance(messages, list):
        raise RequestError("'messages' must be a list of messages", "messages")
    request = dict(_sampling(body, context), model=model_name(body),
                   messages=[_message(m) for m in messages], stream=body.get("stream", True))
    if body.get("tools") is not None:
        request["tools"] = body["tools"]
    return request


def generate_request(body: dict, context: int) -> dict:
    """An ``/api/generate`` body as an OpenAI chat request, or a
    completions one (``raw``: the prompt as it is, without the template)."""
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise RequestError("'prompt' must be a string", "prompt")
    for name in ("suffix", "template", "context", "images"):
        if body.get(name):
            raise RequestError(f"'{name}' is not supported by this server", name)
    system = body.get("system") or ""
    if not isinstance(system, str):
        raise RequestError("'system' must be a string", "system")
    request = dict(_sampling(body, context), model=model_name(body),
                   stream=body.get("stream", True))
    if body.get("raw"):
        return dict(request, prompt=system + prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": prompt}]
    return dict(request, messages=messages)


def is_unload(body: dict) -> bool:
    """A load request (``is_load``) with ``keep_alive`` 0: Ollama's unload."""
    return body.get("keep_alive") is not None and keep_alive_seconds(body["keep_alive"]) == 0


def is_load(body: dict) -> bool:
    """A request that only asks the model to be loaded (no messages, or an
    empty prompt), as Ollama's clients send to warm it."""
    return body.get("messages") == [] or ("messages" not in body and not body.get("prompt"))


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class ChatRenderer(Renderer):
    """``/api/chat``'s answers: a ``message`` per object."""

    stream_type = "application/x-ndjson"

    def __init__(self, model: str, approximate: str = ""):
        self.model, self.approximate = model, approximate
        self.begun = time.perf_counter()
        self.first = None
        self.finish_reason = "stop"
        self.usage = {}

    def error(self, status, message, kind):
        # The fields named as the client sent them (num_predict, not max_tokens).
        return {"error": _OPENAI_NAME.sub(lambda m: OPTION_NAMES[m.group(1)], message)}

    def _object(self, done: bool, **fields) -> dict:
        obj = dict(model=self.model, created_at=now(), **fields, done=done)
        if self.approximate:
            obj["approximate"] = self.approximate
        return obj

    def _content(self, text: str, reasoning: str, calls: list) -> dict:
        message = {"role": "assistant", "content": text}
        if reasoning:
            message["thinking"] = reasoning
        if calls:
            message["tool_calls"] = [{"function": {"name": name, "arguments": arguments}}
                                     for _, name, arguments in map(tool_call_of, calls)]
        return {"message": message}

    def _done(self) -> dict:
        total = time.perf_counter() - self.begun
        first = self.first
        if first is None:  # not streamed: the handler said when the first token came
            first = total if self.first_token_at is None else self.first_token_at - self.begun
        return dict(done_reason="length" if self.finish_reason == "length" else "stop",
                    total_duration=int(total * 1e9), load_duration=0,
                    prompt_eval_count=self.usage.get("prompt_tokens", 0),
                    prompt_eval_duration=int(first * 1e9),
                    eval_count=self.usage.get("completion_tokens", 0),
                    eval_duration=int((total - first) * 1e9))

    def whole(self, response):
        choice = response["choices"][0]
        self.finish_reason, self.usage = choice.get("finish_reason"), response.get("usage") or {}
        return self._object(True, **self._content(*choice_parts(choice)), **self._done())

    def _line(self, obj: dict) -> bytes:
        return json.dumps(obj).encode() + b"\n"

    def chunk(self, chunk):
        choice = self.take(chunk)
        if choice is None:
            return b""
        text, reasoning, calls = choice_parts(choice)
        if not (text or reasoning or calls):
            return b""
        if self.first is None:
            self.first = time.perf_counter() - self.begun
        return self._line(self._object(False, **self._content(text, reasoning, calls)))

    def keepalive(self):
        # NDJSON has no comment line: an empty piece of the answer instead.
        return self._line(self._object(False, **self._content("", "", [])))

    def end(self):
        return self._line(self._object(True, **self._content("", "", []), **self._done()))

    def failed(self, message):
        return self._line({"error": message})

    def loaded(self, reason: str = "load") -> dict:
        """The answer to a request that only loads the model (``is_load``),
        or unloads it (``"unload"``: the model stays, as it serves here)."""
        return self._object(True, **self._content("", "", []), done_reason=reason)


class GenerateRenderer(ChatRenderer):
    """``/api/generate``'s answers: a ``response`` text per object."""

    def _content(self, text, reasoning, calls):
        return dict(response=text, **({"thinking": reasoning} if reasoning else {}))


def model_entry(service) -> dict:
    """The served model as ``/api/tags`` and ``/api/ps`` list it."""
    config = _config(service)
    return {"name": service.model_id, "model": service.model_id,
            "modified_at": now(), "size": _size(service), "digest": "",
            "details": {"format": "mlx_streaming", "family": config.get("model_type", ""),
                        "families": [config.get("model_type", "")], "parameter_size": "",
                        "quantization_level": ""}}


def tags(service) -> dict:
    return {"models": [model_entry(service)]}


def ps(service) -> dict:
    entry = dict(model_entry(service), expires_at="2999-01-01T00:00:00Z",
                 size_vram=0, context_length=service.context_length())
    return {"models": [entry]}


def show(service, tool_calling: bool) -> dict:
    config = _config(service)
    info = {"general.architecture": config.get("model_type", "")}
    info.update({f"{config.get('model_type', '')}.{k}": v for k, v in config.items()
                 if isinstance(v, (int, float, str)) and not isinstance(v, bool)})
    info[f"{config.get('model_type', '')}.context_length"] = service.context_length()
    return {"modelfile": "", "parameters": "", "template": "",
            "details": model_entry(service)["details"], "model_info": info,
            "capabilities": ["completion"] + (["tools"] if tool_calling else []),
            "modified_at": now()}


def _config(service) -> dict:
    try:
        with open(Path(service.path) / "config.json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _size(service) -> int:
    root = Path(service.path)
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0
