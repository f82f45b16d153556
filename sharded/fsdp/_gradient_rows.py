"""A unit's gradients for the reduce-scatter: the send buffer, packed per reduction, and reading
back the row this rank receives.

The buffer is rank-major like the all-gather's output (:mod:`._flat_buffers`): row ``r`` is what
rank ``r`` receives, and inside a row each trainable parameter has its padded slot, then one
"used" flag per parameter. Every rank writes its full gradient spread over the rows (zeros where
it has none) and a 1 in every row's flag for each gradient it has, so after averaging a flag is
positive exactly when some rank produced that gradient. A parameter no rank used then keeps
``grad = None``, as with DDP, instead of getting a zero gradient that would still move it
through momentum or weight decay. A 0-dim (replicated) parameter's gradient is written into
every row, so every rank receives the average. :meth:`GradientLayout.unpack` reads the row
this rank received back as one gradient shard per parameter; :func:`unpack_rows` reads every
row back into full tensors (what low-bit error feedback's residuals are per parameter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .._common.flat import column_blocks, used_anywhere, used_flags
from ._param import ShardedParam

__all__ = ["GradientLayout", "gradient_widths", "pack_gradients", "unpack_rows"]


@dataclass(frozen=True)
class GradientLayout:
    """Where :func:`pack_gradients` put each parameter's gradient: what reading back the row
    this rank receives needs."""

    params: list[ShardedParam]
    widths: list[int]  # each parameter's slot, then (``tail_align``) a gap, then the flags (one per parameter)
    had_grad: list[bool]  # which parameters this rank had a gradient for

    @property
    def tail_start(self) -> int:
        """Where a row's tail starts: the flags, or, with the tail aligned, the gap's last
        element right before them."""
        aligned = len(self.widths) > len(self.params) + 1
        return sum(self.widths[:-1]) - (1 if aligned else 0)

    @property
    def exact_numel(self) -> int:
        """A row's elements as the exact reduce-scatter packs it (no gap before the flags): what
        the bytes a low-bit row replaces are counted by."""
        return sum(self.widths[: len(self.params)]) + len(self.params)

    def unpack(self, received: torch.Tensor, every: bool) -> list[tuple[ShardedParam, torch.Tensor]]:
        """This rank's reduced row -> ``(parameter, its rows of the gradient)`` (views of
        ``received``) for each parameter some rank had a gradient for (``every``: for all)."""
        used = [True] * len(self.params) if every else self._used_anywhere(received)
        slots = received.split(self.widths)
        return [(sp, sp.real_rows(slot)) for sp, slot, is_used in zip(self.params, slots, used) if is_used]

    def _used_anywhere(self, received: torch.Tensor) -> list[bool]:
        """Which parameters got a gradient on some rank. Reading the flags costs a device sync,
        so they are read only when this rank lacked a gradient (else the answer is yes)."""
        if all(self.had_grad):
            return self.had_grad
        return used_anywhere(received[-len(self.params) :])


def pack_gradients(
    params: Sequence[ShardedParam],
    grads: Sequence[Optional[torch.Tensor]],
    world: int,
    allocate: Callable[[int], torch.Tensor],
    tail_align: int = 1,
) -> tuple[torch.Tensor, GradientLayout]:
    """The reduce-scatter's send buffer (from ``allocate(numel)``, in the reduce dtype) holding
    the full ``grads`` of ``params`` (``None`` where this rank has none) rank-major, and where
    they are. Each gradient is cast once, as it is copied in.

    ``tail_align > 1`` (a low-bit codec's block size): a zero gap before the flags, its last
    element at a multiple of ``tail_align`` in each row, so that a blockwise codec scales that
    element and the flags in blocks of their own, never beside the gradients
    (:mod:`._lowbit_reduce` uses the element as a sentinel)."""
    widths = gradient_widths(params, tail_align)
    sent = allocate(world * sum(widths))
    blocks = column_blocks(sent, world, widths)
    copies = _Copies()
    for sp, grad, block in zip(params, grads, blocks):
        _spread_rows(sp, grad, block, copies)
    if tail_align > 1:  # the gap
        copies.zero(blocks[-2])
    had_grad = [g is not None for g in grads]
    flags = used_flags(had_grad, sent.dtype, sent.device)
    copies.copy(blocks[-1], flags.view(1, -1).expand(world, -1))
    copies.run()
    return sent, GradientLayout(list(params), widths, had_grad)


def gradient_widths(params: Sequence[ShardedParam], tail_align: int = 1) -> list[int]:
    """The widths of a :func:`pack_gradients` row: each parameter's slot, then (``tail_align >
    1``) the gap, then the flags."""
    slots = [sp.geometry.slot_numel for sp in params]
    gap = [-sum(slots) % tail_align + 1] if tail_align > 1 else []
    return slots + gap + [len(params)]


def unpack_rows(params: Sequence[ShardedParam], packed: torch.Tensor, world: int, tail_align: int = 1) -> list[torch.Tensor]:
    """The inverse of :func:`pack_gradients`: each parameter's full tensor (its shape, fresh)
    from ``packed`` (``world`` rows of its layout). A parameter every row holds whole (a
    replicated scalar) gets the mean of the rows' copies."""
    blocks = column_blocks(packed, world, gradient_widths(params, tail_align))
    return [_gather_rows(sp, block) for sp, block in zip(params, blocks)]


