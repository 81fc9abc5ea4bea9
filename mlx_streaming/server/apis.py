"""The handler of every API served: OpenAI's (``handler.py``), and Ollama's
and Anthropic's made OpenAI requests (``translate.py``), so that all go
through one admission queue, one prompt cache and one memory plan.
"""

import json
from typing import Optional

from . import anthropic, ollama
from .admission import current_request
from .handler import StreamingAPIHandler
from .prompt import continued_text, prompt_text, prompt_tokens
from .service import Service
from .translate import Renderer, RequestError, Translator, Wrapped

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
# Ollama's answer to its liveness check (``GET /``, ``HEAD /``).
OLLAMA_RUNNING = b"Ollama is running"
# The endpoints of each method that Ollama's and Anthropic's APIs have here.
GET_PATHS = ("/api/tags", "/api/ps", "/api/version")
POST_PATHS = ("/api/chat", "/api/generate", "/api/show", "/v1/messages",
              "/v1/messages/count_tokens")


def _path(raw: str) -> str:
    """A request's path, its query and trailing slash left out."""
    return raw.split("?", 1)[0].rstrip("/") or "/"


def _api_of(path: str) -> Optional[str]:
    """``"ollama"`` or ``"anthropic"`` for a path under their APIs, else None."""
    if path == "/api" or path.startswith("/api/"):
        return "ollama"
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    return None


class _HeadersOnly(Wrapped):
    """A HEAD request's output: the headers a GET would send, no body."""

    def __init__(self, out):
        self.out, self.sent = out, False

    def write(self, b) -> int:
        if not self.sent:
            self.sent = b"\r\n\r\n" in bytes(b)
            self.out.write(bytes(b).split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
                           if self.sent else b)
        return len(b)


