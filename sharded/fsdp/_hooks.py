"""Autograd and module-hook plumbing that tells a unit where it is in the step.

* A unit's *pre-backward* is a gradient hook on its forward's outputs: it fires when backward
  reaches the unit, before any of the unit's own backward ops run.
* Its *post-backward* is an identity autograd function applied to the forward's inputs: its
  backward runs once the gradients for those inputs are complete, i.e. when the unit's own
  backward ops are done.
* Module forward pre/post hooks call the unit around the module's forward.

Inputs and outputs may be nested tuples, lists and dicts of tensors; :func:`map_tensors`
walks them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = [
    "install_forward_hooks",
    "attach_post_backward",
    "register_pre_backward",
    "map_tensors",
    "tensors_in",
    "cast_floats",
]


def install_forward_hooks(module: nn.Module, pre_forward: Callable, post_forward: Callable) -> None:
    """Call ``pre_forward(args, kwargs) -> (args, kwargs)`` before ``module``'s forward (ahead
    of other pre-hooks, so they see unsharded parameters) and ``post_forward(output) -> output``
    after it."""
    module.register_forward_pre_hook(lambda _m, args, kwargs: pre_forward(args, kwargs), prepend=True, with_kwargs=True)
    module.register_forward_hook(lambda _m, _args, output: post_forward(output))


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor inside (nested tuples, namedtuples, lists, dicts) replaced by
    ``fn(tensor)``; anything else is kept as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, x) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, x) for x in obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(fn, v)) for k, v in obj.items())
    return obj


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj``, in the order :func:`map_tensors` visits them."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors_in(x)]
    return []


def cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with its floating-point tensors cast to ``dtype``."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, obj)


class _PostBackward(torch.autograd.Function):
    """Identity on the inputs whose backward reports that their gradients are complete."""

    @staticmethod
    def forward(ctx, callback: Callable[[], None], *tensors: torch.Tensor):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.callback()
        return (None, *grads)


def attach_post_backward(callback: Callable[[], None], args: Any, kwargs: Any) -> tuple[Any, Any, bool]:
    """Route the tensors in ``args``/``kwargs`` that require grad through one
    :class:`_PostBackward`; returns the new ``(args, kwargs)`` and whether any tensor did."""
    needing = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
    if not needing:
        return args, kwargs, False
    replaced = iter(_PostBackward.apply(callback, *needing))

    def substitute(tensor: torch.Tensor) -> torch.Tensor:
        return next(replaced) if tensor.requires_grad else tensor

    args, kwargs = map_tensors(substitute, (args, kwargs))
    return args, kwargs, True


def register_pre_backward(callback: Callable[[], None], output: Any) -> None:
    """Call ``callback()`` when backward first reaches any tensor of ``output``."""
    for tensor in tensors_in(output):
        if tensor.requires_grad:
            tensor.register_hook(lambda _grad: callback())
