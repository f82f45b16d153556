"""What the running backward computes: which gradients, and whether it fills any ``.grad``.

A backward is a *graph task* of torch's autograd engine. ``loss.backward()`` computes every
gradient in the graph and accumulates the leaves' into their ``.grad``; ``torch.autograd.grad``
(gradient penalties, saliency, meta-learning, torch's pipelining schedules) computes only the
gradients it was asked for and returns them, filling no ``.grad``; ``backward(inputs=...)``
accumulates only into the tensors it names.

torch's engine answers "will this node run in the current graph task" for every node but one
kind: for the gradient accumulator of a leaf that ``torch.autograd.grad`` returns the gradient of,
it raises (the engine captures such gradients at their consumers instead of running the
accumulator), which made torch's own ``register_multi_grad_hook`` (``mode="all"``) raise over a
leaf input inside ``torch.autograd.grad``. The raise says exactly that the gradient is computed,
and not accumulated: :func:`computes_gradient` and :func:`accumulates_gradient` read it so.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.autograd.graph import Node, get_gradient_edge
from torch.utils.hooks import RemovableHandle

__all__ = ["gradient_node", "computes_gradient", "accumulates_gradient", "AllGradientsWatch"]


def _engine_runs(node: Node) -> bool:
    """Whether the current graph task runs ``node``; raises ``RuntimeError`` for the gradient
    accumulator of a leaf whose gradient ``torch.autograd.grad`` returns."""
    return bool(torch._C._will_engine_execute_node(node))


def gradient_node(tensor: torch.Tensor) -> Node:
    """The node that receives ``tensor``'s gradient: its ``grad_fn``, or a leaf's accumulator."""
    return get_gradient_edge(tensor).node


def computes_gradient(node: Node) -> bool:
    """Whether the current backward computes the gradient that ``node`` (a
    :func:`gradient_node`) receives, so that its tensor's hooks run."""
    try:
        return _engine_runs(node)
    except RuntimeError:  # a leaf torch.autograd.grad returns the gradient of
        return True


def accumulates_gradient(tensor: torch.Tensor) -> bool:
    """Whether the current backward accumulates into leaf ``tensor``'s ``.grad``: ``False``
    inside ``torch.autograd.grad`` (which returns gradients instead), and where the backward
    does not reach ``tensor`` or ``backward(inputs=...)`` leaves it out."""
    try:
        return _engine_runs(gradient_node(tensor))
    except RuntimeError:
        return False


class AllGradientsWatch:
    """Call ``callback()`` once the current backward has computed the gradient of every tensor
    in ``tensors`` that it computes at all: torch's ``register_multi_grad_hook(mode="all")``,
    which raises inside ``torch.autograd.grad`` when a tensor is a leaf.

    A hook on each tensor, counted per graph task (a nested backward, as reentrant checkpointing
    runs, counts apart from the one around it). The watch holds the tensors' gradient nodes, as
    torch's does: a cycle through C++ that the collector cannot see (node -> hook -> watch ->
    node), so :meth:`remove` the watch once the step is over; ``callback`` must not hold them.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], callback: Callable[[], None]) -> None:
        self._nodes = [gradient_node(t) for t in tensors]
        self._callback = callback
        self._left: dict[int, int] = {}  # graph task id -> gradients still to come
        self._handles: list[RemovableHandle] = [t.register_hook(self._arrived) for t in tensors]

    def _arrived(self, _grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        left = self._left.pop(task, None)
        if left is None:  # this backward's first: how many of the gradients it computes
            left = sum(map(computes_gradient, self._nodes))
        if left > 1:
            self._left[task] = left - 1
        else:
            self._callback()

    def remove(self) -> None:
        """Take the hooks off."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
