"""Command-line values checked as they are parsed: every numeric or listed
flag of ``generate``, the server and ``bench`` goes through one of these,
so a value out of range is a one-line error naming the flag, never a
traceback or a run that hangs.

Each returns an ``argparse`` ``type``; a ``Parser`` turns what argparse
refuses into a ``ConfigError``, which the commands print as one line
(``error: argument --max-tokens: must be ...``) with status 1.
"""

import argparse
import math
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from .errors import ConfigError


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are ``ConfigError``: one line, as
    every other bad input of a command (parse inside ``cli.run_main``)."""

    def error(self, message):
        raise ConfigError(f"{message} (see {self.prog} --help)")


# Far beyond any run, and still a number every size computed from it holds.
MAX_TOKENS = 1 << 24
MAX_ROUNDS = 10_000
# The lowest sampling temperature above 0: below it, logits times 1/temp
# overflow (float16 logits of magnitude 65 at 1e-3 already would), and
# sampling is greedy in all but name.
MIN_TEMPERATURE = 1e-3
# Tokens drafted per verify call.
MAX_NUM_DRAFT = 64
SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _fail(what: str, text: str):
    raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")


def count(low: int = 1, high: Optional[int] = None) -> Callable[[str], int]:
    """An integer from ``low`` to ``high``."""
    what = f"an integer of {low} or more" if high is None else \
        f"an integer from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            _fail(what, text)
        if value < low or (high is not None and value > high):
            _fail(what, text)
        return value

    return parse


def number(low: Optional[float] = None, high: Optional[float] = None,
           open_low: bool = False) -> Callable[[str], float]:
    """A finite number above (``open_low``) or at least ``low``, at most
    ``high``."""
    parts = []
    if low is not None:
        parts.append(f"{'above' if open_low else 'at least'} {low:g}")
    if high is not None:
        parts.append(f"at most {high:g}")
    what = "a finite number" + (" " + " and ".join(parts) if parts else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            _fail(what, text)
        if not math.isfinite(value):
            _fail(what, text)
        if low is not None and (value <= low if open_low else value < low):
            _fail(what, text)
        if high is not None and value > high:
            _fail(what, text)
        return value

    return parse


def listed(item: Callable[[str], object]) -> Callable[[str], list]:
    """A comma-separated list, each value parsed by ``item``."""

    def parse(text: str) -> list:
        values = [v.strip() for v in text.split(",")]
        if not all(values):
            raise argparse.ArgumentTypeError(f"must be a comma-separated list, got {text!r}")
        try:
            return [item(v) for v in values]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (in {text!r})") from None

    return parse


def one_of(choices: Sequence[str]) -> Callable[[str], str]:
    """One of ``choices`` (for items of a list; a single choice is
    argparse's own ``choices``)."""

    def parse(text: str) -> str:
        if text not in choices:
            _fail("one of " + ", ".join(choices), text)
        return text

    return parse


def size(low: int = 1, high: Optional[int] = None, multiple: int = 1) -> Callable[[str], int]:
    """Bytes written as ``4096``, ``256K``, ``4M`` or ``1G`` (powers of 2),
    a multiple of ``multiple``."""
    what = (f"a size like 256K, 4M or 1G from {low} bytes"
            + (f" to {high >> 20}M" if high else "")
            + (f", a multiple of {multiple} bytes" if multiple > 1 else ""))

    def parse(text: str) -> int:
        unit = text[-1:].upper() if text[-1:].isalpha() else ""
        digits = text[:-1] if unit else text
        try:
            value = int(float(digits) * SIZE_UNITS[unit])
        except (KeyError, ValueError):
            _fail(what, text)
        if value < low or (high is not None and value > high) or value % multiple:
            _fail(what, text)
        return value

    return parse


def existing_file(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise argparse.ArgumentTypeError(f"{text!r} is {kind}; give a file")
    return path


def text_file(text: str) -> Path:
    """A regular file that holds something to read."""
    path = existing_file(text)
    if path.stat().st_size == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is empty; give a file with text in it")
    return path


def fractions(text: str) -> List[float]:
    """Pool sizes: fractions of each layer's experts in (0, 1]."""
    return listed(number(0, 1, open_low=True))(text)


def draft(text: str) -> str:
    """A draft of ``bench speculative --drafts``: ``ngram``, ``mtp`` or
    ``model:PATH`` (an mlx-lm model directory or repo id)."""
    if text in ("ngram", "mtp") or (text.startswith("model:") and len(text) > len("model:")):
        return text
    _fail("ngram, mtp or model:PATH", text)


def temperature(text: str) -> float:
    """A sampling temperature: 0 (greedy) or at least ``MIN_TEMPERATURE``."""
    value = number(0)(text)
    if 0 < value < MIN_TEMPERATURE:
        _fail(f"0 (greedy) or at least {MIN_TEMPERATURE:g}", text)
    return value


def flag_names(name: str, flags=()) -> tuple:
    """``flags``, or the option ``name``'s own ``--name``."""
    return flags or ("--" + name.replace("_", "-"),)
