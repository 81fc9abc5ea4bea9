"""The request handler: mlx-lm's ``APIHandler`` with admission, validation,
the memo and the extra endpoints.
"""

import io
import json
import logging
import sys
import time
from typing import Optional

from ..flags import MIN_TEMPERATURE
from ..mlx_lm_adapter import APIHandler
from .admission import current_request, release_admission
from .memo import MEMO_HEADER, fresh, without_request_headers
from .prompt import completion_logprobs_of, prompt_text, prompt_tokens
from .service import Service
from .translate import Wrapped
from .validation import check_fields, completion_logprobs, is_number

log = logging.getLogger(__name__)

# An approximate model's answers say so (header and field): what makes them so.
APPROXIMATE_HEADER = "X-MLX-Streaming-Approximate"

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")


MAX_BODY_BYTES = 32 << 20


CLIENT_TIMEOUT_S = 120


class OutputTap(Wrapped):
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
            release_admission()
        if self.copy is not None:
            self.copy.write(b)
        return self.out.write(b)


def _openai_error(head: bytes, body: bytes) -> bytes:
    try:
        message = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip()
    if not isinstance(message, str):
        return head + body
    status_line, _, rest = head.partition(b"\r\n")
    version = status_line.split(b" ", 1)[0]
    if current_request.failure is not None:
        status, kind = b"503 Service Unavailable", "server_error"
    else:  # the model was already checked: what mlx-lm refuses is the request
        status, kind = b"400 Bad Request", "invalid_request_error"
    current_request.status = int(status.split()[0])
    head = version + b" " + status + b"\r\n" + rest
    return head + json.dumps({"error": {"message": message, "type": kind,
                                        "param": None, "code": None}}).encode()


