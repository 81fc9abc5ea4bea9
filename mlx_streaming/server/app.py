"""``python -m mlx_streaming.server`` (and ``mlx_streaming serve``): the
command line, and the server's start-up checks.
"""
import argparse
import logging
import socket
import sys
import threading
from dataclasses import replace
from http.server import ThreadingHTTPServer

from ..cli import run_main
from ..config import add_config_flags, config_from_args
from ..errors import ConfigError, first_line
from ..flags import MAX_NUM_DRAFT, MAX_TOKENS, MIN_TEMPERATURE, Parser, count
from ..mlx_lm_adapter import http_server, server_parser
from ..runtime.loader import approximations
from ..runtime.prefill_step import step_of
from .provider import make_provider
from .service import Service, counting
from .validation import check_sampling, is_int, is_number

DEFAULT_MAX_QUEUE = 4
DEFAULT_DECODE_CONCURRENCY = 4
DEFAULT_MAX_CONTEXT = 8192
# Drafts of --draft (server/drafts.py, not imported until asked for).
DRAFT_CHOICES = ("ngram", "mtp")


# Connections the kernel holds before they are accepted (socketserver's 5
# reset clients that arrive together, before admission can answer 429).
LISTEN_BACKLOG = 128


def setup_arg_parser() -> argparse.ArgumentParser:
    # mlx-lm's own server flags, from its parser; --model and
    # --prefill-step-size are ours (they replace mlx-lm's), then no more overlap.
    p = Parser(
        prog="mlx_streaming serve", description=__doc__, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter, parents=[server_parser()],
        conflict_handler="resolve")
    p.add_argument("--model", required=True,
                   help="stream directory (mlx_streaming convert) or Hub repo id")
    p.add_argument("--prefill-step-size", type=int, default=None,
                   help="prompt tokens per model call (default: mlx-lm's 2048, or fewer where "
                        "the memory plan's headroom would not hold them, shared by the "
                        "prompts prefilled together)")
    p.conflict_handler = "error"
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait while one runs; more get HTTP 429")
    p.add_argument("--memo-mb", type=float, default=0,
                   help="memory for memoised greedy responses, in MB (0: off)")
    p.add_argument("--draft", choices=DRAFT_CHOICES, default=None,
                   help="speculative decoding of each request with drafts: ngram (prompt "
                        "lookup) or mtp (the model's own MTP layers); --num-draft-tokens "
                        "per verify call; lossless, off by default")
    p.add_argument("--max-context", type=count(1, MAX_TOKENS), default=None,
                   help="tokens a sequence may reach, prompt and answer: the memory plan keeps "
                        "room for --decode-concurrency KV caches this long (default: the "
                        f"model's context, at most {DEFAULT_MAX_CONTEXT}); longer requests get "
                        "HTTP 400")
    p.add_argument("--ollama-port", type=int, default=None,
                   help="also listen on this port (11434: Ollama's) for tools that know only "
                        "that one; the same model, queue and memory plan (default: off)")
    p.add_argument("--tensor-parallel", action="store_true",
                   help="under mlx.launch: split every layer across the ranks (the default "
                        "there without --pipeline, as mlx-lm's server does)")
    # Sequences decoded together: fewer than mlx-lm's 32 by default, since
    # each holds a KV cache beside the pools in memory the model shares.
    p.set_defaults(decode_concurrency=DEFAULT_DECODE_CONCURRENCY,
                   prompt_concurrency=DEFAULT_DECODE_CONCURRENCY)
    add_config_flags(p)
    return p


