"""Calls of a module routed through a hook: the one place a module's class is
swapped (forward passes one at a time, streamed spine layers)."""

import functools
from typing import Callable, Dict

import mlx.nn as nn

# The subclass made for each module class, made once.
_ROUTED: Dict[type, type] = {}
_HOOK = "_mlxs_hook"


def hook_calls(module: nn.Module, hook: Callable) -> None:
    """Make ``module(...)`` run ``hook(call, ...)``, ``call`` its own bound
    ``__call__``; the class swap keeps its attributes and ``isinstance``."""
    base = type(module)
    if base not in _ROUTED.values():
        cls = _ROUTED.get(base)
        if cls is None:

            def __call__(self, *args, **kwargs):
                return self.__dict__[_HOOK](functools.partial(base.__call__, self),
                                           *args, **kwargs)

            cls = type(base.__name__, (base,), {"__call__": __call__,
                                                "__module__": base.__module__})
            _ROUTED[base] = cls
        module.__class__ = cls
    object.__setattr__(module, _HOOK, hook)


def one_pass_at_a_time(model: nn.Module, runtime) -> None:
    """Make calls of ``model`` from several threads run one at a time, each holding
    the lock until its pool readers are evaluated (docs/design.md, "runtime/wrap.py")."""

    def in_one_pass(call, *args, **kwargs):
        with runtime.call():
            return call(*args, **kwargs)

    hook_calls(model, in_one_pass)
