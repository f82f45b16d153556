"""Gradients no reduce bucket can carry: sparse ones, and ones that carry a graph
(``backward(create_graph=True)``). Refused with an error naming the parameter and the rank,
before any collective, so every rank raises instead of some hanging.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .._common.errors import on_rank

__all__ = ["GradChecks"]


class GradChecks:
    """Notes unreducible gradients as they arrive and raises before they would be reduced.

    A synced backward raises at once, from the hook; one inside ``no_sync`` leaves it to the next
    forward or ``reduce()`` (:meth:`check_held`). Gradients set by hand are checked where a bucket
    takes them in (:meth:`check`). One rank has no hooks: every held gradient is looked at.

    Args:
        params: the router's parameters, by index.
        name_of: parameter index -> how errors name it.
        rank: this rank in the router's group, for error messages.
        hooked: whether the router's hooks report arrivals (more than one rank).
    """

    def __init__(self, params: Sequence[torch.Tensor], name_of: Callable[[int], str], rank: int, hooked: bool) -> None:
        self._params = params
        self._name_of = name_of
        self._rank = rank
        self._hooked = hooked
        self._unreducible: set[int] = set()  # indices whose hook saw a sparse or graph-carrying gradient

    def note_arrival(self, index: int, grad: torch.Tensor, raise_now: bool) -> None:
        """A hook saw ``grad``: remember it if unreducible, and raise now if ``raise_now``."""
        if grad.is_sparse or grad.requires_grad:
            self._unreducible.add(index)
            if raise_now:
                self.check(index, grad)

    def check_held(self) -> None:
        """Raise, before any collective, for a held gradient that no reduce could carry."""
        indices = sorted(self._unreducible) if self._hooked else range(len(self._params))
        for index in indices:
            grad = self._params[index].grad
            if grad is not None:
                self.check(index, grad)
        self._unreducible.clear()  # only once none raised: a held one raises again next time

    def check(self, index: int, grad: torch.Tensor) -> None:
        """Raise if ``grad`` (parameter ``index``'s) cannot be reduced."""
        if grad.is_sparse:
            raise RuntimeError(
                on_rank(
                    f"parameter {self._name_of(index)} got a sparse gradient; "
                    "ShardedDataParallel reduces dense gradients only. Use sparse=False on the "
                    "embedding, or DistributedDataParallel for sparse gradients",
                    self._rank,
                )
            )
        if grad.requires_grad:
            raise RuntimeError(
                on_rank(
                    f"the gradient of parameter {self._name_of(index)} requires grad "
                    "(backward with create_graph=True): ShardedDataParallel cannot reduce a "
                    "gradient that carries a graph. Use torch.autograd.grad for higher-order "
                    "terms, or DistributedDataParallel",
                    self._rank,
                )
            )