def serve(args) -> None:
    """Load the model and serve it until interrupted; ``args`` are
    ``setup_arg_parser``'s (ours, mlx-lm's server flags and every load
    option)."""
    from mlx_lm.models.cache import LRUPromptCache

    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be 0 or more, got {args.max_queue}")
    if not 0 <= args.memo_mb <= 1e6:
        raise ConfigError(f"--memo-mb must be between 0 and 1e6, got {args.memo_mb}")
    if args.draft and mx_group().size() > 1:
        raise ConfigError("--draft does not run on a model split over ranks")
    if args.tensor_parallel and args.pipeline:
        raise ConfigError("pass either --tensor-parallel or --pipeline, not both")
    if (args.tensor_parallel or args.pipeline) and mx_group().size() == 1:
        raise ConfigError("--tensor-parallel and --pipeline split the model over the ranks of "
                          "`mlx.launch -n N ...`; this server runs alone")
    if args.adapter_path or args.draft_model:
        raise ConfigError("--adapter-path and --draft-model are not supported on a streamed "
                          "model")
    config = config_from_args(args)
    if args.draft == "mtp" and not config.mtp:
        config = replace(config, mtp=True)
    if args.draft and not 1 <= args.num_draft_tokens <= MAX_NUM_DRAFT:
        raise ConfigError(f"--num-draft-tokens must be from 1 to {MAX_NUM_DRAFT} with --draft, "
                          f"got {args.num_draft_tokens}")
    _check_defaults(args)
    _check_address(args.host, args.port)
    if args.ollama_port is not None:
        _check_address(args.host, args.ollama_port, "--ollama-port")
    configure_logging(args.log_level)
    for flag in ("decode_concurrency", "prompt_concurrency"):
        if not 1 <= getattr(args, flag) <= MAX_CONCURRENCY:
            raise ConfigError(f"--{flag.replace('_', '-')} must be from 1 to {MAX_CONCURRENCY}, "
                              f"got {getattr(args, flag)}")
    provider = make_provider(args, config)
    provider.load_default()  # load errors are one line, before the port opens
    running = args.decode_concurrency if provider.is_batchable else 1
    limit = reserve_kv_caches(provider.model, running, args.max_context)
    if args.prefill_step_size is None:
        args.prefill_step_size = max(MIN_SHARED_STEP, step_of(provider.model) // running)
    elif not 1 <= args.prefill_step_size <= MAX_TOKENS:
        raise ConfigError(f"--prefill-step-size must be from 1 to {MAX_TOKENS}, "
                          f"got {args.prefill_step_size}")
    if args.max_tokens > limit:
        raise ConfigError(f"--max-tokens {args.max_tokens} exceeds the context of {limit} "
                          "tokens a sequence may reach (the model's, or --max-context)")
    vocab = getattr(getattr(provider.model, "args", None), "vocab_size", None)
    # Any request may sample with the default top_k.
    problem = check_sampling({"top_k": args.top_k}, vocab, temperature=1.0)
    if problem is not None:
        raise ConfigError(f"--top-k: {problem[1]}")
    service = Service(provider, args.max_queue, args.memo_mb, running, limit,
                      "; ".join(approximations(provider.model.streaming)))
    from .apis import make_handler

    if args.draft:
        from . import drafts

        generator = drafts.DraftingResponseGenerator(
            provider, LRUPromptCache(args.prompt_cache_size), args.draft)
    else:
        from .generation import ResilientResponseGenerator

        generator = ResilientResponseGenerator(provider, LRUPromptCache(args.prompt_cache_size))
    if args.kv_bits is not None:
        check_kv_quantization(provider.model, args.kv_bits, args.kv_group_size)
    if provider.is_distributed and mx_group().rank() != 0:
        # Rank 0 serves; the others decode every request with it (mlx-lm's loop).
        generator.join()
        return
    try:
        generator.generate = counting(service, generator.generate)
        try:
            httpd = http_server(args.host, args.port, generator, make_handler(service), _Server)
        except OSError as e:
            raise ConfigError(f"cannot listen on {args.host}:{args.port} "
                              f"({e.strerror or e}); choose another --host or --port") from None
        port = httpd.server_address[1]  # the one bound, for --port 0
        also = _also_listen(args, generator, make_handler(service))
        host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 URL brackets it
        print(f"[mlx_streaming] serving {service.model_id} on http://{host}:"
              f"{port}{f' and :{also.server_address[1]}' if also else ''} (reader: "
              f"{provider.model.streaming.reader.name}, {running} decoded together, "
              f"max queue {args.max_queue})", file=sys.stderr, flush=True)
        with httpd:
            try:
                httpd.serve_forever()
            except KeyboardInterrupt:  # Ctrl-C: take no more requests, finish those in flight
                if also:
                    also.shutdown()
                service.finish_answering()
            finally:
                if also:
                    also.shutdown()
                    also.server_close()
    finally:
        # Its thread is not a daemon: the process would otherwise never exit.
        generator.stop_and_join()


def _also_listen(args, generator, handler):
    """``--ollama-port``'s server, serving in a thread of its own (the
    same handler class, hence the same queue), or None."""
    if args.ollama_port is None:
        return None
    try:
        httpd = http_server(args.host, args.ollama_port, generator, handler, _Server)
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.host}:{args.ollama_port} "
                          f"({e.strerror or e}); choose another --ollama-port") from None
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


# Sequences decoded together at most (each with a KV cache).
MAX_CONCURRENCY = 256
# The least prefill step of each prompt prefilled together.
MIN_SHARED_STEP = 16


