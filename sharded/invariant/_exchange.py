"""The canonical tree's upper levels, across ranks.

Each rank holds the sum of its own subtree (an aligned block of micro-batches: a rank's block,
or at one time step the ranks' leaves side by side). Rank ``i`` of a group of ``W`` (a power of
two) holds block ``i``. A reduction that adds these in the canonical tree must not let the
collective choose the order, so the ranks *exchange* rather than reduce: one
``all_to_all_single`` gives every rank, for the part of the result it is to keep, the ``W``
blocks' values in rank order, and the rank adds them up the tree itself (:func:`exchange_and_sum`).
That moves the bytes of a reduce-scatter ((W-1)/W of the data per rank). An all-reduce is that
plus an all-gather of the sums (:func:`all_reduce_canonically`); a sum across replica rows
(hybrid sharding) gathers the rows' sums and adds them up the tree on every rank
(:func:`sum_across_replicas`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .._common import comm
from ._tree import tree_sum

__all__ = ["exchange_and_sum", "all_reduce_canonically", "sum_across_replicas"]


def exchange_and_sum(pieces: Sequence[torch.Tensor], receive_numel: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Collective: send ``pieces[d]`` (1-D) to rank ``d`` of ``group``; every rank sends this
    rank ``receive_numel`` elements, and their canonical sum (source rank order, up the tree) is
    returned: a new tensor."""
    world = comm.group_size(group)
    if world == 1:
        return pieces[0].reshape(-1).clone()
    sent = torch.cat([p.reshape(-1) for p in pieces])
    received = torch.empty(world * receive_numel, dtype=sent.dtype, device=sent.device)
    comm.all_to_all_single(received, sent, group, [receive_numel] * world, [p.numel() for p in pieces])
    return tree_sum(list(received.view(world, receive_numel)))


def all_reduce_canonically(flat: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Collective: the canonical sum over ``group`` of every rank's 1-D ``flat`` (rank ``i``
    holding block ``i``), on every rank: a new tensor of ``flat``'s length."""
    world = comm.group_size(group)
    if world == 1:
        return flat.clone()
    chunk = -(-flat.numel() // world)
    padded = torch.zeros(world * chunk, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    mine = exchange_and_sum(list(padded.view(world, chunk)), chunk, group)
    gathered = torch.empty_like(padded)
    work = comm.all_gather_into_tensor(gathered, mine, group, async_op=False)
    if work is not None:
        work.wait()
    return gathered[: flat.numel()]


def sum_across_replicas(part: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Collective over the replica group (hybrid sharding): every row's ``part``, added up the
    tree in row order, on every row (bytes: an all-gather of ``part``)."""
    rows = comm.group_size(group)
    if rows == 1:
        return part
    gathered = torch.empty(rows * part.numel(), dtype=part.dtype, device=part.device)
    work = comm.all_gather_into_tensor(gathered, part.reshape(-1), group, async_op=False)
    if work is not None:
        work.wait()
    return tree_sum(list(gathered.view(rows, part.numel())))
