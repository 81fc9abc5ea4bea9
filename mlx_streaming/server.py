"""An OpenAI-compatible server on a streamed model.

    python -m mlx_streaming.server --model DIR [--cache-gb X | --slots-per-layer N]
        [--host 127.0.0.1] [--port 8080] [--max-queue 4] [--memo-mb 64] [...]

This is mlx-lm's own server (``mlx_lm.server``: HTTP handling, request
parsing, chat templates, SSE streaming, stop strings, logprobs, tool calls,
its prompt cache) with the streaming loader plugged in where it loads
models. On top of it:

- one generation at a time on the model's pools, requests served in
  arrival order; beyond ``--max-queue`` waiting requests the answer is 429
  with ``Retry-After``, never a hang;
- OpenAI-style 4xx errors for bad JSON, bad parameters, an unknown model id
  and a prompt longer than the model's context;
- ``GET /v1/stats``: the model's streaming counters and recent requests;
- ``--memo-mb N``: greedy (temperature 0) requests equal to an earlier one
  are answered from a bounded in-memory LRU of responses, marked by the
  ``X-MLX-Streaming-Memo: hit`` header; sampled requests never are.

Every mlx-lm server flag is accepted too (``--temp``, ``--max-tokens``,
``--chat-template`` ...), and every ``load`` option (``--prefetch`` ...).
"""

import argparse
import collections
import io
import json
import re
import socket
import sys
import threading
import time
import uuid
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from unittest import mock

from .cli import run_main
from .config import add_config_flags, config_from_args
from .errors import ConfigError, StreamingError

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
DEFAULT_MAX_QUEUE = 4
MEMO_HEADER = "X-MLX-Streaming-Memo"
RECENT_REQUESTS = 32
MAX_BODY_BYTES = 32 << 20
CLIENT_TIMEOUT_S = 120
# Connections the kernel holds before they are accepted (socketserver's 5
# reset clients that arrive together, before admission can answer 429).
LISTEN_BACKLOG = 128
# mlx-lm builds and keeps a matcher per set of stop strings, ~4 KB per
# character: long ones are memory a request could pin.
MAX_STOP_CHARS = 512
IMAGE_PART_TYPES = ("image_url", "input_image", "image")
# The largest magnitude a number field may have (float32 holds ~3.4e38).
MAX_NUMBER = 1e30
# /v1/stats waits this long for the forward pass in flight to end.
STATS_WAIT_S = 1.0


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_streaming serve", description=__doc__, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="stream directory (mlx_streaming convert)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait while one runs; more get HTTP 429")
    p.add_argument("--memo-mb", type=float, default=0,
                   help="memory for memoised greedy responses, in MB (0: off)")
    add_config_flags(p)
    return p


def mlx_lm_server_args(argv) -> argparse.Namespace:
    """mlx-lm's server options for ``argv``, parsed by mlx-lm's own parser.

    mlx-lm builds its parser inside ``main()``; running that main with its
    ``run`` replaced yields the namespace without starting anything, so
    every flag mlx-lm's server reads has its default.
    """
    import mlx_lm.server as mlx_server

    captured = {}
    with mock.patch.object(mlx_server, "run",
                           lambda host, port, provider: captured.update(args=provider)), \
            mock.patch.object(mlx_server, "ModelProvider", lambda args: args), \
            mock.patch.object(mlx_server, "maybe_set_recommended_wired_limit", lambda: None), \
            mock.patch.object(sys, "argv", ["mlx_streaming serve", *argv]):
        mlx_server.main()
    return captured["args"]


class Admission:
    """At most one running request and ``max_queue`` waiting ones."""

    def __init__(self, max_queue: int):
        self.limit = 1 + max_queue
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


