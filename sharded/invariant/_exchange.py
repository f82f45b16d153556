"""The canonical tree's upper levels, across ranks.

Each rank holds the sum of its own subtree (an aligned block of micro-batches: a rank's block,
or at one time step the ranks' leaves side by side). Rank ``i`` of a group of ``W`` (a power of
two) holds block ``i``. A reduction that adds these in the canonical tree must not let the
collective choose the order, so the ranks *exchange* rather than reduce: one
``all_to_all_single`` gives every rank, for the part of the result it is to keep, the ``W``
blocks' values in rank order, and the rank adds them up the tree itself (:func:`start_exchange`).
That moves the bytes of a reduce-scatter ((W-1)/W of the data per rank). An all-reduce is that
plus an all-gather of the sums (:func:`all_reduce_canonically`); a sum across replica rows
(hybrid sharding) gathers the rows' sums and adds them up the tree on every rank
(:func:`sum_across_replicas`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .._common import comm
from ._tree import tree_sum

__all__ = ["PendingExchange", "start_exchange", "all_reduce_canonically", "sum_across_replicas"]


class PendingExchange:
    """An exchange in flight (:func:`start_exchange`); :meth:`sum` waits and adds up the tree."""

    def __init__(self, work: Optional[dist.Work], received: torch.Tensor, world: int, sent: Optional[torch.Tensor]) -> None:
        self._work = work
        self._received = received
        self._world = world
        self._sent = sent  # kept alive until the collective has read it

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work, self._sent = None, None

    def sum(self) -> torch.Tensor:
        """Wait; the canonical sum of what every rank sent this rank (a new tensor)."""
        self.wait()
        if self._world == 1:
            return self._received
        return tree_sum(self._received.view(self._world, -1))


def start_exchange(sent: torch.Tensor, splits: Sequence[int], receive_numel: int, group: comm.ProcessGroup) -> PendingExchange:
    """Collective, asynchronous: send rank ``d`` of ``group`` its piece of ``sent`` (pieces back to
    back, ``splits[d]`` elements for rank ``d``: nothing is copied to send them); every rank sends
    this rank ``receive_numel`` elements, which :meth:`PendingExchange.sum` adds up the tree in
    source rank order. ``sent`` is the exchange's until it is summed."""
    world = comm.group_size(group)
    if world == 1:
        return PendingExchange(None, sent.reshape(-1), 1, None)
    received = torch.empty(world * receive_numel, dtype=sent.dtype, device=sent.device)
    work = comm.all_to_all_single(received, sent, group, [receive_numel] * world, list(splits), async_op=True)
    return PendingExchange(work, received, world, sent)


def all_reduce_canonically(flat: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
    """Collective: the canonical sum over ``group`` of every rank's 1-D ``flat`` (rank ``i``
    holding block ``i``), on every rank: a new tensor of ``flat``'s length."""
    world = comm.group_size(group)
    if world == 1:
        return flat.clone()
    chunk = -(-flat.numel() // world)
    padded = flat if flat.numel() == world * chunk else torch.cat([flat, flat.new_zeros(world * chunk - flat.numel())])
    mine = start_exchange(padded, [chunk] * world, chunk, group).sum()
    gathered = torch.empty_like(padded)
    work = comm.all_gather_into_tensor(gathered, mine, group, async_op=False)
    if work is not None:
        work.wait()
    return gathered[: flat.numel()]


def sum_across_replicas(part: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
    """Collective over the replica group (hybrid sharding): every row's ``part``, added up the
    tree in row order, on every row (bytes: an all-gather of ``part``)."""
    rows = comm.group_size(group)
    if rows == 1:
        return part
    gathered = torch.empty(rows * part.numel(), dtype=part.dtype, device=part.device)
    work = comm.all_gather_into_tensor(gathered, part.reshape(-1), group, async_op=False)
    if work is not None:
        work.wait()
    return tree_sum(gathered.view(rows, part.numel()))
