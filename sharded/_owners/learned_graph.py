"""What the router learns from each synced backward: how often each gradient arrives, and, with
``static_graph``, which gradients some rank produces at all.

A parameter's gradient-ready hook fires once per backward pass that reaches it, and a backward
may contain nested ones (reentrant activation checkpointing runs one per checkpointed segment),
so a parameter shared by several segments fires several times. The router expects as many
arrivals as the previous backward had and treats the gradient as complete after that many; a
parameter that arrived zero times (unused) no longer holds its bucket back.

With ``static_graph`` (DDP's switch of that name) the first synced backward teaches the graph:
each parameter's count of arrivals, and which parameters some rank used (one all-reduce, once).
From then on the graph is fixed: the owner hands out the learned set instead of reading the
reduced 'used' flags, the ranks no longer agree on late gradients, and a backward that arrives
otherwise raises on the rank that sees it.
"""

from __future__ import annotations

import enum
from typing import Callable, Iterable, NoReturn, Sequence

import torch
import torch.distributed as dist

from .._common import comm
from .._common.errors import on_rank

__all__ = ["GraphState", "LearnedGraph"]


class GraphState(enum.Enum):
    """How far the router trusts the graph of the last backward."""

    DYNAMIC = "dynamic"  # no static_graph: learned anew from every synced backward
    LEARNING = "learning"  # static_graph: the first synced backward is being learned
    FIXED = "fixed"  # static_graph: learned; every later backward is checked against it


class LearnedGraph:
    """Expected arrivals per parameter index and, once fixed, the used set.

    Args:
        num_params: parameters the router numbers.
        static_graph: learn the first synced backward, then fix it.
        name_of: parameter index -> how errors name it.
        rank: this rank in the router's group, for error messages.
    """

    def __init__(self, num_params: int, static_graph: bool, name_of: Callable[[int], str], rank: int) -> None:
        self.expected = [1] * num_params
        self.state = GraphState.LEARNING if static_graph else GraphState.DYNAMIC
        self.used: list[bool] = []  # per index: some rank produced it in the first backward (FIXED)
        self._used_here: set[int] = set()  # indices this rank sent a gradient for (LEARNING)
        self._name_of = name_of
        self._rank = rank

    @property
    def is_fixed(self) -> bool:
        return self.state is GraphState.FIXED

    def note_sent(self, indices: Iterable[int]) -> None:
        """This rank sent gradients for ``indices`` in the backward being learned."""
        if self.state is GraphState.LEARNING:
            self._used_here.update(indices)

    def learn(self, arrivals: Sequence[int], group: comm.ProcessGroup) -> None:
        """After a synced backward: expect its arrivals next time; fix the graph after the first
        one with ``static_graph`` (collective then, once)."""
        self.expected = list(arrivals)
        if self.state is not GraphState.LEARNING:
            return
        used = torch.zeros(len(self.expected), dtype=torch.int32)
        used[list(self._used_here)] = 1
        used = used.to(comm.comm_device(group))
        comm.all_reduce(used, group, dist.ReduceOp.MAX)  # every rank learns the same set
        self.used = [bool(flag) for flag in used.tolist()]
        self._used_here = set()
        self.state = GraphState.FIXED

    def used_slots(self, members: Sequence[int]) -> list[bool]:
        """The learned used flags of a bucket's ``members`` (FIXED only)."""
        return [self.used[i] for i in members]

    # ---------------------------------------------------------------------- checks (FIXED)

    def check_arrivals(self, arrivals: Sequence[int]) -> None:
        """Every parameter arrived as often as in the first backward."""
        if list(arrivals) == self.expected:
            return
        index, (got, expected) = next(
            (i, pair) for i, pair in enumerate(zip(arrivals, self.expected)) if pair[0] != pair[1]
        )
        self._raise_changed(index, f"arrived {got} time(s) in this backward, {expected} in the first")

    def check_not_late(self, index: int) -> None:
        """A gradient arrived after its bucket left: no later pass reduces it once fixed."""
        if self.is_fixed:
            self._raise_changed(index, "arrived after its bucket had been reduced")

    def check_held(self, index: int) -> None:
        """A gradient held but never announced (``no_sync``, or set by hand) for a parameter the
        first backward left unused: the owner would drop it, since it no longer reads the flags."""
        if not self.used[index]:
            self._raise_changed(
                index, "is held (accumulated inside no_sync() or set by hand), but no rank produced it in the first synced backward"
            )

    def _raise_changed(self, index: int, what: str) -> NoReturn:
        raise RuntimeError(
            on_rank(
                f"the gradient of parameter {self._name_of(index)} {what}: "
                "the backward produced other gradients than the first one did. static_graph=True "
                "assumes the same gradients every iteration; construct ShardedDataParallel without it "
                "for a graph that changes",
                self._rank,
            )
        )
