"""Runs of a model split over the ranks of ``mlx.launch``: the flags that
ask for it, the load, and the watchdog that stops a rank whose peers
stopped answering (docs/distributed.md).
"""

import os
import subprocess
import sys
import time
from typing import Optional

from .errors import ConfigError, RankError, first_line
from .flags import number
from .runtime.events import Observer

# Seconds a rank waits for the next token before it gives its peers up.
DEFAULT_RANK_TIMEOUT = 300.0


def add_sharded_flags(p) -> None:
    g = p.add_argument_group("split over machines (run under `mlx.launch -n N`)")
    g.add_argument("--tensor-parallel", action="store_true",
                   help="split every layer across the ranks (a directory converted with "
                        "--tensor-parallel N)")
    g.add_argument("--pipeline", action="store_true",
                   help="split the layers into one stage per rank")
    g.add_argument("--rank-timeout", type=number(1, 86400), default=DEFAULT_RANK_TIMEOUT,
                   help="seconds a rank waits for the next token before it stops with an "
                        "error (a peer died or hangs)")


def load_sharded(args, config):
    """``(model, tokenizer, rank)`` of a run under ``mlx.launch`` with more
    than one rank, or None for a process that runs alone.

    Raises:
        ConfigError: split flags without ranks, or both kinds asked.
    """
    import mlx.core as mx

    from .runtime.loader import sharded_load

    if args.tensor_parallel and args.pipeline:
        raise ConfigError("pass either --tensor-parallel or --pipeline, not both")
    world = mx.distributed.init()
    if world.size() == 1:
        if args.tensor_parallel or args.pipeline:
            raise ConfigError("--tensor-parallel and --pipeline split the model over the ranks "
                              "of `mlx.launch -n N ...`; this process runs alone")
        return None
    if getattr(args, "draft", None) or getattr(args, "draft_model", None):
        raise ConfigError("drafts do not run on a model split over ranks; leave out --draft")
    groups = (world, None) if args.pipeline else (None, world) if args.tensor_parallel \
        else (None, None)
    model, tokenizer = sharded_load(args.model, *groups, config=config)
    return model, tokenizer, world.rank()


# How MLX's distributed backends name the errors of a collective.
BACKENDS = ("[ring]", "[jaccl]", "[mpi]", "[nccl]")


def lost(rank: int, error: RuntimeError) -> BaseException:
    """A failed collective as a lost rank; any other error as it is."""
    if not any(name in str(error) for name in BACKENDS):
        return error
    return RankError(f"rank {rank} lost its peers ({first_line(error)}): a rank died or was "
                     "killed, or the network between them broke; every rank stops")


# The watchdog's own process: a rank blocked in a collective may hold the
# GIL (mlx-lm's clear_cache waits on the pass in flight), so no thread of
# the rank itself can be relied on to notice. It hears a byte per beat on
# stdin; silence for the timeout prints the error and kills the rank.
# Silence counts only while the rank could run: not while the rank is
# stopped (SIGSTOP, a debugger: its state, looked up each tick), nor across
# a tick that came late (this watcher was stopped with it: at most a tick's
# length counts). A rank stuck soon after a stop did not wait for its peers:
# they gave it up while it was stopped, and its error says so instead.
_WATCHER = """
import os, select, signal, subprocess, sys, time
parent, timeout, rank = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
tick = min(1.0, timeout / 5)

def stopped():
    try:  # Linux: the state follows the command's closing parenthesis
        with open(f"/proc/{parent}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        pass
    try:  # macOS
        state = subprocess.run(["ps", "-o", "state=", "-p", str(parent)], capture_output=True,
                               text=True, timeout=5).stdout.strip()
        return state[:1] in ("T", "t")
    except (OSError, subprocess.SubprocessError):
        return False

silent, stopped_s, resumed, last = 0.0, 0.0, 0.0, time.monotonic()
while True:
    ready, _, _ = select.select([sys.stdin], [], [], tick)
    now = time.monotonic()
    gap, last = now - last, now
    if not ready and stopped():
        held = gap
    elif gap > tick + 1.0:  # this watcher did not run: stopped with its rank
        held = gap - tick
    else:
        held = 0.0
    if held:
        stopped_s, resumed = stopped_s + held, now
    elif stopped_s and now - resumed > 2 * timeout:
        # Peers give a stopped rank up within a timeout: one that ran twice
        # that long since its stop met them, and a later hang is theirs.
        stopped_s = 0.0
    if ready:
        if not os.read(sys.stdin.fileno(), 4096):
            sys.exit(0)  # the rank ended
        silent = 0.0
        continue
    if not held:
        silent += min(gap, tick)
    if silent >= timeout:
        if stopped_s:
            print(f"error: rank {rank} was stopped for {stopped_s:.0f} s (a signal, Ctrl-Z or "
                  f"a debugger) and has made no progress for {timeout:g} s since it resumed: "
                  "its peers gave it up; every rank stops", file=sys.stderr, flush=True)
        else:
            print(f"error: rank {rank} waited {timeout:g} s for its peers: a rank died, hangs "
                  "or was stopped; every rank stops", file=sys.stderr, flush=True)
        os.kill(parent, signal.SIGKILL)
        sys.exit(1)
"""

# Seconds between beats sent to the watcher at most.
BEAT_EVERY = 0.5


class Watchdog(Observer):
    """Ends this rank with an error when the model makes no progress (no
    token, no MoE call) for ``timeout`` seconds: a collective waits forever
    on a peer that hangs."""

    def __init__(self, rank: int, timeout: float):
        self._watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, str(os.getpid()),
                                          str(timeout), str(rank)], stdin=subprocess.PIPE)
        self._pipe = self._watcher.stdin.fileno()
        os.set_blocking(self._pipe, False)
        self._sent = 0.0

    def beat(self) -> None:
        now = time.monotonic()
        if now - self._sent >= BEAT_EVERY:
            self._sent = now
            try:
                os.write(self._pipe, b".")
            except (BlockingIOError, BrokenPipeError):
                pass

    def on_call(self, layer, tokens) -> None:
        self.beat()

    def on_graph_calls(self, layer, *counts) -> None:
        self.beat()

    def stop(self) -> None:
        """The run ended: the watcher leaves."""
        self._sent = float("inf")  # no beat after this
        self._watcher.stdin.close()
        self._watcher.wait()


def watch(split, timeout: float) -> Optional[Watchdog]:
    """A watchdog of a split run's progress, told of every MoE call."""
    if split is None:
        return None
    dog = Watchdog(split[2], timeout)
    split[0].streaming.events.add(dog)
    return dog
