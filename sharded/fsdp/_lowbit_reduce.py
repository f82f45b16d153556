"""ZeRO-3's gradient reduce-scatter in fewer bits: ``fully_shard(lowbit=LowBit(grads=...))``.

A unit's packed gradients (:func:`._gradient_rows.pack_gradients`: ``W`` rows, row ``r`` what rank
``r`` keeps) go through the wire's reduce-scatter (:meth:`LowBitWire.reduce_scatter`): every row
is encoded in the policy's format, under error feedback with this rank's residual for that row
(keyed ``<unit's module path> (<n> params, <checksum>)[r]``: a rebuilt model finds its residuals again, a row holding other parameters does not take them), exchanged
all-to-all, decoded and summed in float32 in rank order on the receiver: ZeRO++'s qgZ in one hop.
What follows is the exact path's: the op its reduce-scatter would have applied (``AVG``: the
float32 sum divided by ``W``; the pre- and post-division of ``gradient_divide_factor`` and
``force_sum_reduction`` around it, as :mod:`._reduce_ops` plans them), the cast to the reduce
dtype, and the shards added to ``.grad``.

The bound: each element of the shard gradient delivered is within ``(1/W) * sum over senders of
their codec's error_bound`` of the exact average of what they sent (scaled as the plan scales,
and up to float32's and the reduce dtype's rounding of that average); what they sent is their
gradient plus their residual under error feedback.

The row's tail: the "used" flags start a block of their own, after a sentinel element
(``pack_gradients(tail_align=block_size)``). A flag beside large gradients would round to zero
(int8 keeps 1 only beside values under 254), and the parameter's gradient would be dropped as
unused. The sentinel is NaN in every row a rank sends when its gradients hold an inf or NaN, so
every rank receives a non-finite tail block, not only the rank whose shard holds the bad block:
each rank tells the wire's error feedback, which drops its residuals at the end of that step
(the gradient scaler skips it; :meth:`ErrorFeedback.end_step`). Flags a non-finite block hid
count as used: the gradients land, non-finite, for the scaler to see.

Residuals are saved per message (a resume at the same world size sends the same bits) and, for
another world size, per parameter (:func:`residuals_by_param`: what this rank's residuals add to
each parameter's reduced gradient, the plan's division applied). A rank given such residuals
carries them (:func:`carry_residuals`) until its unit's next low-bit reduce-scatter spreads them
over its rows, divided back into what that reduction sends.

At one rank the row still goes through the codec (the wire's reduce-scatter decodes its own
message), so a world of one rounds as every other world does.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .._common.errors import on_rank
from .._common.lowbit import Codec, LowBitWire, Pending
from ._collectives import PendingReduceScatter, start_reduce_scatter
from ._gradient_rows import GradientLayout, gradient_widths, pack_gradients, unpack_rows
from ._param import ShardedParam
from ._reduce_ops import DivisionPlan
from ._settings import UnitSettings

__all__ = [
    "GradientWire", "LowBitReduceScatter", "carry_residuals", "delivered_scale", "refuse_with_low_bit_grads", "residuals_by_param",
    "row_key", "start_gradient_reduce_scatter",
]

COLLECTIVE = "reduce_scatter"


def row_key(unit_name: str, trainable: Sequence[ShardedParam]) -> str:
    """What a unit's rows' residuals are kept under: its path and a checksum of the parameters
    in the row (a row of the same length holding other parameters never takes them)."""
    digest = zlib.crc32("\n".join(sp.fqn for sp in trainable).encode())
    return f"{unit_name} ({len(trainable)} params, {digest:08x})"


def delivered_scale(plan: DivisionPlan, world: int) -> float:
    """What one unit of a sent value adds to the shard gradient delivered: ``1/world`` under
    ``AVG``, then the plan's division after the collective."""
    scale = 1.0 / world if plan.scatter_op == dist.ReduceOp.AVG else 1.0
    return scale / plan.post_divide if plan.post_divide is not None else scale