class Service:
    """What the handlers share: the served model's identity, admission,
    the memo and the record of recent requests."""

    def __init__(self, provider, max_queue: int, memo_mb: float):
        self.provider = provider
        self.path = str(provider.cli_args.model)
        self.model_id = Path(self.path).name
        self.admission = Admission(max_queue)
        self.memo = Memo(int(memo_mb * 1e6)) if memo_mb > 0 else None
        self.recent = collections.deque(maxlen=RECENT_REQUESTS)
        self.lock = threading.Lock()
        self._longest_token = None

    def known_model(self, name) -> bool:
        return name in ("default_model", self.model_id, self.path)

    def context_length(self) -> Optional[int]:
        args = getattr(self.provider.model, "args", None)
        return getattr(args, "max_position_embeddings", None)

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
        from .stats import stats

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


def _counting(service: Service, generate):
    """Wrap ``ResponseGenerator.generate`` to record each request's tokens,
    time to first token and duration, and to give back the request's
    admission when its last token is out."""

    def wrapped(request, args, progress_callback=None):
        start = time.perf_counter()
        ticket = _request.ticket
        _request.failure = None
        try:
            ctx, response = generate(request, args, progress_callback)
        except (StreamingError, RuntimeError) as e:
            # mlx-lm answers any failure here with a 404; these are ours
            # (a read error, a dead generation thread), not the request's.
            _request.failure = e
            raise

        def tokens():
            n, first = 0, None
            try:
                for item in response:
                    if first is None:
                        first = time.perf_counter() - start
                    n += 1
                    yield item
            finally:
                if ticket is not None:
                    ticket.release()
                service.record(n, time.perf_counter() - start, first)

        return ctx, tokens()

    return wrapped


class _Request(threading.local):
    """Per handler thread: the admitted request's ticket, and the
    server-side failure behind mlx-lm's error reply."""

    ticket: Optional[Ticket] = None
    failure: Optional[Exception] = None


_request = _Request()


def _release_admission() -> None:
    """Give back this thread's request's place before its answer's last
    bytes go out (see ``Ticket``); an error reply is all of its answer."""
    if _request.ticket is not None:
        _request.ticket.release()


class _Output:
    """What a handler writes, passed through. It turns mlx-lm's own error
    responses (``{"error": "text"}``, a 404 for any request it cannot
    serve) into OpenAI-style 400s, and keeps a copy for the memo."""

    def __init__(self, out, record: bool):
        self.out = out
        self.copy = io.BytesIO() if record else None
        self.held = None
        self.started = False

    def write(self, b):
        b = bytes(b)
        self.started = True
        if self.held is None and b.startswith(b"HTTP/") and b.split(b" ", 2)[1][:1] == b"4":
            self.held = b  # an error's status line and headers: wait for its body
            return len(b)
        if self.held is not None:
            b, self.held = _openai_error(self.held, b), None
            _release_admission()
        if self.copy is not None:
            self.copy.write(b)
        return self.out.write(b)

    def flush(self):
        return self.out.flush()

    @property
    def closed(self):
        return self.out.closed

    def close(self):
        return self.out.close()


def _openai_error(head: bytes, body: bytes) -> bytes:
    try:
        message = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip()
    if not isinstance(message, str):
        return head + body
    status_line, _, rest = head.partition(b"\r\n")
    version = status_line.split(b" ", 1)[0]
    if _request.failure is not None:
        status, kind = b"503 Service Unavailable", "server_error"
    else:  # the model was already checked: what mlx-lm refuses is the request
        status, kind = b"400 Bad Request", "invalid_request_error"
    head = version + b" " + status + b"\r\n" + rest
    return head + json.dumps({"error": {"message": message, "type": kind,
                                        "param": None, "code": None}}).encode()


_RESPONSE_ID = re.compile(rb'"id": "((?:chat)?cmpl-)[0-9a-f-]{36}"')
_CREATED = re.compile(rb'"created": \d{10}\b')


def _fresh(data: bytes) -> bytes:
    """A memoised response as a new one: its own id and creation time (as
    long as the old ones, so Content-Length holds)."""
    rid = uuid.uuid4()
    data = _RESPONSE_ID.sub(lambda m: b'"id": "' + m.group(1) + str(rid).encode() + b'"', data)
    now = str(int(time.time())).encode()
    return _CREATED.sub(b'"created": ' + now, data) if len(now) == 10 else data


