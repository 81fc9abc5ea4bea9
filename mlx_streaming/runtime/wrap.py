"""Calls of a module routed through a hook of ours: the one place where a
module's class is swapped, for the model's forward passes (one at a time,
``Runtime.call``) and for the streamed spine layers (``spine.SpineRing``)."""

import functools
from typing import Callable, Dict

import mlx.nn as nn

# The subclass made for each module class, made once.
_ROUTED: Dict[type, type] = {}
_HOOK = "_mlxs_hook"


def hook_calls(module: nn.Module, hook: Callable) -> None:
    """Make ``module(*args, **kwargs)`` run ``hook(call, *args, **kwargs)``,
    ``call`` being the module's own ``__call__`` bound to it. The module's
    class is swapped for a subclass, so its attributes and the model's
    ``isinstance`` checks still hold; routing a module again replaces its
    hook."""
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
    """Make calls of ``model`` from several threads run one at a time.

    A paged pool is rewritten in place between calls, so two forward passes
    must not interleave. Each call holds the runtime's lock until the
    layers' pool readers are evaluated (not the output: mlx-lm discards
    prefill logits and overlaps the next step with this one's head): then
    no computation still reads a pool when the next call, maybe another
    thread's, starts overwriting slots.
    """

    def in_one_pass(call, *args, **kwargs):
        with runtime.call():
            return call(*args, **kwargs)

    hook_calls(model, in_one_pass)
