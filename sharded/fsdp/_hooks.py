"""Autograd and module-hook plumbing that tells a unit where it is in the step.

* A unit's *pre-backward* is a hook on its forward outputs' autograd nodes: it fires when
  backward reaches the unit, before any of the unit's own backward ops run.
* Its *post-backward* is a gradient hook on the forward's inputs that fires once all of their
  gradients are complete, i.e. when the unit's own backward ops are done.
* Module forward pre/post hooks call the unit around the module's forward.
* A :class:`BackwardTracker` counts a unit's forward calls whose backward is still to come.

The autograd hooks hold what they call weakly: a unit's state reaches its modules, and the hooks
sit in dicts of the forward's graph that torch's cycle collector cannot see, so a strong hold
kept a dropped model alive until up to three collections had peeled the cycles one by one.

Inputs and outputs may be nested tuples, lists and dicts of tensors; :func:`map_tensors`
walks them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from .._common.weak_hooks import weak_method_hook
from ._graph_task import AllGradientsWatch

__all__ = [
    "install_forward_hooks",
    "install_state_dict_hooks",
    "watch_input_gradients",
    "register_pre_backward",
    "map_tensors",
    "tensors_in",
    "cast_floats",
    "BackwardTracker",
]


def install_forward_hooks(module: nn.Module, pre_forward: Callable, post_forward: Callable) -> None:
    """Call ``pre_forward(args, kwargs) -> (args, kwargs)`` before ``module``'s forward (ahead
    of other pre-hooks, so they see unsharded parameters) and ``post_forward(output) -> output``
    after it.

    Dynamo never traces the hooks (as torch's FSDP2 keeps it out of its own): a module compiled
    in place (``module.compile()``) runs its hooks inside the compiled call, and tracing the
    collectives and bookkeeping there would only cut the module's graph into many.
    """

    @torch.compiler.disable
    def pre_hook(_module: nn.Module, args: Any, kwargs: Any) -> Any:
        return pre_forward(args, kwargs)

    @torch.compiler.disable
    def post_hook(_module: nn.Module, _args: Any, output: Any) -> Any:
        return post_forward(output)

    module.register_forward_pre_hook(pre_hook, prepend=True, with_kwargs=True)
    module.register_forward_hook(post_hook)


def install_state_dict_hooks(module: nn.Module, before: Callable[[], None], after_load: Callable[[], None]) -> None:
    """Call ``before()`` ahead of ``module``'s ``state_dict()`` and ``load_state_dict()`` (as part
    of its parent's too), and ``after_load()`` once it has loaded."""
    module.register_state_dict_pre_hook(lambda *_args, **_kwargs: before())
    module._register_load_state_dict_pre_hook(lambda *_args, **_kwargs: before())
    module.register_load_state_dict_post_hook(lambda *_args, **_kwargs: after_load())


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


def watch_input_gradients(callback: Callable[[], None], args: Any, kwargs: Any) -> Optional[AllGradientsWatch]:
    """Call ``callback()`` once backward has computed the gradients of every tensor in
    ``args``/``kwargs`` that requires grad and that this backward differentiates (the module's
    own backward is then done); returns the watch, or ``None`` if there was no such tensor. A
    gradient hook, not an identity function: the inputs stay the tensors they were, so the
    module may still modify them in place. ``callback`` is a bound method, whose object the hook
    holds weakly: the graph's hooks are out of the cycle collector's sight (see
    :mod:`sharded._common.weak_hooks`). The watch itself is a cycle through the inputs' autograd
    nodes: remove it once the step is over, or the graph waits for a full collection. It counts
    what ``torch.autograd.grad`` computes too (:class:`~._graph_task.AllGradientsWatch`)."""
    needing = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
    if not needing:
        return None
    return AllGradientsWatch(needing, weak_method_hook(callback))


def register_pre_backward(callback: Callable[[], None], output: Any) -> None:
    """Call ``callback()`` when backward reaches any tensor of ``output``.

    The hook sits on the tensors' autograd nodes (node pre-hooks), not on the tensors: a tensor
    that leaves one unit and enters the next carries the next unit's input-gradient hook too, and
    the engine runs tensor hooks before node pre-hooks, so the next unit finishes (sends its
    gradients, frees its parameters) before this one gathers. ``callback`` is a bound method,
    held weakly, as in :func:`watch_input_gradients`.
    """
    hooked: set[int] = set()
    for tensor in tensors_in(output):
        if not tensor.requires_grad:
            continue
        node = tensor.grad_fn
        if node is None:
            tensor.register_hook(weak_method_hook(callback))
        elif id(node) not in hooked:
            hooked.add(id(node))
            node.register_prehook(weak_method_hook(callback))


class BackwardTracker:
    """Whether a unit's backward is still to come, and when it is done.

    Each grad-enabled forward call of the unit's modules watches its inputs
    (:func:`watch_input_gradients`): once backward has computed their gradients, that call's
    backward ops are done, and the unit's backward is done when every call's is (a block called
    twice is differentiated twice). A call with no input needing a gradient gives no such signal,
    so the unit's gradients then wait for the end of backward (e.g. a list unit with the token
    embedding, whose weight is tied to the head: one reduction, not two).
    """

    def __init__(self) -> None:
        self.awaiting = False  # a grad-enabled forward ran whose backward is not finished
        self.syncs = True  # requires_gradient_sync as it was at that forward: it decides for its backward
        self._open_calls = 0  # grad-enabled forward calls whose inputs' gradients are pending
        self._done_at_end = False  # a call had no input needing a gradient
        self._on_done: Callable[[], None] = _nothing  # the watched calls' on_done
        self._watches: list[AllGradientsWatch] = []  # their hooks, taken off when the step is over

    def watch_forward_call(self, args: Any, kwargs: Any, syncs: bool, on_done: Callable[[], None]) -> None:
        """A grad-enabled forward call with inputs ``args`` / ``kwargs``: call ``on_done()`` when
        the backward of every call watched so far is done (never, if one could not be watched)."""
        self.awaiting = True
        self.syncs = syncs
        self._on_done = on_done
        watch = watch_input_gradients(self._call_done, args, kwargs)
        if watch is not None:
            self._watches.append(watch)
            self._open_calls += 1
        else:
            self._done_at_end = True

    def _call_done(self) -> None:
        if self._open_calls > 0:
            self._open_calls -= 1
            if self._open_calls == 0 and not self._done_at_end:
                self._on_done()

    def reset(self) -> None:
        """The step is over (or was abandoned): no backward is awaited. The watches' hooks come
        off their graphs, which refcounting then frees (see :func:`watch_input_gradients`)."""
        self.awaiting = False
        self._open_calls = 0
        self._done_at_end = False
        for watch in self._watches:
            watch.remove()
        self._watches = []


def _nothing() -> None:
    pass