def _without_request_headers(data: bytes) -> bytes:
    """A response to store: without the headers that belong to one request
    (the memo marker, CORS for its origin, its date)."""
    head, sep, body = data.partition(b"\r\n\r\n")
    skip = (MEMO_HEADER.lower().encode(), b"access-control-", b"vary:", b"date:")
    lines = [l for l in head.split(b"\r\n") if not l.lower().startswith(skip)]
    return b"\r\n".join(lines) + sep + body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A finite number MLX can take as a float32 (JSON integers have no
    bound)."""
    return (_is_int(v) or isinstance(v, float)) and abs(v) <= MAX_NUMBER


def _has_image(message: dict) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES for part in content)


# Sampling fields: (lowest, highest) allowed, None for no bound; NaN
# poisons the logits.
_SAMPLING = {
    "top_p": (0, 1), "min_p": (0, 1), "xtc_probability": (0, 1), "xtc_threshold": (0, 1),
    "repetition_penalty": (0, None), "presence_penalty": (None, None),
    "frequency_penalty": (None, None),
}


def _check_sampling(body: dict, vocab: Optional[int], temperature: float):
    """As mlx-lm's checks, plus what its samplers raise on where they run
    (at a temperature above 0): a top_k of the vocabulary or more, XTC with
    a threshold above 0.5. Raised inside a sampler compiled with the random
    state, these left the state without a value: every later sampled
    request failed."""
    for name, (low, high) in _SAMPLING.items():
        value = body.get(name)
        if value is None:
            continue
        if not _is_number(value) or (low is not None and value < low) or (
                high is not None and value > high):
            bounds = {(0, 1): " from 0 to 1", (0, None): " of 0 or more"}.get((low, high), "")
            return name, f"'{name}' must be a finite number{bounds}, got {value!r}"
    top_k = body.get("top_k")
    if top_k is not None and not (_is_int(top_k) and top_k >= 0):
        return "top_k", f"'top_k' must be an integer of 0 (off) or more, got {top_k!r}"
    if temperature > 0 and vocab and (top_k or 0) >= vocab:
        return "top_k", f"'top_k' must be below the vocabulary of {vocab}, got {top_k!r}"
    if temperature > 0 and (body.get("xtc_probability") or 0) > 0 and \
            body.get("xtc_threshold", 0.1) > 0.5:
        return "xtc_threshold", "'xtc_threshold' must be at most 0.5 where XTC applies"
    return None


def _check_fields(body: dict, completion: bool, vocab: Optional[int], temperature: float,
                  images: bool = False):
    """The first problem with the request's fields as ``(field, message)``,
    or None. Checked here because mlx-lm lets some through to a crash, or to
    work that holds the queue. ``temperature``: the request's, or the
    server's default; ``images``: the model takes image parts."""
    if completion:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) and prompt):
            # mlx-lm encodes the prompt as text: a list of token ids cannot run.
            return "prompt", "'prompt' must be a non-empty string (lists, of strings or " \
                             "token ids, are not supported)"
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            return "messages", "'messages' must be a non-empty list of objects with a 'role'"
        if not images and any(_has_image(m) for m in messages):
            # mlx-lm would download the image (from any URL) for nothing.
            return "messages", "this model takes text only: remove the image parts"
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and len(stop) <= 16 and all(isinstance(x, str) for x in stop)):
        return "stop", "'stop' must be a string or a list of at most 16 strings"
    stops = [stop] if isinstance(stop, str) else stop or []
    if sum(len(x) for x in stops) > MAX_STOP_CHARS:
        return "stop", f"'stop' strings may hold {MAX_STOP_CHARS} characters in all"
    problem = _check_sampling(body, vocab, temperature)
    if problem is not None:
        return problem
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or not all(
                isinstance(k, str) and k.lstrip("-").isdigit() and _is_number(v)
                for k, v in bias.items()):
            return "logit_bias", "'logit_bias' must map token ids to numbers"
        if vocab and not all(0 <= int(k) < vocab for k in bias):
            return "logit_bias", f"'logit_bias' token ids must be from 0 to {vocab - 1}"
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < 2**63):
        return "seed", "'seed' must be an integer from 0 to 2**63 - 1"
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and isinstance(
            options.get("include_usage", False), bool)):
        return "stream_options", "'stream_options' must be an object like {\"include_usage\": true}"
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        value = body.get(name)
        if value is not None and not (_is_int(value) and 0 <= value <= 1 << 20):
            return name, f"'{name}' must be an integer from 0 to {1 << 20}"
    return None