class GradientWire:
    """What a unit's reduction needs of its low-bit wire: the wire, and the unit's name (the
    message name its residuals are kept under)."""

    def __init__(self, wire: LowBitWire, unit_name: str, row_key: Optional[str] = None) -> None:
        self.wire, self.unit_name = wire, unit_name
        self.row_key = row_key or unit_name  # what the residuals are kept under (the unit and its row's parameters)

    @property
    def sends_grads(self) -> bool:
        """Whether the policy sends gradients in fewer bits (else only its byte counts apply)."""
        return self.wire.policy.grads is not None

    @property
    def tail_align(self) -> int:
        """The alignment of a row's tail for :func:`._gradient_rows.pack_gradients`."""
        return self.wire.policy.block_size

    def count_exact(self, sent: torch.Tensor, world: int, row_numel: Optional[int] = None) -> None:
        """Count the bytes of a reduce-scatter of ``sent`` (``world`` rows of ``row_numel``
        elements as the exact path packs them; default: as ``sent`` has them) that goes exact."""
        self.wire.count_exact(COLLECTIVE, row_numel or sent.numel() // world, sent.dtype, world - 1)


class LowBitReduceScatter:
    """A low-bit reduce-scatter in flight; :meth:`wait` returns this rank's row as the exact
    reduce-scatter would (the same op applied, in the reduce dtype), as :class:`PendingReduceScatter`."""

    def __init__(self, pending: Pending, sentinel: int, average_over: Optional[int], dtype: torch.dtype, wire: LowBitWire) -> None:
        self._pending, self._sentinel, self._average_over = pending, sentinel, average_over
        self._dtype, self._wire = dtype, wire
        self._row: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        if self._row is None:
            total = self._pending.wait()
            assert total is not None  # a reduce-scatter delivers to every rank
            self._row = _as_exact_would(total, self._sentinel, self._average_over, self._dtype, self._wire)
            self._pending = None  # type: ignore[assignment]  # its buffers go now, not with the reduction
        return self._row


def _as_exact_would(total: torch.Tensor, sentinel: int, average_over: Optional[int], dtype: torch.dtype, wire: LowBitWire) -> torch.Tensor:
    """The float32 sum ``total`` as the exact reduce-scatter delivers it: the tail read (a
    non-finite sentinel noted, hidden flags counted as used), averaged if ``AVG``, cast."""
    tail = total[sentinel:]
    finite = torch.isfinite(tail)
    wire.feedback.note_non_finite(~finite[0])
    tail.masked_fill_(~finite, 1.0)
    if average_over is not None:
        total.div_(average_over)
    return total.to(dtype)


def refuse_with_low_bit_grads(what: str, settings: UnitSettings, unit_name: str) -> None:
    """Refuse ``what`` (a user's reduce-scatter, a separate reduce-scatter group) for a unit
    whose gradients go in fewer bits: the wire runs their all-to-all on the shard group."""
    if settings.lowbit is not None and settings.lowbit.grads is not None:
        raise ValueError(on_rank(
            f"{what} on fully_shard({unit_name}): its lowbit={settings.lowbit!r} sends the gradients in low bits "
            f"through its own all-to-all on the shard group; apply fully_shard with LowBit(grads=None) to use {what}"
        ))


def start_gradient_reduce_scatter(
    lowbit: GradientWire, sent: torch.Tensor, layout: GradientLayout, plan: DivisionPlan, group: dist.ProcessGroup, world: int,
) -> Union[LowBitReduceScatter, PendingReduceScatter]:
    """Start reducing the packed, scaled ``sent`` (``world`` rows as ``layout`` says, packed
    with ``tail_align=lowbit.tail_align``, the sentinel at ``layout.tail_start``) over
    ``group``: in the policy's format, or exact where the row cannot take it (a fallback,
    counted or raised); its bytes counted either way."""
    wire, rows = lowbit.wire, sent.view(world, -1)
    codec = wire.codec("grads", COLLECTIVE, lowbit.unit_name, rows[0])
    if codec is None:
        lowbit.count_exact(sent, world, layout.exact_numel)
        return start_reduce_scatter(sent, group, world, plan.scatter_op)
    _spread_carried(lowbit, layout, delivered_scale(plan, world), world)
    return _start_low_bit(wire, codec, lowbit.row_key, rows, layout, plan, world)


def _spread_carried(lowbit: GradientWire, layout: GradientLayout, scale: float, world: int) -> None:
    """Fold the residuals carried for the row's parameters into the rows' residuals, as what
    this reduction sends (divided by ``scale``); the tail carries none."""
    feedback = lowbit.wire.feedback
    carried = feedback.take_carried(layout.params)
    if not carried:
        return
    device = next(iter(carried.values())).device
    fulls = [carried[sp] / scale if sp in carried else None for sp in layout.params]
    rows, _ = pack_gradients(layout.params, fulls, world, lambda n: torch.zeros(n, dtype=torch.float32, device=device),
                             tail_align=lowbit.tail_align)
    rows = rows.view(world, -1)
    rows[:, layout.tail_start:] = 0
    for r in range(world):
        feedback.add(f"{lowbit.row_key}[{r}]", rows[r].clone())


def residuals_by_param(unit: Any) -> dict[ShardedParam, torch.Tensor]:
    """What this rank's residuals for ``unit``'s rows add to each trainable parameter's reduced
    gradient (its full shape, float32), and those it carries; empty without low-bit gradients
    under error feedback."""
    wire = unit.lowbit_wire
    if wire is None or wire.policy.grads is None or not wire.policy.error_feedback:
        return {}
    trainable = [sp for sp in unit.params if sp.requires_grad and sp.owner is None]
    found: dict[ShardedParam, torch.Tensor] = {}
    residuals, key = wire.feedback.state_dict(), row_key(unit.module_name, trainable)
    if trainable and any(f"{key}[{r}]" in residuals for r in range(wire.world)):
        scale = delivered_scale(unit.reducer.division_plan(unit.reduce_dtype_for(trainable, [None] * len(trainable))), wire.world)
        width, device = sum(gradient_widths(trainable, wire.policy.block_size)), unit.mesh_info.device
        rows = torch.stack([_row(residuals.get(f"{key}[{r}]"), width, device) for r in range(wire.world)])
        for sp, full in zip(trainable, unpack_rows(trainable, rows, wire.world, wire.policy.block_size)):
            found[sp] = full * scale
    for sp, residual in wire.feedback.carried.items():
        if any(sp is p for p in unit.params):
            found[sp] = found[sp] + residual if sp in found else residual
    return found


def carry_residuals(unit: Any, by_param: dict[ShardedParam, torch.Tensor]) -> None:
    """Give ``unit`` residuals per parameter (:func:`residuals_by_param`'s form) to spread over
    its rows at its next low-bit reduce-scatter."""
    wire = unit.lowbit_wire
    if wire is not None and by_param:
        wire.feedback.carry(dict(by_param))


def _row(residual: Optional[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    if residual is None or residual.numel() != width:
        return torch.zeros(width, dtype=torch.float32, device=device)
    return residual.float().to(device)


def _start_low_bit(wire: LowBitWire, codec: Codec, name: str, rows: torch.Tensor, layout: GradientLayout, plan: DivisionPlan,
                   world: int) -> LowBitReduceScatter:
    sentinel = layout.tail_start
    low, high = torch.aminmax(rows)
    rows[:, sentinel] = low.float() * 0 + high.float() * 0  # NaN exactly when some value is inf or NaN
    pending = wire.reduce_scatter(codec, name, rows.reshape(-1), checked_numel=sentinel, exact_numel=layout.exact_numel)
    average_over = world if plan.scatter_op == dist.ReduceOp.AVG else None
    return LowBitReduceScatter(pending, sentinel, average_over, rows.dtype, wire)

