"""The mlx-lm releases mlx_streaming supports: the range pyproject.toml
states, read from the installed package's metadata, checked at import.
The metadata is read from the ``.dist-info`` folders on ``sys.path``, in
importlib.metadata's order, without importing it: importing the package
stays cheap, so a Ctrl-C while a command starts is still one line."""

import operator
import os
import re
import sys
from typing import Optional

_COMPARE = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt,
            "==": operator.eq, "!=": operator.ne}


def _dist_info(name: str) -> Optional[tuple]:
    """``(version, folder)`` of the first installed distribution ``name``
    (underscored) on ``sys.path``, or None."""
    pattern = re.compile(rf"{name}-([^-]+)\.dist-info", re.IGNORECASE)
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for folder in names:
            match = pattern.fullmatch(folder)
            if match:
                return match.group(1), os.path.join(entry or ".", folder)
    return None


def installed_version(name: str) -> Optional[str]:
    found = _dist_info(name)
    return found[0] if found else None


def mlx_lm_range() -> Optional[str]:
    """The supported mlx-lm versions (``>=0.32.1,<0.33``), or None when the
    package runs from a checkout that was never installed."""
    found = _dist_info("mlx_streaming")
    if found is None:
        return None
    try:
        with open(os.path.join(found[1], "METADATA"), encoding="utf-8") as f:
            requires = [line.split(":", 1)[1].strip() for line in f
                        if line.startswith("Requires-Dist:")]
    except OSError:
        return None
    for line in requires:
        if ";" in line:  # a requirement with a marker (an extra's, a platform's)
            continue
        match = re.fullmatch(r"\s*mlx[-_.]lm\s*\(?([^)]*)\)?\s*", line, re.IGNORECASE)
        if match:
            specs = [s.strip() for s in match.group(1).split(",") if s.strip()]
            return ",".join(sorted(specs, key=lambda s: s[0] != ">"))
    return None


def release(version: str) -> tuple:
    """The leading numbers of a version (``0.32.1rc1`` -> (0, 32, 1))."""
    return tuple(int(n) for n in re.findall(r"\d+", re.match(r"[\d.]*", version).group(0)))


def in_range(version: str, supported: str) -> bool:
    for spec in supported.split(","):
        op, bound = re.match(r"(>=|<=|==|!=|>|<)\s*(.+)", spec.strip()).groups()
        a, b = release(version), release(bound)
        width = max(len(a), len(b))
        if not _COMPARE[op](a + (0,) * (width - len(a)), b + (0,) * (width - len(b))):
            return False
    return True


def check_mlx_lm(found: Optional[str] = None) -> None:
    """Raise a one-line ImportError when the installed mlx-lm (or
    ``found``) is outside the supported range."""
    supported = mlx_lm_range()
    if supported is None:
        return
    found = found or installed_version("mlx_lm")
    if found is None:
        raise ImportError(f"mlx_streaming needs mlx-lm {supported}: "
                          f"pip install 'mlx-lm{supported}'")
    if not in_range(found, supported):
        raise ImportError(f"mlx_streaming {installed_version('mlx_streaming')} supports mlx-lm "
                          f"{supported}, not the installed {found}: "
                          f"pip install 'mlx-lm{supported}'")
