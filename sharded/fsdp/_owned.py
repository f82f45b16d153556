"""A unit's owner-placed parameters (``sharded.fsdp.Owned``): their storage, their gather and
their gradients' reduction.

Each such parameter is held whole by its owner (a rank of the shard group), in the owner's flat
buffer of the unit's owned parameters, and gathered by one broadcast per owner into the unit's
unsharded buffer for them, which holds every owned parameter back to back, grouped by owner:
each broadcast lands in place, in its owner's region, so nothing is copied out. Backward's
gradients go the other way: per owner, one buffer of its parameters' full gradients (zeros where
this rank has none) and one "used" flag per parameter, reduced onto the owner, who alone lands
them in ``.grad``. On a hybrid mesh every replica row does the same within itself, then the
owners average across the rows.

:class:`OwnedGather` is the :class:`._gather.ParamGather` of these parameters; the unit gathers
them beside its flat buffers. :func:`start_owned_reduction` is the reduction's mirror image,
scaled by the unit's :class:`._reduce_ops.DivisionPlan` exactly as its reduce-scatter is, so a
gradient reduced to its owner has the bits a reduce-scatter would give it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .._common import comm
from .._common.errors import on_rank
from .._common.flat import is_view_of, offsets_of, pack_with_used_flags, used_anywhere
from ._flat_buffers import BufferPlacement, check_materialised, ensure_allocated, release
from ._gather import GatherRoute
from ._param import ShardedParam
from ._placement.secondary_shard import SecondaryShardGroup
from ._reduce_ops import DivisionPlan

__all__ = ["OwnedGather", "OwnedReduction", "start_owned_reduction"]

# (parameter, its reduced gradient) for each owned parameter this rank lands
Landed = list[tuple[ShardedParam, torch.Tensor]]


class OwnedGather:
    """The owner-placed parameters of one unit, held whole by their owners and broadcast from
    them before the unit computes.

    Args:
        params: the unit's owner-placed parameters, in the unit's order.
        shard_rank: this rank in the shard group.
        world: the shard group's size.
        placement: where the owned values and the gathered parameters live, in which dtypes.
    """

    def __init__(self, params: Sequence[ShardedParam], shard_rank: int, world: int, placement: BufferPlacement) -> None:
        self.params = list(params)
        self.shard_rank = shard_rank
        self.world = world
        self.placement = placement
        self.compute_device = placement.compute_device
        self.by_owner = sorted(self.params, key=lambda sp: _owner(sp))  # the unsharded buffer's order
        self.mine = [sp for sp in self.by_owner if sp.owner == shard_rank]
        self._starts = offsets_of([sp.geometry.numel for sp in self.by_owner])
        self._regions = _regions_by_owner(self.by_owner, self._starts)
        self.owned_flat = torch.empty(0)  # this rank's owned values, back to back
        self._unsharded_flat: Optional[torch.Tensor] = None
        self._unsharded_key: tuple = ()
        self._pending: list[dist.Work] = []

    @property
    def dtype(self) -> torch.dtype:
        return self.owned_flat.dtype

    # -------------------------------------------------------------------- owned values

    def shard_from_full(self, fulls: Sequence[torch.Tensor]) -> None:
        """Keep this rank's owned parameters whole (meta ones unallocated); the others get an
        empty local tensor, as DTensor gives a rank outside their mesh."""
        full_of = {id(sp): full for sp, full in zip(self.params, fulls)}
        on_meta = any(full.is_meta for full in fulls)
        dtype = fulls[0].dtype if fulls else torch.float32
        device = torch.device("meta") if on_meta else self.placement.rest_device(self.compute_device)
        flat = self._new_flat(dtype, device)
        for sp, slot in zip(self.mine, self._slots(flat)):
            full = full_of[id(sp)]
            if not on_meta:
                sp.real_rows(slot).copy_(full.detach())
            sp.attach_shard(slot, requires_grad=full.requires_grad)
        for sp in self.params:
            if sp.owner != self.shard_rank:
                sp.attach_local(torch.empty(0, dtype=dtype, device=device), requires_grad=full_of[id(sp)].requires_grad)
        self.owned_flat = flat

    def _ensure_values_current(self, where: str) -> None:
        """Repack if an owned parameter's local tensor no longer views its slot (``to_empty``,
        ``module.to(...)`` or an assignment gave it new storage)."""
        locals_ = [sp.local_shard() for sp in self.mine]
        if all(is_view_of(local, sp.real_rows(slot)) for sp, local, slot in zip(self.mine, locals_, self._slots(self.owned_flat))):
            return
        check_materialised(self.mine, locals_, where)
        dtype = locals_[0].dtype if locals_ else self._dtype_of_others()
        flat = self._new_flat(dtype, self.placement.rest_device(self.compute_device))
        for sp, local, slot in zip(self.mine, locals_, self._slots(flat)):
            sp.real_rows(slot).copy_(local)
            sp.attach_shard(slot, requires_grad=sp.requires_grad)
        self.owned_flat = flat

    def _dtype_of_others(self) -> torch.dtype:
        """The dtype of the owned parameters this rank does not hold (a DTensor keeps it)."""
        return self.params[0].sharded.dtype

    def _new_flat(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.placement.new_rest_buffer(sum(sp.geometry.numel for sp in self.mine), dtype, device)

    def _slots(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(flat.split([sp.geometry.numel for sp in self.mine]))

    # -------------------------------------------------------------------------- gather

    def prepare(self, where: str) -> None:
        """Repack the owned values if they moved; (re)build the unsharded parameters if needed."""
        self._ensure_values_current(where)
        self._prepare_unsharded()

    def start(self, route: GatherRoute) -> None:
        """Broadcast each owner's region of the unsharded buffer from it, in owner order (a
        custom all-gather never applies: ``set_custom_all_gather`` refuses a unit with owned
        parameters)."""
        if self.aliases_values:
            return
        self._allocate_unsharded()
        flat = self._unsharded_buffer()
        if self.shard_rank in self._regions:
            begin, end = self._regions[self.shard_rank]
            flat[begin:end].copy_(self.owned_flat.to(flat.device, non_blocking=True))
        if route.world == 1:
            return
        for owner, (begin, end) in self._regions.items():
            self._pending.append(_started(comm.broadcast(flat[begin:end], owner, route.group, async_op=True)))

    def finish(self, keep_secondary: Optional[SecondaryShardGroup]) -> None:
        """Wait for the broadcasts (owned parameters keep no secondary shard: they are gathered
        from their owners every time)."""
        while self._pending:
            self._pending.pop(0).wait()

    def discard(self) -> None:
        self.finish(None)

    def free(self) -> None:
        """Free the unsharded buffer's storage (its tensors stay, for the next gather)."""
        if not self.aliases_values and self._unsharded_flat is not None:
            release(self._unsharded_flat)

    def full_copies(self, route: GatherRoute, where: str) -> list[torch.Tensor]:
        """Collective: fresh full copies in the values' dtype, broadcast from their owners."""
        self._ensure_values_current(where)
        flat = torch.empty(sum(sp.geometry.numel for sp in self.by_owner), dtype=self.dtype, device=self.compute_device)
        if self.shard_rank in self._regions:
            begin, end = self._regions[self.shard_rank]
            flat[begin:end].copy_(self.owned_flat)
        for owner, (begin, end) in self._regions.items() if route.world > 1 else ():
            comm.broadcast(flat[begin:end], owner, route.group, async_op=False)
        copies = {id(sp): flat[s : s + sp.geometry.numel].view(sp.geometry.shape) for sp, s in zip(self.by_owner, self._starts)}
        return [copies[id(sp)] for sp in self.params]

    # ---------------------------------------------------------------------- unsharded

    @property
    def aliases_values(self) -> bool:
        """One rank in the shard group, in the compute dtype and device: the unsharded parameters
        view the owned values themselves (nothing to broadcast; with more ranks every rank takes
        part in every broadcast, the owner too)."""
        return self.placement.gathers_nothing(self.world, self.owned_flat)

    @property
    def unsharded_dtype(self) -> torch.dtype:
        return self.placement.gathered_dtype(self.owned_flat)

    def _prepare_unsharded(self) -> None:
        key = (self.unsharded_dtype, self.owned_flat.device, self.aliases_values and self.owned_flat.data_ptr())
        if key == self._unsharded_key:
            return
        self._unsharded_key = key
        if self.aliases_values:
            flat, starts = self.owned_flat, offsets_of([sp.geometry.numel for sp in self.mine])
        else:
            flat = torch.empty(sum(sp.geometry.numel for sp in self.by_owner), dtype=self.unsharded_dtype, device=self.compute_device)
            starts = self._starts
        for sp, start in zip(self.by_owner, starts):
            full = flat[start : start + sp.geometry.numel].view(sp.geometry.shape)
            sp.unsharded = nn.Parameter(full, requires_grad=sp.requires_grad)
        self._unsharded_flat = flat
        self.free()

    def _unsharded_buffer(self) -> torch.Tensor:
        """The unsharded buffer through an alias with its own version counter: refills are
        invisible to autograd, which saved the parameters viewing it."""
        if self._unsharded_flat is None:
            raise RuntimeError("owned parameters gathered before their unsharded buffer was built")
        return self._unsharded_flat.data

    def _allocate_unsharded(self) -> None:
        if self._unsharded_flat is not None:
            ensure_allocated(self._unsharded_flat)


