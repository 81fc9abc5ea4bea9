"""The ``mlx_streaming`` command: one subcommand per module.

    mlx_streaming convert  --model SRC --out DST [-q]
    mlx_streaming generate --model DIR --prompt "..."
    mlx_streaming demo
    mlx_streaming bench    {decode,cache,overhead,simulate,speculative,prefill,io,serve,fetch,quality} ...
    mlx_streaming check    DIR
    mlx_streaming serve    --model DIR [--port 8080] [--max-queue N] [--memo-mb M]
    mlx_streaming predict  MODEL --budget 70GB (--machine NAME | --here) [--json]
    mlx_streaming --version
"""

import atexit
import importlib
import logging
import os
import signal
import sys
import threading
import warnings
from typing import Callable, List, NoReturn, Optional

from .errors import StreamingError

COMMANDS = {
    "convert": "mlx_streaming.conversion.command",
    "generate": "mlx_streaming.generate",
    "demo": "mlx_streaming.demo",
    "bench": "mlx_streaming.bench.__main__",
    "check": "mlx_streaming.check",
    "serve": "mlx_streaming.server.app",
    "predict": "mlx_streaming.predict.__main__",
}


def starting_a_command() -> bool:
    """Whether this process is one of the package's commands, starting
    (``python -m mlx_streaming...`` or the ``mlx_streaming`` script)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1] in COMMAND_MODULES
    return os.path.basename(sys.argv[0] if sys.argv else "") == "mlx_streaming"


def quiet_interrupt_while_starting() -> None:
    """A Ctrl-C before a command reaches ``run_main`` (its imports) ends it
    with one line, as one after would; library imports are left alone."""
    if threading.current_thread() is threading.main_thread() and starting_a_command():
        signal.signal(signal.SIGINT, _interrupted_while_starting)


def _interrupted_while_starting(signum, frame) -> None:
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def _interrupt(signum, frame) -> None:
    """Ctrl-C inside a command: ``KeyboardInterrupt`` where it lands, except
    in a finalizer, where Python would print it as ignored and go on (seen in
    CI, inside a garbage-collected ``__del__``): there the command ends at
    once with the same one line."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            _interrupted_while_starting(signum, frame)
        frame = frame.f_back
    raise KeyboardInterrupt


# What ``python -m`` runs as a command (each enters ``run_main``).
COMMAND_MODULES = {"mlx_streaming", "mlx_streaming.generate", "mlx_streaming.convert",
                   "mlx_streaming.check", "mlx_streaming.demo", "mlx_streaming.server",
                   "mlx_streaming.bench", "mlx_streaming.predict"}


def run_main(body: Callable[[], int]) -> int:
    """Run a command body; a ``StreamingError`` becomes one line on stderr
    and exit status 1, never a traceback. Warnings are one line too, without
    the source line that raised them."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, _interrupt)
    warnings.formatwarning = _one_line_warning
    try:
        return body() or 0
    except StreamingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OutputClosed:
        # The reader of our output left (``| head``): stop quietly, as a
        # process killed by SIGPIPE would, and let nothing flush to it again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


class OutputClosed(Exception):
    """The reader of standard output went away (``write_out``)."""


class _Output:
    """Whether standard output stands in the middle of a line (text is
    streamed to it a token at a time)."""

    mid_line = False


def write_out(text: str, end: str = "") -> None:
    """Print to standard output now; a reader that left is ``OutputClosed``
    (a broken pipe anywhere else stays an error)."""
    try:
        print(text, end=end, flush=True)
    except BrokenPipeError:
        raise OutputClosed() from None
    if text or end:
        _Output.mid_line = not (text + end).endswith("\n")


class LineStartHandler(logging.StreamHandler):
    """Log records on standard error, each from a line start: while text
    streams to standard output a token at a time, a warning (the pools
    shrinking) would otherwise land inside it on a terminal."""

    def __init__(self):
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("[mlx_streaming] %(levelname)s: %(message)s"))

    def emit(self, record):
        self.stream = sys.stderr  # the one of now (tests and notebooks replace it)
        if _Output.mid_line:
            self.stream.write("\n")
            _Output.mid_line = False
        super().emit(record)


def log_to_stderr(level: int = logging.WARNING) -> None:
    """The package's log records on standard error, each at a line start
    (``LineStartHandler``), for commands that stream text."""
    logger = logging.getLogger("mlx_streaming")
    if not any(isinstance(h, LineStartHandler) for h in logger.handlers):
        logger.addHandler(LineStartHandler())
    logger.setLevel(level)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-V"]):
        from .version import __version__

        print(f"mlx_streaming {__version__}")
        return 0
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())  # asked for: standard output, as argparse prints it
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        if not argv:
            print("\nerror: give a command", file=sys.stderr)
            return 2
        print(f"\nerror: unknown command {argv[0]!r}", file=sys.stderr)
        return 2
    return run_main(lambda: importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]))


def leave(status: int) -> NoReturn:
    """Exit a command's process with ``status``, for a process's entry point
    only (``python -m``, the console script). The work is done: a Ctrl-C
    from here on ends the process at once, as the signal's default does,
    where in the interpreter's teardown (joining threads) Python would
    print a traceback. The exit handlers run (models close, logs flush),
    then the process ends without the interpreter's teardown: after MLX
    ran on a thread other than the main one (the server's generation
    thread), the teardown of its thread-local streams may abort the
    process ("terminate called without an active exception", status 134),
    as it does under plain mlx-lm (docs/design.md, "Threads")."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed, or its reader gone
                pass
        os._exit(status if isinstance(status, int) else 1)


def console() -> NoReturn:
    """The ``mlx_streaming`` console script."""
    leave(main())


if __name__ == "__main__":
    leave(main())