class APIsHandler(StreamingAPIHandler):
    """``StreamingAPIHandler`` with Ollama's and Anthropic's endpoints."""

    renderer: Optional[Renderer] = None

    def do_GET(self):
        path = _path(self.path)
        answers = {"/api/tags": ollama.tags, "/api/ps": ollama.ps,
                   "/api/version": lambda service: {"version": ollama.OLLAMA_VERSION}}
        try:
            if path == "/":
                self._running()
            elif path in answers:
                self._json(200, answers[path](self.service))
            elif _api_of(path) is not None:
                self._unrouted(path)
            else:
                super().do_GET()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the client left before the answer

    def do_HEAD(self):
        """As ``GET``, without the body (Ollama's clients check ``HEAD /``)."""
        self.wfile = _HeadersOnly(self.wfile)
        self.do_GET()

    def do_PUT(self):
        self._other_method()

    def do_PATCH(self):
        self._other_method()

    def do_DELETE(self):
        self._other_method()

    def _other_method(self):
        """A method no endpoint here takes: the API's error, or HTTP's 501."""
        path = _path(self.path)
        if _api_of(path) is None:
            return self.send_error(501, f"Unsupported method ({self.command!r})")
        self._unrouted(path)

    def _running(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(OLLAMA_RUNNING)))
        self.set_cors_headers()
        self.end_headers()
        self.wfile.write(OLLAMA_RUNNING)
        self.wfile.flush()

    def _unrouted(self, path: str) -> None:
        """A path under Ollama's or Anthropic's API that this method does not
        take here: their error, 405 where another method would, else 404."""
        renderer = anthropic.MessagesRenderer("") if _api_of(path) == "anthropic" else \
            ollama.ChatRenderer("")
        methods = [m for m, paths in (("GET", GET_PATHS), ("POST", POST_PATHS))
                   if path in paths]
        if methods:
            message = f"{self.command} {path} is not allowed: use {' or '.join(methods)}"
            return self._json(405, renderer.error(405, message, ""),
                              {"Allow": ", ".join(methods)})
        served = "/v1/messages and /v1/messages/count_tokens" if _api_of(path) == \
            "anthropic" else "/api/chat, /api/generate, /api/tags, /api/show, /api/ps and " \
            "/api/version"
        self._json(404, renderer.error(404, f"{self.command} {path} is not served here: this "
                                       f"server serves {served}", ""))

    def do_POST(self):
        path = _path(self.path)
        routes = {"/api/chat": self._ollama_chat, "/api/generate": self._ollama_generate,
                  "/api/show": self._ollama_show, "/v1/messages": self._anthropic,
                  "/v1/messages/count_tokens": self._count_tokens}
        if path not in routes and _api_of(path) is not None:
            return self._unrouted(path)
        answer = routes.get(path)
        if answer is None:
            return super().do_POST()
        errors = anthropic.MessagesRenderer("") if path.startswith("/v1/") else \
            ollama.ChatRenderer("")
        self.handle_post(lambda: self._translated(errors, answer))

    def _translated(self, errors: Renderer, answer) -> None:
        """Read the body and ``answer`` it, every reply written in the API's
        own shape (``errors`` renders them until the request's renderer is
        known)."""
        translator = self.wfile = Translator(self.wfile, errors)
        try:
            raw = self._read_body()
            body = self._parse(raw) if raw is not None else None
            if body is None:
                return
            try:
                answer(body)
            except RequestError as e:
                self._error(e.status, str(e), param=e.param)
        finally:
            translator.finish()

    def _generate(self, request: dict, renderer: Renderer) -> None:
        """Serve ``request`` (OpenAI's) as the API of ``renderer`` answers."""
        self.wfile.renderer = self.renderer = renderer
        self.request_context = request.pop("num_ctx", None)
        if request.get("stream"):
            request["stream_options"] = {"include_usage": True}
        self.asked_path, self.path = self.path, CHAT_PATH if "messages" in request \
            else COMPLETIONS_PATH
        self._serve(request, json.dumps(request).encode())

    def prompt_counted(self, tokens: int) -> None:
        if self.renderer is not None:
            self.renderer.prompt_tokens = tokens

    def memo_hit(self, reply: bytes) -> None:
        """The renderer told the memoised answer's prompt size and cached
        share, which a stream gives only at its end."""
        if self.renderer is None or b"text/event-stream" not in reply.split(b"\r\n\r\n")[0]:
            return
        for event in reply.split(b"\n\n"):
            usage = json.loads(event[len(b"data: "):]).get("usage") \
                if event.startswith(b"data: {") else None
            if usage:
                self.renderer.prompt_tokens = usage.get("prompt_tokens", 0)
                self.renderer.cached_tokens = \
                    (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    def generate_response(self, text, finish_reason, *args, **kwargs):
        """mlx-lm's; the renderer told what the answer so far knows (the
        prompt's size and cached share, when the first token came)."""
        generation = current_request.generation
        if self.renderer is not None and generation is not None:
            self.renderer.prompt_tokens = len(generation.prompt)
            self.renderer.cached_tokens = max(generation.prompt_cache_count, 0)
            self.renderer.first_token_at = current_request.first_token_at
        return super().generate_response(text, finish_reason, *args, **kwargs)

    # -- Ollama --------------------------------------------------------------

    def _ollama_chat(self, body: dict) -> None:
        self._ollama(body, chat=True)

    def _ollama_generate(self, body: dict) -> None:
        self._ollama(body, chat=False)

    def _ollama(self, body: dict, chat: bool) -> None:
        context = self.service.context_length() or 0
        request = (ollama.chat_request if chat else ollama.generate_request)(body, context)
        kind = ollama.ChatRenderer if chat else ollama.GenerateRenderer
        renderer = kind(body["model"], self.service.approximate)
        self.default_fits = True  # no num_predict: what the context leaves
        if ollama.is_load(body):
            self._known(request["model"])
            return self._answer(renderer.loaded("unload" if ollama.is_unload(body) else "load"))
        self._generate(request, renderer)

    def _ollama_show(self, body: dict) -> None:
        self._known(ollama.model_name(dict(model=body.get("model") or body.get("name"))))
        tool_calling = self.service.provider.tokenizer.has_tool_calling
        self._answer(ollama.show(self.service, tool_calling))

    # -- Anthropic -----------------------------------------------------------

    def _anthropic(self, body: dict) -> None:
        request = anthropic.messages_request(body)
        if request["messages"][-1]["role"] == "assistant":
            request = self._continued(request)
        self._generate(request, anthropic.MessagesRenderer(body["model"],
                                                           self.service.approximate))

    def _continued(self, request: dict) -> dict:
        """A chat ending with the assistant's message (a prefill) as a
        completions request of its prompt: the answer continues that text
        (mlx-lm's chat requests always add a new generation prompt)."""
        tokenizer = self.service.provider.tokenizer
        if not tokenizer.has_chat_template:
            return request
        try:
            text = continued_text(tokenizer, request,
                                  self.response_generator.cli_args.chat_template_args)
        except Exception as e:  # a chat template may raise anything
            raise RequestError(f"the chat template could not continue the assistant's "
                               f"message ({type(e).__name__}: {e})", "messages") from None
        return {k: v for k, v in dict(request, prompt=text).items()
                if k not in ("messages", "tools")}

    def _count_tokens(self, body: dict) -> None:
        """``/v1/messages/count_tokens``: the prompt's tokens, counted at once
        (no generation: it takes no place in the queue; the body's size
        bounds the work)."""
        request = anthropic.prompt_request(body)
        if not self._valid(request):
            return
        try:
            template = self.response_generator.cli_args.chat_template_args
            tokenizer = self.service.provider.tokenizer
            text = prompt_text(tokenizer, request, "messages", template, False)
            n = prompt_tokens(tokenizer, request, "messages", text, template, False)
        except Exception as e:  # a chat template may raise anything
            raise RequestError(f"the chat template could not be applied to this request "
                               f"({type(e).__name__}: {e})") from None
        self._answer({"input_tokens": n})

    def _answer(self, obj: dict) -> None:
        """Send ``obj``, an answer in the API's shape, as it is."""
        self.wfile.renderer = None
        self._json(200, obj)

    def _known(self, model: str) -> None:
        if not self.service.known_model(model):
            raise RequestError(f"model {model!r} not found; this server serves "
                               f"{self.service.model_id!r}", "model", status=404)


def make_handler(service: Service) -> type:
    """The handler class of a server of ``service``."""
    return type("APIsHandler", (APIsHandler,), {"service": service})