@dataclass
class _OwnerSend:
    """One owner's gradients on their way to it."""

    owner: int
    params: list[ShardedParam]
    sent: torch.Tensor  # their full gradients back to back, then one "used" flag each
    had_grad: list[bool]
    work: Optional[dist.Work]


class OwnedReduction:
    """The owned parameters' gradients of one backward in flight: reduced onto their owners
    (then, on a hybrid mesh, averaged across the owners of the replica rows); :meth:`finish`
    lands on this rank the gradients it owns.

    Args:
        sends: one per owner, started.
        plan: the unit's division plan (the same scaling as its reduce-scatter's).
        shard_rank: this rank in the shard group.
        replicate_group: hybrid sharding: the group across replica rows.
        land_unused: land zeros, not ``None``, for parameters no rank used.
        land: the writer of ``param.grad``.
    """

    def __init__(
        self,
        sends: list[_OwnerSend],
        plan: DivisionPlan,
        shard_rank: int,
        replicate_group: Optional[dist.ProcessGroup],
        land_unused: bool,
        land: Callable[[Landed], None],
    ) -> None:
        self._sends = sends
        self._plan = plan
        self._mine = next((s for s in sends if s.owner == shard_rank), None)
        self._replicate_group = replicate_group
        self._land_unused = land_unused
        self._land = land
        self._advanced = False
        self._replica_work: Optional[dist.Work] = None

    @property
    def hybrid(self) -> bool:
        return self._replicate_group is not None

    def advance(self) -> None:
        """Wait for the reduces (releasing what was sent to other owners) and start the average
        across replica rows of what this rank owns."""
        if self._advanced:
            return
        self._advanced = True
        for send in self._sends:
            if send.work is not None:
                send.work.wait()
        self._sends = [self._mine] if self._mine is not None else []
        if self._mine is not None and self._replicate_group is not None:
            self._replica_work = comm.start_all_reduce(self._mine.sent, self._replicate_group, self._plan.replica_op)

    def finish(self) -> None:
        """Wait for everything; land this rank's owned gradients."""
        self.abandon()
        if self._mine is None:
            return
        self._plan.scale_received(self._mine.sent)
        self._land(self._unpack(self._mine))

    def abandon(self) -> None:
        """Wait for every collective (so the ranks stay in step) and land nothing."""
        self.advance()
        if self._replica_work is not None:
            self._replica_work.wait()
            self._replica_work = None

    def _unpack(self, send: _OwnerSend) -> Landed:
        n = len(send.params)
        used = [True] * n if self._land_unused or all(send.had_grad) else used_anywhere(send.sent[-n:])
        pieces = send.sent[:-n].split([sp.geometry.numel for sp in send.params])
        return [(sp, piece.view(sp.geometry.shape)) for sp, piece, is_used in zip(send.params, pieces, used) if is_used]


