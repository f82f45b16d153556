"""Manual backward finalization: its mode, and the handle of a finalization left in flight.

By default the end of backward (the root's autograd-engine callback) sends every gradient not
yet sent, waits for every reduction and returns the units to rest. With manual finalization
(``set_manual_backward_finalization(True)`` on the root, torch 2.15's ``FSDPModule`` API) the
callback only keeps locally what was not sent, as with gradient sync off, and leaves the
reductions in flight; the caller finalizes when its logical backward is over (a pipeline
schedule, after its last microbatch): ``finalize_backward()`` sends what the units kept, as
gradient sync and resharding are set at that moment, and waits for every reduction, at once or,
with ``async_op=True``, when the :class:`GradientReductionHandle` it returns is waited on.

torch 2.15 added this API; sharded offers it with the same semantics on every torch it supports.
Where torch has ``torch.distributed.fsdp.GradientReductionHandle``, ours is an instance of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed.fsdp as torch_fsdp

from .._common.errors import on_rank

__all__ = ["FinalizationMode", "GradientReductionHandle", "in_autograd_backward"]

# torch 2.15 exports the handle's type (pipelining annotates with it); earlier torches have none
_TorchHandle: Any = getattr(torch_fsdp, "GradientReductionHandle", object)


class GradientReductionHandle(_TorchHandle):  # type: ignore[misc]
    """Returned by ``finalize_backward(async_op=True)``: :meth:`wait` waits for the gradient
    reductions that finalization started or left in flight, lands them in ``.grad`` and ends the
    backward iteration. Wait before reading the gradients and before the model's next forward
    or finalization (both raise until then). ``reset_iter_state()`` invalidates a pending
    handle: its :meth:`wait` then raises ``RuntimeError``."""

    def __init__(self, finish: Optional[Callable[[], None]] = None) -> None:
        self._finish = finish

    def wait(self) -> None:
        """Wait for the gradient reductions and release what they hold (a second call does
        nothing)."""
        if self._finish is not None:
            self._finish()
            self._finish = None


@dataclass
class FinalizationMode:
    """A model's finalization mode, shared by its units (in their step context).

    ``enabled``: what ``set_manual_backward_finalization`` last set. ``active``: the mode the
    running backward iteration started in (``None`` between iterations): it holds until the
    iteration is finalized or reset, whatever is set meanwhile. ``pending``: the token of an
    asynchronous finalization not yet waited for.
    """

    enabled: bool = False
    active: Optional[bool] = None
    pending: Optional[object] = None

    @property
    def manual(self) -> bool:
        """Whether the current iteration (or, between iterations, the next) is finalized by hand."""
        return self.enabled if self.active is None else self.active

    def begin_backward(self) -> None:
        """A backward starts: the mode in force now holds for the iteration."""
        if self.active is None:
            self.active = self.enabled

    def set(self, enabled: bool) -> None:
        """``set_manual_backward_finalization(enabled)``: refused inside a backward and, until
        the iteration ends, once a backward started it in the other mode."""
        enabled = bool(enabled)
        if enabled != self.enabled and in_autograd_backward():
            raise RuntimeError(on_rank("set_manual_backward_finalization cannot change mode during backward"))
        if self.active is not None and enabled != self.active:
            raise RuntimeError(on_rank(
                "set_manual_backward_finalization cannot change mode after backward starts: call "
                "finalize_backward() (or reset_iter_state()) first"
            ))
        self.enabled = enabled

    def end_iteration(self) -> None:
        """The iteration was finalized or reset: the next backward takes the mode then in force."""
        self.active = None
        self.pending = None


def in_autograd_backward() -> bool:
    """Whether the calling thread is inside an autograd backward (any graph's)."""
    return torch._C._current_graph_task_id() != -1