def reserve_kv_caches(model, sequences: int, max_context) -> int:
    """Keep room in the model's memory plan for ``sequences`` KV caches of
    the context a sequence may reach (returned): the pools give up slots for
    it, or the server is refused at start, naming what would fit."""
    from ..errors import BudgetError
    from ..runtime.kv import sequence_bytes

    model_context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    context = max_context or min(model_context or DEFAULT_MAX_CONTEXT, DEFAULT_MAX_CONTEXT)
    if model_context is not None and context > model_context:
        raise ConfigError(f"--max-context {context} exceeds the model's context of "
                          f"{model_context} tokens")
    per_sequence = sequence_bytes(model, context)
    try:
        model.streaming.reserve(sequences * per_sequence, f"{sequences} KV caches of "
                                f"{context} tokens")
    except BudgetError as e:
        raise ConfigError(f"{e}: use a smaller --decode-concurrency or --max-context "
                          f"(each sequence takes {per_sequence / 1e9:.3g} GB at {context} "
                          "tokens)") from None
    return context


# Widths mlx's quantizer takes.
KV_BITS = (2, 3, 4, 5, 6, 8)


def check_kv_quantization(model, bits: int, group_size: int) -> None:
    """Quantize a one-token KV cache of ``model`` as mlx-lm will, so that a
    width or group size its head dimensions cannot take is refused at
    start instead of failing every request."""
    import mlx.core as mx
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    from ..runtime.stats import reset_stats

    if bits not in KV_BITS or not 1 <= group_size <= 1024:
        raise ConfigError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))} and "
                          f"--kv-group-size from 1 to 1024, got {bits} and {group_size}")
    cache = make_prompt_cache(model)
    try:
        model(mx.array([[0]]), cache=cache)
        maybe_quantize_kv_cache(cache, 0, group_size, bits)
        mx.eval([c.state for c in cache])
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"--kv-bits {bits} --kv-group-size {group_size} cannot quantize "
                          f"this model's KV cache ({first_line(e)}); try another "
                          "--kv-group-size (32 or 64) or leave --kv-bits out") from None
    finally:
        reset_stats(model)  # the trial's reads are not a request's


# Libraries that log a line per HTTP request they make (a Hub repo's range
# requests): quiet unless DEBUG is asked for.
CHATTY_LOGGERS = ("httpx", "httpx2", "httpcore", "huggingface_hub", "urllib3", "filelock")


def configure_logging(level: str) -> None:
    """mlx-lm's log format at ``level``, one line per request: below DEBUG,
    the HTTP libraries' per-request lines and mlx-lm's own progress lines
    are left out (the handler logs each request once)."""
    logging.basicConfig(level=getattr(logging, level),
                        format="%(asctime)s - %(levelname)s - %(message)s")
    if level == "DEBUG":
        return
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, getattr(logging, level)))
    for handler in logging.getLogger().handlers:
        handler.addFilter(_quiet_mlx_lm_progress)


def _quiet_mlx_lm_progress(record: logging.LogRecord) -> bool:
    """mlx-lm's server logs through the root logger: its INFO lines (prompt
    progress, prompt cache sizes) are per request step."""
    return not (record.levelno < logging.WARNING and "mlx_lm" in record.pathname)


def mx_group():
    """The ranks this server runs on (one, unless under ``mlx.launch``)."""
    import mlx.core as mx

    return mx.distributed.init()


class _Server(ThreadingHTTPServer):
    request_queue_size = LISTEN_BACKLOG


def _check_defaults(args) -> None:
    """The request defaults the server's flags set: checked as a request's
    would be, so that a bad flag is the operator's error at start, not
    every client's."""
    if not (is_int(args.max_tokens) and args.max_tokens >= 1):
        raise ConfigError(f"--max-tokens must be 1 or more, got {args.max_tokens}")
    if not (is_number(args.temp) and (args.temp == 0 or args.temp >= MIN_TEMPERATURE)):
        raise ConfigError(f"--temp must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                          f"got {args.temp}")
    size = getattr(args, "prompt_cache_size", None)
    if size is not None and not (is_int(size) and size >= 0):
        raise ConfigError(f"--prompt-cache-size must be 0 or more, got {size}")
    flags = {name: getattr(args, name) for name in ("top_p", "min_p", "top_k")}
    problem = check_sampling(flags, None, args.temp)
    if problem is not None:
        raise ConfigError(f"--{problem[0].replace('_', '-')}: {problem[1]}")


def _check_address(host: str, port: int, flag: str = "--port") -> None:
    """Refuse an address the server could not listen on, before the model
    loads and the generation thread starts (which would keep the process)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"{flag} must be from 0 to 65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror or e}); "
                          f"choose another --host or {flag}") from None


def main(argv=None) -> int:
    return run_main(lambda: serve(setup_arg_parser().parse_args(argv)))