def make_handler(base):
    """The request handler: mlx-lm's ``APIHandler`` with admission,
    validation, the memo and the extra endpoints."""

    class StreamingAPIHandler(base):
        service: Service = None  # set on the class by ``serve``

        def do_GET(self):
            try:
                self._get()
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                pass  # the client left before the answer

        def _get(self):
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/v1/stats":
                return self._json(200, self.service.stats())
            if path == "/v1/models":
                return self._json(200, {"object": "list", "data": [self._model_card()]})
            if path.startswith("/v1/models/"):
                if self.service.known_model(path[len("/v1/models/"):]):
                    return self._json(200, self._model_card())
                return self._error(404, "no such model", "model_not_found")
            return super().do_GET()

        def _model_card(self):
            return {"id": self.service.model_id, "object": "model", "created": self.created,
                    "owned_by": "mlx_streaming"}

        def do_POST(self):
            if self.path not in COMPLETION_PATHS:
                return super().do_POST()
            try:
                self._post()
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                pass  # the client left; mlx-lm stops a generation it was streaming
            except Exception as e:  # a read error mid-generation, say
                self._failed(e)

        def _failed(self, error: Exception):
            message = " ".join(str(error).split()) or type(error).__name__
            print(f"[mlx_streaming] request failed: {message}", file=sys.stderr, flush=True)
            out = self.wfile
            try:
                if isinstance(out, _Output) and out.started:
                    # Headers went out: end the stream with an error event.
                    _release_admission()
                    event = {"error": {"message": message, "type": "server_error"}}
                    out.write(f"data: {json.dumps(event)}\n\n".encode())
                    out.flush()
                else:
                    self._headers_buffer = []  # a 200 may be pending in it
                    self._error(500, message, "server_error")
            except OSError:
                pass

        def _post(self):
            raw = self._read_body()
            if raw is None:
                return
            body = self._parse(raw)
            if body is None or not self._valid(body):
                return
            memo = self.service.memo
            key = self._memo_key(body) if memo is not None else None
            cached = memo.get(key) if key is not None else None
            if cached is not None:  # answered without the model, so without queueing
                self._headers_buffer = []
                self._set_cors_headers()  # this request's origin, not the first one's
                extra = f"{MEMO_HEADER}: hit\r\n".encode() + b"".join(self._headers_buffer)
                self._headers_buffer = []
                reply = _fresh(cached)
                self.wfile.write(reply.replace(b"\r\n", b"\r\n" + extra, 1))
                self.wfile.flush()
                return
            ticket = self.service.admission.enter()
            if ticket is None:
                return self._error(429, "the server is busy: too many requests are waiting; "
                                   "retry later", "rate_limit_exceeded",
                                   headers={"Retry-After": "1"})
            _request.ticket = ticket
            try:
                # Tokenizing a long prompt is work: only admitted requests do it.
                field = "prompt" if self.path == "/v1/completions" else "messages"
                if self._fits_context(body, field):
                    self._generate(raw, key)
            finally:
                _request.ticket = None
                ticket.release()

        def _generate(self, raw: bytes, key: Optional[str]):
            self.memo_status = "miss" if key is not None else "off"
            self.rfile = io.BytesIO(raw)
            out = self.wfile = _Output(self.wfile, record=key is not None)
            super().do_POST()
            if key is not None:
                data = out.copy.getvalue()
                if data.split(b" ", 2)[1:2] == [b"200"] and self._complete(data):
                    self.service.memo.put(key, _without_request_headers(data))

        def _complete(self, data: bytes) -> bool:
            """A whole answer, not one cut short by a failure mid-stream."""
            if b"text/event-stream" in data.split(b"\r\n\r\n", 1)[0]:
                return data.rstrip().endswith(b"data: [DONE]")
            return True

        def _memo_key(self, body: dict) -> Optional[str]:
            default = self.response_generator.cli_args.temp
            if float(body.get("temperature", default)) != 0:
                return None  # sampled: never memoised
            return self.path + "\n" + json.dumps(body, sort_keys=True)

        def _set_completion_headers(self, status_code: int = 200):
            super()._set_completion_headers(status_code)
            self._memo_header()

        def _set_stream_headers(self, status_code: int = 200):
            super()._set_stream_headers(status_code)
            self._memo_header()

        def _memo_header(self):
            status = getattr(self, "memo_status", "off")
            if status != "off":
                self.send_header(MEMO_HEADER, status)

        # -- validation: OpenAI-style 4xx errors -----------------------------

        def _read_body(self) -> Optional[bytes]:
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._error(411, "a Content-Length header with the body size is required")
                return None
            if length < 0:
                self._error(400, "Content-Length must not be negative")
                return None
            if length > MAX_BODY_BYTES:
                self._error(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MB")
                return None
            raw = self.rfile.read(length)
            return raw if len(raw) == length else None  # the client left mid-body

        def _parse(self, raw: bytes) -> Optional[dict]:
            try:
                body = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                self._error(400, f"the request body is not valid JSON ({e})")
                return None
            if not isinstance(body, dict):
                self._error(400, "the request body must be a JSON object")
                return None
            return body

        def _valid(self, body: dict) -> bool:
            model = body.get("model", "default_model")
            if not isinstance(model, str) or not self.service.known_model(model):
                self._error(404, f"the model {model!r} does not exist; this server serves "
                            f"{self.service.model_id!r}", "model_not_found", param="model")
                return False
            for name in ("max_tokens", "max_completion_tokens"):
                value = body.get(name)
                if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                          or value < 1):
                    self._error(400, f"{name} must be a positive integer, got {value!r}",
                                param=name)
                    return False
            temperature = body.get("temperature", 0)
            if not _is_number(temperature) or temperature < 0:
                self._error(400, f"temperature must be a number of 0 or more, got "
                            f"{temperature!r}", param="temperature")
                return False
            problem = _check_fields(
                body, self.path == "/v1/completions", self._vocab_size(),
                body.get("temperature", self.response_generator.cli_args.temp),
                images=self.service.provider.processor is not None)
            if problem is not None:
                self._error(400, problem[1], param=problem[0])
                return False
            for name in ("draft_model", "adapters"):
                if body.get(name, "default_model") != "default_model":
                    self._error(400, f"'{name}' is not supported on a streamed model",
                                param=name)
                    return False
            limit = self.service.context_length()
            for name in ("max_tokens", "max_completion_tokens"):
                if limit is not None and (body.get(name) or 0) > limit:
                    self._error(400, f"{name} {body[name]} exceeds the model's context of "
                                f"{limit} tokens", "context_length_exceeded", param=name)
                    return False
            return True

        def _vocab_size(self) -> Optional[int]:
            args = getattr(self.service.provider.model, "args", None)
            return getattr(args, "vocab_size", None)

        def _fits_context(self, body: dict, field: str) -> bool:
            tokenizer = self.service.provider.tokenizer
            limit = self.service.context_length()
            if tokenizer is None or limit is None:
                return True
            try:
                text = self._prompt_text(tokenizer, body, field)
                longest = self.service.longest_token_chars()
                # Longer than any tokenization of it could fit: refused
                # without spending seconds tokenizing it.
                if longest is not None and len(text) > limit * longest:
                    self._error(400, f"the prompt has {len(text)} characters, more than the "
                                f"model's context of {limit} tokens can hold; shorten it",
                                "context_length_exceeded", param=field)
                    return False
                n = len(self._tokens(tokenizer, body, field, text))
            except Exception:
                return True  # mlx-lm's own parsing reports what is wrong
            if n > limit:
                self._error(400, f"the prompt has {n} tokens, more than the model's context of "
                            f"{limit}; shorten it", "context_length_exceeded", param=field)
                return False
            return True

        # The prompt as mlx-lm's ``_tokenize`` makes it.

        def _prompt_text(self, tokenizer, body: dict, field: str) -> str:
            if field == "prompt":
                return body["prompt"]
            if not tokenizer.has_chat_template:
                from mlx_lm.server import convert_chat

                return convert_chat(body["messages"], body.get("role_mapping"))
            return tokenizer.apply_chat_template(
                self._messages(body), add_generation_prompt=True,
                **dict(self._template_args(body), tokenize=False))

        def _tokens(self, tokenizer, body: dict, field: str, text: str) -> list:
            if field == "prompt" or not tokenizer.has_chat_template:
                return tokenizer.encode(text)
            return tokenizer.apply_chat_template(
                self._messages(body), add_generation_prompt=True,
                **dict(self._template_args(body), tokenize=True))

        def _messages(self, body: dict) -> list:
            import copy

            from mlx_lm.server import process_message_content

            messages = copy.deepcopy(body["messages"])  # converted in place
            process_message_content(
                messages, keep_images=self.service.provider.processor is not None)
            return messages

        def _template_args(self, body: dict) -> dict:
            args = dict(self.response_generator.cli_args.chat_template_args or {})
            args.update(body.get("chat_template_kwargs") or {})
            return dict(args, tools=body.get("tools") or None)

        def _error(self, status: int, message: str, code: Optional[str] = None,
                   param: Optional[str] = None, headers: Optional[dict] = None):
            kind = "server_error" if status >= 500 else {429: "rate_limit_error"}.get(
                status, "invalid_request_error")
            _release_admission()
            self._json(status, {"error": {"message": message, "type": kind, "param": param,
                                          "code": code}}, headers)

        def _json(self, status: int, obj, headers: Optional[dict] = None):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self._set_cors_headers()
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()

        def log_message(self, format, *args):
            pass  # one line per request on stderr is noise for a local tool

        # A client that stops sending is dropped instead of holding a thread.
        timeout = CLIENT_TIMEOUT_S

    return StreamingAPIHandler


