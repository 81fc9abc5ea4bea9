"""Every private name of mlx-lm that mlx_streaming touches, in one place.

The server is mlx-lm's own (``mlx_lm.server``) with hooks of ours; tests
build models with mlx-lm's class lookup. mlx-lm does not keep these names
from one release to the next, so only this module reaches them, and
tests/test_mlx_lm_adapter.py checks each against the installed mlx-lm,
saying which one changed. Subclasses elsewhere override the public hooks
below, never mlx-lm's private methods.
"""

import argparse
import inspect
import socket
import types
from typing import Callable, Optional
from unittest import mock

import mlx_lm.server as mlx_server
from mlx_lm.utils import _get_classes

from .errors import ConfigError


def model_classes(config: dict):
    """``(Model, ModelArgs)`` of an mlx-lm ``config`` (mlx-lm's lookup,
    with its remapping of model types)."""
    return _get_classes(config)


# -- the server's flags ------------------------------------------------------

class _Captured(Exception):
    pass


def server_parser() -> argparse.ArgumentParser:
    """mlx-lm's server parser: ``mlx_lm.server.main`` builds it and parses
    at once, so it is taken at its ``parse_args`` call, before anything
    starts."""
    def capture(parser, *args, **kwargs):
        raise _Captured(parser)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            mlx_server.main()
        except _Captured as captured:
            parser = captured.args[0]
            for action in parser._actions:
                if callable(action.type):
                    action.type = _argument_type(action.type)
            return parser
    raise ConfigError("mlx_lm.server.main() no longer parses its flags first; this mlx-lm "
                      "is outside the range mlx_streaming supports")


def _argument_type(parse: Callable) -> Callable:
    """mlx-lm's flag parser ``parse``, any failure a usage error (its size
    parser raises decimal's errors, which argparse would show as a traceback)."""
    def checked(text):
        try:
            return parse(text)
        except argparse.ArgumentTypeError:
            raise
        except Exception:
            raise argparse.ArgumentTypeError(f"not a valid value: {text!r}") from None

    checked.__name__ = getattr(parse, "__name__", "value")
    return checked


# -- the model provider ------------------------------------------------------

class ModelProvider(mlx_server.ModelProvider):
    """mlx-lm's ``ModelProvider``; subclasses load in ``load_model``."""

    def alias(self, name: str, model: str) -> None:
        """Requests naming ``name`` get ``model``, without adapters or drafts."""
        self._model_map[name] = model
        self._adapter_map[name] = None
        self._draft_model_map[name] = None

    @property
    def tokenizer_config(self) -> dict:
        """The tokenizer options mlx-lm built from its flags."""
        return self._tokenizer_config

    def load_model(self, model_path, adapter_path, draft_model_path) -> None:
        """Load ``model_path`` and set ``model``, ``tokenizer``, ``processor``,
        ``draft_model``, ``is_batchable`` and ``model_key``."""
        raise NotImplementedError

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        return self.load_model(model_path, adapter_path, draft_model_path)


# -- the generation thread ---------------------------------------------------

class ResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's generation thread and request queue, with hooks:
    ``tokenize``, ``next_request``, ``serving`` and ``generation_failed``.
    ``stream_generate``, if given, replaces mlx-lm's for the requests this
    generator serves one at a time (mlx-lm's module is left as it is)."""

    def __init__(self, model_provider, prompt_cache,
                 stream_generate: Optional[Callable] = None):
        single = mlx_server.ResponseGenerator._serve_single
        self._serve_one = single if stream_generate is None else \
            _calling(single, "stream_generate", stream_generate)
        super().__init__(model_provider, prompt_cache)  # starts the thread

    @property
    def stopping(self) -> bool:
        return self._stop

    @property
    def is_distributed(self) -> bool:
        return self._is_distributed

    @property
    def rank(self) -> int:
        return self._rank

    def tokenize(self, tokenizer, request, args):
        """mlx-lm's tokenization of a request: ``(prompt tokens, ...)``."""
        return super()._tokenize(tokenizer, request, args)

    def next_request(self, timeout=None):
        """The next ``(response queue, request, arguments)``, or None."""
        return super()._next_request(timeout)

    def serving(self, args) -> None:
        """Called with a request's arguments before it is served alone, and
        with None after."""

    def generation_failed(self, error: Exception) -> None:
        """The generation loop raised ``error``: raise to end the thread,
        return to start the loop again."""
        raise error

    def _tokenize(self, tokenizer, request, args):
        return self.tokenize(tokenizer, request, args)

    def _next_request(self, timeout=None):
        return self.next_request(timeout)

    def _serve_single(self, request, *rest):
        self.serving(request[2])
        try:
            return self._serve_one(self, request, *rest)
        finally:
            self.serving(None)

    def _run_generate(self):
        while not self._stop:
            try:
                self._generate()
                return
            except Exception as e:
                self.generation_failed(e)


def _calling(function, name: str, replacement) -> types.FunctionType:
    """A copy of ``function`` whose global ``name`` is ``replacement``."""
    scope = dict(function.__globals__, **{name: replacement})
    copy = types.FunctionType(function.__code__, scope, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


# -- HTTP --------------------------------------------------------------------

class APIHandler(mlx_server.APIHandler):
    """mlx-lm's request handler; ``response_headers`` adds headers to
    every completion response."""

    def set_cors_headers(self) -> None:
        self._set_cors_headers()

    def response_headers(self) -> None:
        """Send extra headers of a completion response (a hook)."""

    def _set_completion_headers(self, status_code: int = 200):
        super()._set_completion_headers(status_code)
        self.response_headers()

    def _set_stream_headers(self, status_code: int = 200):
        super()._set_stream_headers(status_code)
        self.response_headers()


def http_server(host: str, port: int, generator, handler_class, server_class):
    """A bound (not yet serving) HTTP server of ``handler_class`` for
    ``generator``, as mlx-lm's server makes it (IPv6 hosts too)."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type(server_class.__name__, (server_class,), {"address_family": family})
    fingerprint = mlx_server.get_system_fingerprint()

    def handler(*args, **kwargs):
        return handler_class(generator, *args, system_fingerprint=fingerprint, **kwargs)

    return server_class(address, handler)


# What each hook above relies on, for tests/test_mlx_lm_adapter.py: mlx-lm
# names that must exist, with the parameters they must take.
REQUIRED = {
    "ModelProvider._load": ["self", "model_path", "adapter_path", "draft_model_path"],
    "ResponseGenerator._tokenize": ["self", "tokenizer", "request", "args"],
    "ResponseGenerator._next_request": ["self", "timeout"],
    "ResponseGenerator._serve_single": ["self", "request", "stream"],
    "ResponseGenerator._run_generate": ["self"],
    "ResponseGenerator._generate": ["self"],
    "APIHandler._set_cors_headers": ["self"],
    "APIHandler.handle_completion": ["self", "request", "stop_words"],
    "APIHandler._set_completion_headers": ["self", "status_code"],
    "APIHandler._set_stream_headers": ["self", "status_code"],
    "APIHandler.__init__": ["self", "response_generator", "args", "system_fingerprint",
                            "kwargs"],
}


def parameters(qualified: str) -> Optional[list]:
    """The parameter names of mlx_lm.server's ``Class.method``, or None
    where it does not exist."""
    owner, _, name = qualified.partition(".")
    function = getattr(getattr(mlx_server, owner, None), name, None)
    if function is None:
        return None
    return list(inspect.signature(function).parameters)
