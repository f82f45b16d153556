"""Autograd hooks that do not keep the object they call alive.

torch keeps some hooks where Python's cycle collector cannot see them: a tensor's
post-accumulate-grad hooks, and the hooks of an autograd node (``grad_fn.register_prehook``,
``register_hook`` on a non-leaf tensor, ``register_multi_grad_hook``) are held by torch's C++
side, which does not report them to the collector (measured on torch 2.13; a leaf tensor's
``register_hook`` is seen). A hook that refers, through a bound method, to an object that refers
back to the hooked tensor, or to the forward's graph, makes a cycle that is never freed, or
freed only by later collections once the C++ holders die: the wrapper, its model and every
tensor they hold stay in memory. A hook built here holds its object weakly, so the object lives
exactly as long as its user keeps it; once the object is gone, the hook does nothing.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

__all__ = ["weak_method_hook"]


class _WeakMethodHook:
    """Calls ``method(*bound_args)`` while ``method``'s object lives, else nothing; the hook's
    own arguments (the gradient, the tensor) are not passed on."""

    __slots__ = ("_method", "_bound_args")

    def __init__(self, method: Callable[..., Any], bound_args: tuple) -> None:
        self._method = weakref.WeakMethod(method)
        self._bound_args = bound_args

    def __call__(self, *_hook_args: Any) -> None:
        method = self._method()
        if method is not None:
            method(*self._bound_args)


def weak_method_hook(method: Callable[..., Any], *bound_args: Any) -> Callable[..., None]:
    """A hook calling the bound ``method`` with ``bound_args`` (not with the hook's own
    arguments), holding ``method``'s object only weakly (see the module's docstring for why).
    The hook returns ``None``: it leaves the gradient it is given as it is."""
    return _WeakMethodHook(method, bound_args)