def make_provider(mlx_args: argparse.Namespace, config):
    """mlx-lm's ``ModelProvider`` loading with ``mlx_streaming.load``."""
    import gc

    import mlx.core as mx
    import mlx_lm.server as mlx_server

    from .loader import load

    class StreamingModelProvider(mlx_server.ModelProvider):
        def __init__(self, cli_args):
            super().__init__(cli_args)
            # Requests may name the model by its directory name or path:
            # the same model, never a reload.
            served = cli_args.model
            for name in (Path(served).name, str(served)):
                self._model_map[name] = served
                self._adapter_map[name] = None
                self._draft_model_map[name] = None

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            if model_path != self.cli_args.model or adapter_path or draft_model_path:
                raise ConfigError(f"this server serves only {self.cli_args.model}, without "
                                  "adapters or draft models")
            self.reset()
            gc.collect()
            mx.clear_cache()
            model, tokenizer, model_config = load(
                model_path, tokenizer_config=self._tokenizer_config, return_config=True,
                trust_remote_code=self.cli_args.trust_remote_code, config=config)
            if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
                tokenizer.chat_template = tokenizer.default_chat_template
            self.model_key = (model_path, adapter_path, draft_model_path)
            self.model, self.tokenizer = model, tokenizer
            self.processor = mlx_server.load_processor(model, model_config)
            self.draft_model = None
            # One generation at a time: requests are never batched onto the
            # pools together (mlx-lm then serves them in arrival order).
            self.is_batchable = False

    return StreamingModelProvider(mlx_args)


