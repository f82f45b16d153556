"""Averaged gradients an earlier reduce left in ``param.grad``, and a backward that adds to one.

After a reduce the owner holds the average of every rank's gradient and the other ranks have
released theirs. DDP keeps the average on every rank, so a backward that runs before the
gradients are zeroed (a second backward before the step, a loop that never zeroes, a second
optimizer stepping after the first one's closure ran backward again, a GAN's generator backward
reaching the critic's parameters) adds each rank's new gradient to it and all-reduces the sums:
old average + new average. Here only the owner holds the old average, so it must not be reduced
again: the other ranks cannot add their share of it. Instead, when autograd is about to add to
it (or a bucket is about to take it in), it is set aside; the new gradient starts afresh, is
reduced like any other, and the flush adds the average back on the owner. The result is old
average + new average, as DDP's, to summation order: DDP adds the old average on every rank
before its all-reduce, the owner adds it after the reduce, so the last bits may differ.

A zeroing voids an average set aside, as it would have voided DDP's sum: a gradient released
(``zero_grad()``, ``p.grad = None``) or zeroed in place (``zero_grad(set_to_none=False)``,
``p.grad.data.zero_()``) is no longer the one the average sits under. A zeroing before anything
was added leaves zeros, and setting zeros aside changes nothing. Local to the rank: no collective
except when a rebuilt router takes over (``refresh_trainable``).
"""

from __future__ import annotations

import enum
import functools
import weakref
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, cast

import torch

from .._common import comm

__all__ = ["HeldAverages"]


class Stage(enum.Enum):
    """Where the gradient added over an average set aside is."""

    AWAITING = "awaiting"  # set aside as autograd was about to add; not yet seen adding
    ON_TOP = "on_top"  # added, and waiting in ``param.grad`` (inside no_sync) for a reduce
    REDUCING = "reducing"  # in the reduce under way; the flush gives the average back


@dataclass
class _Aside:
    average: torch.Tensor
    stage: Stage
    on_top: Optional[weakref.ref[torch.Tensor]] = None  # ON_TOP: the gradient in param.grad (None: nothing yet)