def _gather_rows(sp: ShardedParam, block: torch.Tensor) -> torch.Tensor:
    g = sp.geometry
    if g.slot_numel == 0:
        return block.new_zeros(g.shape)
    if g.replicated:
        return block.mean(dim=0).reshape(g.shape)
    full = block.new_empty(g.shape)
    if g.dim != 0:
        g.by_rank(full).copy_(block.view(block.shape[0], *g.slot_shape))
        return full
    rows = block.reshape(block.shape[0] * g.rows_per_shard, g.row_numel)
    full.view(g.shape[0], g.row_numel).copy_(rows[: g.shape[0]])
    return full


class _Copies:
    """Copies and zero-fills gathered for two ``torch._foreach_*`` calls, not one kernel each."""

    def __init__(self) -> None:
        self.targets: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []
        self.zeros: list[torch.Tensor] = []

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        self.targets.append(target)
        self.sources.append(source)

    def zero(self, target: torch.Tensor) -> None:
        self.zeros.append(target)

    def run(self) -> None:
        torch._foreach_copy_(self.targets, self.sources)
        if self.zeros:
            torch._foreach_zero_(self.zeros)


def _spread_rows(sp: ShardedParam, grad: Optional[torch.Tensor], block: torch.Tensor, copies: _Copies) -> None:
    """Plan copying the full ``grad`` of ``sp`` into ``block`` (``world x slot``): rank ``r``'s
    rows into row ``r``, zeros in the padding (and everywhere if ``grad`` is ``None``)."""
    g = sp.geometry
    if grad is None or g.slot_numel == 0:
        copies.zero(block)
        return
    if g.replicated:
        copies.copy(block, grad.reshape(1, 1).expand(block.shape[0], 1))
        return
    if g.dim != 0:  # cut evenly on another dim: rank r's chunk of that dim into row r
        copies.copy(block.view(block.shape[0], *g.slot_shape), g.by_rank(grad))
        return
    world, per_rank = block.shape[0], g.rows_per_shard
    rows = block.view(world, per_rank, g.row_numel)
    flat_grad = grad.reshape(g.shape[0], g.row_numel)
    full_ranks, remainder = divmod(g.shape[0], per_rank)
    if full_ranks:
        copies.copy(rows[:full_ranks], flat_grad[: full_ranks * per_rank].view(full_ranks, per_rank, g.row_numel))
    if remainder:
        copies.copy(rows[full_ranks, :remainder], flat_grad[full_ranks * per_rank :])
        copies.zero(rows[full_ranks, remainder:])
        full_ranks += 1
    if full_ranks < world:
        copies.zero(rows[full_ranks:])