def serve(args, mlx_args) -> None:
    import mlx_lm.server as mlx_server
    from mlx_lm.models.cache import LRUPromptCache

    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be 0 or more, got {args.max_queue}")
    if not 0 <= args.memo_mb <= 1e6:
        raise ConfigError(f"--memo-mb must be between 0 and 1e6, got {args.memo_mb}")
    if mlx_args.adapter_path or mlx_args.draft_model:
        raise ConfigError("--adapter-path and --draft-model are not supported on a streamed "
                          "model")
    config = config_from_args(args)
    _check_defaults(mlx_args)
    _check_address(mlx_args.host, mlx_args.port)
    provider = make_provider(mlx_args, config)
    provider.load_default()  # load errors are one line, before the port opens
    limit = getattr(getattr(provider.model, "args", None), "max_position_embeddings", None)
    if limit is not None and mlx_args.max_tokens > limit:
        raise ConfigError(f"--max-tokens {mlx_args.max_tokens} exceeds the model's context "
                          f"of {limit} tokens")
    vocab = getattr(getattr(provider.model, "args", None), "vocab_size", None)
    # Any request may sample with the default top_k.
    problem = _check_sampling({"top_k": mlx_args.top_k}, vocab, temperature=1.0)
    if problem is not None:
        raise ConfigError(f"--top-k: {problem[1]}")
    service = Service(provider, args.max_queue, args.memo_mb)
    generator = mlx_server.ResponseGenerator(
        provider, LRUPromptCache(mlx_args.prompt_cache_size))
    try:
        generator.generate = _counting(service, generator.generate)
        handler = make_handler(mlx_server.APIHandler)
        handler.service = service
        print(f"[mlx_streaming] serving {service.model_id} on http://{mlx_args.host}:"
              f"{mlx_args.port} (reader: {provider.model.streaming.reader.name}, "
              f"max queue {args.max_queue})", file=sys.stderr, flush=True)
        mlx_server._run_http_server(mlx_args.host, mlx_args.port, generator,
                                    server_class=_Server, handler_class=handler)
    except OSError as e:
        raise ConfigError(f"cannot listen on {mlx_args.host}:{mlx_args.port} "
                          f"({e.strerror or e}); choose another --host or --port") from None
    finally:
        # Its thread is not a daemon: the process would otherwise never exit.
        generator.stop_and_join()