class StreamingAPIHandler(APIHandler):
    """mlx-lm's ``APIHandler`` with admission, validation, the memo and the
    extra endpoints; ``make_handler`` gives it the service it serves."""

    service: Service = None
    # A request's own, smaller context (Ollama's num_ctx), if any.
    request_context: Optional[int] = None
    # The path asked for, where another API's request is served as OpenAI's.
    asked_path: Optional[str] = None
    # The --max-tokens default cut to the context a prompt leaves (Ollama's
    # requests without num_predict), instead of a 400.
    default_fits = False

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
        self.handle_post(self._post)

    def handle_post(self, answer) -> None:
        """Run ``answer`` for this request: its failures answered, its line
        logged."""
        start, self.status = time.perf_counter(), None
        current_request.tokens, current_request.status = 0, None
        current_request.stops, current_request.stopped_by = (), None
        current_request.first_token_at, current_request.generation = None, None
        with self.service.answering():
            try:
                answer()
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                self.status = "client left"  # mlx-lm stops a generation it was streaming
            except Exception as e:  # a read error mid-generation, say
                self._failed(e)
            self._log_request(time.perf_counter() - start)

    def send_response(self, code, message=None):
        self.status = code
        super().send_response(code, message)

    def _log_request(self, seconds: float) -> None:
        """One line per request: what was asked, its status, its tokens."""
        memo = getattr(self, "memo_status", "off")
        status = current_request.status or getattr(self, "status", None)
        level = logging.WARNING if isinstance(status, int) and status >= 500 else logging.INFO
        log.log(level, "%s %s %s, %d tokens, %.2f s%s", self.command,
                self.asked_path or self.path, status, current_request.tokens, seconds,
                "" if memo == "off" else f", memo {memo}")

    def _failed(self, error: Exception):
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"[mlx_streaming] request failed: {message}", file=sys.stderr, flush=True)
        out = self.wfile
        try:
            if isinstance(out, OutputTap) and out.started:
                # Headers went out: end the stream with an error event.
                release_admission()
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
        if body is not None:
            self._serve(body, raw)

    def _serve(self, body: dict, raw: bytes):
        """Answer the OpenAI request ``body`` (``raw``: its JSON)."""
        if None in body.values():  # OpenAI's null: the field's default
            body = {k: v for k, v in body.items() if v is not None}
            raw = json.dumps(body).encode()
        if not self._valid(body):
            return
        memo = self.service.memo
        key = self._memo_key(body) if memo is not None else None
        cached = memo.get(key) if key is not None else None
        if cached is not None:  # answered without the model, so without queueing
            self._headers_buffer = []
            self.set_cors_headers()  # this request's origin, not the first one's
            extra = f"{MEMO_HEADER}: hit\r\n".encode() + b"".join(self._headers_buffer)
            self._headers_buffer = []
            reply = fresh(cached)
            self.memo_hit(reply)
            self.wfile.write(reply.replace(b"\r\n", b"\r\n" + extra, 1))
            self.wfile.flush()
            self.status, self.memo_status = 200, "hit"
            return
        ticket = self.service.admission.enter()
        if ticket is None:
            return self._error(429, "the server is busy: too many requests are waiting; "
                               "retry later", "rate_limit_exceeded",
                               headers={"Retry-After": "1"})
        current_request.ticket = ticket
        try:
            # Tokenizing a long prompt is work: only admitted requests do it.
            field = "prompt" if self.path == "/v1/completions" else "messages"
            asked = body.get("max_tokens")
            if self._fits_context(body, field):
                if field == "prompt" and body != completion_logprobs(body):
                    raw = json.dumps(completion_logprobs(body)).encode()
                elif body.get("max_tokens") != asked:  # the default cut to fit
                    raw = json.dumps(body).encode()
                self._respond(raw, key)
        finally:
            current_request.ticket = None
            ticket.release()

    def _respond(self, raw: bytes, key: Optional[str]):
        self.memo_status = "miss" if key is not None else "off"
        self.rfile = io.BytesIO(raw)
        self.headers.replace_header("Content-Length", str(len(raw)))
        out = self.wfile = OutputTap(self.wfile, record=key is not None)
        super().do_POST()
        if key is not None:
            data = out.copy.getvalue()
            if data.split(b" ", 2)[1:2] == [b"200"] and self._complete(data):
                self.service.memo.put(key, without_request_headers(data))

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

    def handle_completion(self, request, stop_words):
        """mlx-lm's, the stop strings matched on the answer's text here
        (``stops.py``) instead of on its tokens there."""
        current_request.stops = tuple(stop_words)
        super().handle_completion(request, [])

    def completion_usage_response(self, *args, **kwargs):
        """mlx-lm's usage chunk (``stream_options.include_usage``), which says
        it is approximate as every other chunk does."""
        response = super().completion_usage_response(*args, **kwargs)
        if self.service.approximate:
            response["approximate"] = self.service.approximate
        return response

    def generate_response(self, text, finish_reason, *args, **kwargs):
        """mlx-lm's response, which names the stop string that ended it
        (``stop_reason``, as vLLM's); a completion's log probabilities in the
        OpenAI completions format (tokens, token_logprobs, top_logprobs,
        text_offset) instead of the chat one."""
        response = super().generate_response(text, finish_reason, *args, **kwargs)
        if finish_reason == "stop" and current_request.stopped_by is not None:
            response["choices"][0]["stop_reason"] = current_request.stopped_by
        if self.service.approximate:
            response["approximate"] = self.service.approximate
        if self.object_type == "text_completion" and "logprobs" in response["choices"][0]:
            response["choices"][0]["logprobs"] = completion_logprobs_of(
                self.service.provider.tokenizer, kwargs.get("tokens") or [],
                kwargs.get("token_logprobs") or [], kwargs.get("top_tokens") or [])
        return response

    def response_headers(self):
        status = getattr(self, "memo_status", "off")
        if status != "off":
            self.send_header(MEMO_HEADER, status)
        if self.service.approximate:
            self.send_header(APPROXIMATE_HEADER, self.service.approximate)

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
        if len(raw) < length:
            self.status = "client left mid-body"
            return None
        return raw

    def _parse(self, raw: bytes) -> Optional[dict]:
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            self._error(400, f"the request body is not valid JSON ({e})")
            return None
        except RecursionError:
            self._error(400, "the request body is nested too deeply")
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
        if not is_number(temperature) or temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
            self._error(400, f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                        f"got {temperature!r}", param="temperature")
            return False
        problem = check_fields(
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

    def prompt_counted(self, tokens: int) -> None:
        """The prompt was counted (a hook: another API's answer shows it)."""

    def memo_hit(self, reply: bytes) -> None:
        """``reply``, a memoised OpenAI response, is about to be sent (a
        hook: another API's answer needs what it says before its end)."""

    def _vocab_size(self) -> Optional[int]:
        args = getattr(self.service.provider.model, "args", None)
        return getattr(args, "vocab_size", None)

    def _fits_context(self, body: dict, field: str) -> bool:
        """Whether the prompt and the tokens asked for fit the model's
        context (else a 400 is written)."""
        tokenizer = self.service.provider.tokenizer
        limit = self.service.context_length()
        if tokenizer is None or limit is None:
            return True
        images = self.service.provider.processor is not None
        template = self.response_generator.cli_args.chat_template_args
        try:
            text = prompt_text(tokenizer, body, field, template, images)
            longest = self.service.longest_token_chars()
            # Longer than any tokenization of it could fit: refused
            # without spending seconds tokenizing it.
            if longest is not None and len(text) > limit * longest:
                self._error(400, f"the prompt has {len(text)} characters, more than the "
                            f"model's context of {limit} tokens can hold; shorten it",
                            "context_length_exceeded", param=field)
                return False
            n = prompt_tokens(tokenizer, body, field, text, template, images)
        except Exception:
            return True  # mlx-lm's own parsing reports what is wrong
        explicit = body.get("max_completion_tokens") or body.get("max_tokens")
        asked = explicit or self.response_generator.cli_args.max_tokens
        self.prompt_counted(n)
        room = min(limit, self.request_context or limit) - n
        if self.default_fits and explicit is None and 0 < room < asked:
            asked = body["max_tokens"] = room
        if self.request_context is not None and n + asked > self.request_context:
            self._error(400, f"the prompt has {n} tokens and {asked} more are asked for, "
                        f"beyond the context it asked for (num_ctx {self.request_context})",
                        "context_length_exceeded", param=field)
            return False
        if n + asked > limit:
            self._error(400, f"the prompt has {n} tokens and {asked} more are asked for "
                        f"(max_tokens), beyond the model's context of {limit}; shorten the "
                        "prompt or ask for fewer tokens", "context_length_exceeded",
                        param=field if n >= limit else "max_tokens")
            return False
        return True

    def _error(self, status: int, message: str, code: Optional[str] = None,
               param: Optional[str] = None, headers: Optional[dict] = None):
        kind = "server_error" if status >= 500 else {429: "rate_limit_error"}.get(
            status, "invalid_request_error")
        release_admission()
        self._json(status, {"error": {"message": message, "type": kind, "param": param,
                                      "code": code}}, headers)

    def _json(self, status: int, obj, headers: Optional[dict] = None):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.set_cors_headers()
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def log_message(self, format, *args):
        pass  # one line per request on stderr is noise for a local tool

    # A client that stops sending is dropped instead of holding a thread.
    timeout = CLIENT_TIMEOUT_S