class HeldAverages:
    """The averages this rank holds, by parameter index, and those set aside until a flush.

    Args:
        params: the router's parameters, by index.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._params = params
        # Weak: an average released (zero_grad()) frees its bucket at once, and leaves the map.
        self._averages: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._asides: dict[int, _Aside] = {}

    def holds_average(self, index: int) -> bool:
        """Whether parameter ``index``'s gradient is the average the last flush left there."""
        grad = self._params[index].grad
        return grad is not None and self._averages.get(index) is grad

    # -------------------------------------------------------------------- autograd's hooks

    def before_accumulate(self, index: int) -> None:
        """Autograd is about to add to parameter ``index``'s gradient: set an average aside.

        ``torch.autograd.grad`` fires this hook too but adds nothing, so the average goes back
        at the end of that backward unless :meth:`after_accumulate` saw an addition.
        """
        if not (self._averages or self._asides):
            return  # the usual loop: every average was released by zero_grad()
        self._drop_if_voided(index)
        if self.holds_average(index):
            self._set_aside(index, Stage.AWAITING)
            callback = functools.partial(self._restore_if_nothing_added, index)
            torch.autograd.Variable._execution_engine.queue_callback(callback)

    def after_accumulate(self, index: int, synced: bool) -> None:
        """Autograd added to parameter ``index``'s gradient; ``synced``: in a reducing backward."""
        aside = self._asides.get(index)
        if aside is None or aside.stage is Stage.REDUCING:
            return
        if synced:
            aside.stage, aside.on_top = Stage.REDUCING, None
        else:
            aside.stage, aside.on_top = Stage.ON_TOP, weakref.ref(cast(torch.Tensor, self._params[index].grad))

    def restore_awaiting(self) -> None:
        """Give back the averages a backward that died (raised) set aside and never added to."""
        for index in [i for i, aside in self._asides.items() if aside.stage is Stage.AWAITING]:
            self._give_back(index)

    def _restore_if_nothing_added(self, index: int) -> None:
        aside = self._asides.get(index)
        if aside is not None and aside.stage is Stage.AWAITING:
            self._give_back(index)

    # ---------------------------------------------------------------------------- the flush

    def set_aside_if_average(self, index: int) -> bool:
        """A bucket would take parameter ``index``'s held gradient: if it is an average (already
        reduced), set it aside instead and return True."""
        self._drop_if_voided(index)
        if not self.holds_average(index):
            return False
        self._set_aside(index, Stage.REDUCING)
        return True

    def joins_reduce(self, index: int) -> None:
        """A bucket took parameter ``index``'s held gradient (added over an average set aside)."""
        aside = self._asides.get(index)
        if aside is not None:
            aside.stage, aside.on_top = Stage.REDUCING, None

    def after_flush(self, handed_out: Iterable[int]) -> None:
        """The reduce is over: add each average set aside to what it handed out (or put it back
        where nothing was), then remember the averages this rank now holds."""
        given_back = list(self._asides)
        for index in given_back:
            self._give_back(index)
        self._averages.clear()
        for index in (*handed_out, *given_back):
            grad = self._params[index].grad
            if grad is not None:
                self._averages[index] = grad

    # ------------------------------------------------------------------------------ helpers

    def _set_aside(self, index: int, stage: Stage) -> None:
        param = self._params[index]
        self._asides[index] = _Aside(cast(torch.Tensor, param.grad), stage)
        param.grad = None

    def _give_back(self, index: int) -> None:
        average = self._asides.pop(index).average
        param = self._params[index]
        if param.grad is None:
            param.grad = average
        else:
            param.grad.add_(average)

    def _drop_if_voided(self, index: int) -> None:
        """Forget an average set aside under a gradient that waits in ``param.grad`` (inside
        no_sync) once that gradient was released, replaced or zeroed. Values, not version
        counters: ``p.grad.data.zero_()`` changes none."""
        aside = self._asides.get(index)
        if aside is None or aside.stage is not Stage.ON_TOP:
            return
        grad = self._params[index].grad
        if aside.on_top is None:  # nothing was added since: a gradient set by hand replaces it
            voided = grad is not None
        else:  # released, replaced, or zeroed in place
            voided = grad is None or aside.on_top() is not grad or not bool(cast(torch.Tensor, grad).any())
        if voided:
            del self._asides[index]

    # --------------------------------------------------------------------- a rebuilt router

    def carry_from(self, old: HeldAverages, owner_of: dict[torch.Tensor, int], group: comm.ProcessGroup) -> None:
        """Take over what ``old`` (the part of the router this one replaces) knew. Collective.

        Each rank keeps its own records for the parameters it still routes. Where a parameter
        changed owner, the new owner learns that the gradient ``OSS`` moved to it is an average,
        and receives the average set aside under a gradient accumulating inside ``no_sync``.
        """
        rank = comm.group_rank(group)
        index_of = {p: i for i, p in enumerate(self._params)}
        outgoing: dict[int, dict[int, Optional[torch.Tensor]]] = {}
        for old_index in [i for i in old._averages.keys() if old.holds_average(i)]:
            param = old._params[old_index]
            if param in index_of:
                self._averages[index_of[param]] = cast(torch.Tensor, param.grad)
                if owner_of[param] != rank:
                    outgoing.setdefault(owner_of[param], {})[index_of[param]] = None
        for old_index, aside in old._asides.items():
            param = old._params[old_index]
            if param not in index_of:
                continue
            if owner_of[param] == rank:
                self._asides[index_of[param]] = aside
            else:
                outgoing.setdefault(owner_of[param], {})[index_of[param]] = aside.average
        for moved in comm.exchange_objects(outgoing, group).values():
            for index, average in moved.items():
                self._adopt(index, average)

    def _adopt(self, index: int, average: Optional[torch.Tensor]) -> None:
        """A parameter that moved here: its held gradient is an average (``average`` None), or
        ``average`` was set aside under what it holds."""
        grad = self._params[index].grad
        if average is None:
            if grad is not None:
                self._averages[index] = grad
            return
        on_top = weakref.ref(grad) if grad is not None else None
        self._asides[index] = _Aside(average.to(self._params[index].device), Stage.ON_TOP, on_top)