class _Server(ThreadingHTTPServer):
    request_queue_size = LISTEN_BACKLOG


def _check_defaults(mlx_args) -> None:
    """The request defaults the server's flags set: checked as a request's
    would be, so that a bad flag is the operator's error at start, not
    every client's."""
    if not (_is_int(mlx_args.max_tokens) and mlx_args.max_tokens >= 1):
        raise ConfigError(f"--max-tokens must be 1 or more, got {mlx_args.max_tokens}")
    if not (_is_number(mlx_args.temp) and mlx_args.temp >= 0):
        raise ConfigError(f"--temp must be a number of 0 or more, got {mlx_args.temp}")
    flags = {name: getattr(mlx_args, name) for name in ("top_p", "min_p", "top_k")}
    problem = _check_sampling(flags, None, mlx_args.temp)
    if problem is not None:
        raise ConfigError(f"--{problem[0].replace('_', '-')}: {problem[1]}")


def _check_address(host: str, port: int) -> None:
    """Refuse an address the server could not listen on, before the model
    loads and the generation thread starts (which would keep the process)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be from 0 to 65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror or e}); "
                          "choose another --host or --port") from None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, rest = setup_arg_parser().parse_known_args(argv)

    def body():
        mlx_args = mlx_lm_server_args(["--model", ours.model, *rest])
        serve(ours, mlx_args)

    return run_main(body)


if __name__ == "__main__":
    from .cli import leave

    leave(main())