def start_owned_reduction(
    params: Sequence[ShardedParam],
    grads: Sequence[Optional[torch.Tensor]],
    dtype: torch.dtype,
    plan: DivisionPlan,
    group: dist.ProcessGroup,
    shard_rank: int,
    world: int,
    replicate_group: Optional[dist.ProcessGroup],
    land_unused: bool,
    device: torch.device,
    land: Callable[[Landed], None],
) -> OwnedReduction:
    """Pack the full ``grads`` of the owner-placed ``params`` (``None`` where this rank has
    none) per owner, in ``dtype`` on ``device``, scale them as ``plan`` says and start reducing
    each onto its owner over ``group``."""
    by_owner: dict[int, list[tuple[ShardedParam, Optional[torch.Tensor]]]] = {}
    for sp, grad in zip(params, grads):
        by_owner.setdefault(_owner(sp), []).append((sp, grad))
    sends = [_send(owner, pairs, dtype, device, plan, group, world) for owner, pairs in sorted(by_owner.items())]
    return OwnedReduction(sends, plan, shard_rank, replicate_group, land_unused, land)


def _send(
    owner: int,
    pairs: list[tuple[ShardedParam, Optional[torch.Tensor]]],
    dtype: torch.dtype,
    device: torch.device,
    plan: DivisionPlan,
    group: dist.ProcessGroup,
    world: int,
) -> _OwnerSend:
    params, grads = [sp for sp, _ in pairs], [grad for _, grad in pairs]
    numels = [sp.geometry.numel for sp in params]
    sent = torch.empty(sum(numels) + len(params), dtype=dtype, device=device)
    pack_with_used_flags(sent, grads, numels)
    had_grad = [grad is not None for grad in grads]
    plan.scale_sent(sent)
    work = comm.start_reduce(sent, owner, group, plan.scatter_op) if world > 1 else None
    return _OwnerSend(owner, params, sent, had_grad, work)


def _regions_by_owner(by_owner: list[ShardedParam], starts: list[int]) -> dict[int, tuple[int, int]]:
    """Each owner's ``(begin, end)`` in a buffer of ``by_owner``'s parameters back to back, in
    owner order; owners whose parameters hold no elements have none (nothing to broadcast)."""
    regions: dict[int, tuple[int, int]] = {}
    for sp, start in zip(by_owner, starts):
        begin, _ = regions.get(_owner(sp), (start, start))
        regions[_owner(sp)] = (begin, start + sp.geometry.numel)
    return {owner: span for owner, span in regions.items() if span[1] > span[0]}


def _owner(sp: ShardedParam) -> int:
    if sp.owner is None:
        raise RuntimeError(f"parameter {sp.fqn} is not owner-placed")
    return sp.owner


def _started(work: Optional[dist.Work]) -> dist.Work:
    if work is None:
        raise RuntimeError(on_rank("broadcast: this rank is not in the process group it broadcasts over"))
    return work
