"""The flat buffers behind one unit's parameters.

``sharded_flat`` holds this rank's padded slots back to back, each parameter's DTensor local
tensor being a view of its slot, so the all-gather sends the buffer as it is: no packing.

The unsharded buffer holds each parameter's full value back to back, padded to ``world`` slots
(``world x slot`` elements, the first ``numel`` of them real), so that turning the rank-major
all-gather output into it is one ``torch._foreach_copy_`` over column blocks. The unsharded
parameters are views of it. Between uses its storage is resized to zero bytes rather than
dropped: autograd saved these very tensors for backward, and resizing back before backward
refills them in place. Writes go through an alias with its own version counter (``.data``), so
refilling does not look like an in-place change to autograd.

With one shard and no dtype or device change, the unsharded parameters simply view the shards:
nothing is gathered, copied or freed; unless the gather decodes low-bit messages
(``fully_shard(lowbit=LowBit(params=...))``), which it does on one rank too.

:class:`UnitStorage` is the :class:`._gather.ParamGather` of plain parameters: it all-gathers
``sharded_flat`` as it is (or, in backward after a forward with ``reshard_after_forward=k``, the
secondary shard it kept, within that smaller group).

The other direction, the gradients, is :mod:`._gradient_rows`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import nn

from .._common.flat import column_blocks, is_view_of, offsets_of
from ._collectives import PendingDecodedGather, PendingGather, start_all_gather, start_lowbit_all_gather
from ._gather import GatherRoute
from ._param import ShardedParam
from ._placement.secondary_shard import SecondaryShardGroup

__all__ = ["BufferPlacement", "UnitStorage", "check_materialised", "ensure_allocated", "release"]


@dataclass(frozen=True)
class BufferPlacement:
    """Where a unit's buffers live: what it keeps at rest (its shards, or its owned values) on
    the compute device or offloaded to the CPU (pinned where an accelerator can then copy from it
    asynchronously), and the gathered parameters on the compute device in ``unsharded_dtype``
    (``None``: the dtype kept at rest)."""

    compute_device: torch.device
    offload_to_cpu: bool = False
    pin_memory: bool = False
    unsharded_dtype: Optional[torch.dtype] = None
    # the gather may decode a low-bit message (fully_shard(lowbit=LowBit(params=...))): then the
    # gathered parameters hold the decoded values, never a view of the shards, even on one rank
    decodes: bool = False

    def rest_device(self, device: torch.device) -> torch.device:
        """Where values that ``device`` holds are kept at rest."""
        return torch.device("cpu") if self.offload_to_cpu else device

    def gathered_dtype(self, rest: torch.Tensor) -> torch.dtype:
        """The gathered parameters' dtype, for values kept at rest in ``rest``."""
        return self.unsharded_dtype or rest.dtype

    def gathers_nothing(self, world: int, rest: torch.Tensor) -> bool:
        """One rank, and ``rest`` already in the gathered dtype on the compute device: the
        gathered parameters can view the values at rest themselves."""
        return world == 1 and not self.decodes and self.gathered_dtype(rest) == rest.dtype and rest.device == self.compute_device

    def new_rest_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed flat buffer to keep values at rest on ``device``."""
        pin = self.pin_memory and self.offload_to_cpu and device.type == "cpu" and torch.cuda.is_available()
        return torch.zeros(numel, dtype=dtype, device=device, pin_memory=pin)


def check_materialised(params: Sequence[ShardedParam], locals_: Sequence[torch.Tensor], where: str) -> None:
    """Raise naming the first of ``params`` whose local tensor is still on the meta device."""
    for sp, local in zip(params, locals_):
        if local.is_meta:
            raise RuntimeError(
                f"{where}: parameter {sp.fqn} is still on the meta device; materialise the model "
                "(module.to_empty(device=...) and initialise it) before its first forward"
            )


def ensure_allocated(flat: torch.Tensor) -> None:
    """Give a gathered buffer freed by :func:`release` its storage back (the same tensor, so what
    autograd saved of views of it is refilled in place)."""
    storage = flat.untyped_storage()
    nbytes = flat.numel() * flat.element_size()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def release(flat: torch.Tensor) -> None:
    """Free a gathered buffer's storage; the tensor and its views stay, for the next gather."""
    flat.untyped_storage().resize_(0)


class UnitStorage:
    """Sharded and unsharded flat buffers of one unit's plain parameters, and their all-gather.

    Args:
        params: the unit's parameters, in buffer order.
        world: shards per parameter (the shard group's size).
        placement: where the buffers live, and the unsharded parameters' dtype.
    """

    def __init__(self, params: Sequence[ShardedParam], world: int, placement: BufferPlacement) -> None:
        self.params = list(params)
        self.world = world
        self.placement = placement
        self.compute_device = placement.compute_device
        self.widths = [sp.geometry.slot_numel for sp in self.params]
        self._cut_elsewhere = any(sp.geometry.dim != 0 for sp in self.params)  # shard_placement_fn's Shard(d)
        self.shard_numel = sum(self.widths)
        self.sharded_flat = torch.empty(0)
        self._unsharded_flat: Optional[torch.Tensor] = None
        self._unsharded_key: tuple = ()
        self._copy_out_blocks: list[torch.Tensor] = []
        self._pending: Optional[Union[PendingGather, PendingDecodedGather]] = None  # an all-gather in flight
        self._secondary_shard: Optional[torch.Tensor] = None  # kept after forward for backward's gather

    # ------------------------------------------------------------------------- shards

    def shard_from_full(self, fulls: Sequence[torch.Tensor]) -> None:
        """Build the sharded buffer from the full parameters (meta ones stay unallocated)."""
        on_meta = any(full.is_meta for full in fulls)
        device = torch.device("meta") if on_meta else self.placement.rest_device(self.compute_device)
        flat = self.placement.new_rest_buffer(self.shard_numel, fulls[0].dtype if fulls else torch.float32, device)
        for sp, full, slot in zip(self.params, fulls, self._slots(flat)):
            if not on_meta:
                sp.real_rows(slot).copy_(sp.rows_of(full.detach()))
            sp.attach_shard(slot, requires_grad=full.requires_grad)
        self.sharded_flat = flat

    def _ensure_shards_current(self, where: str) -> None:
        """Repack if a parameter's local tensor is no longer a view of its slot (``to_empty``,
        ``module.to(...)`` or a replaced parameter gave it new storage)."""
        locals_ = [sp.local_shard() for sp in self.params]
        if all(is_view_of(local, sp.real_rows(slot)) for sp, local, slot in zip(self.params, locals_, self._slots(self.sharded_flat))):
            return
        check_materialised(self.params, locals_, where)
        dtypes = {local.dtype for local in locals_}
        if len(dtypes) > 1:
            raise TypeError(f"{where}: the unit's parameters now have different dtypes {sorted(map(str, dtypes))}; a unit needs one dtype")
        flat = self.placement.new_rest_buffer(self.shard_numel, locals_[0].dtype, self.placement.rest_device(locals_[0].device))
        for sp, local, slot in zip(self.params, locals_, self._slots(flat)):
            sp.real_rows(slot).copy_(local)
            sp.attach_shard(slot, requires_grad=sp.requires_grad)
        self.sharded_flat = flat

    @property
    def dtype(self) -> torch.dtype:
        return self.sharded_flat.dtype

    def _slots(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(flat.split(self.widths))

    # ------------------------------------------------------------------------- gather

    def prepare(self, where: str) -> None:
        """Repack the shards if they moved, (re)build the unsharded parameters if needed."""
        self._ensure_shards_current(where)
        self._prepare_unsharded()

    def start(self, route: GatherRoute) -> None:
        """Start gathering the shards (or a kept secondary shard, if ``route`` says so) into
        the rank-major layout :meth:`finish` copies out; nothing when the unsharded parameters
        view the shards. A secondary shard not used now is dropped.

        With a low-bit wire on the route, the shards travel in its ``params`` format: every
        rank's (this one's too) encoded, and decoded in float32 on arrival, so every rank
        computes with the same values; :meth:`finish` casts them to the unsharded dtype once.
        The shards themselves (what the optimizer steps) are not touched. A shard the wire
        cannot take (too small) is gathered exact, and counted."""
        kept, self._secondary_shard = self._secondary_shard, None
        if self.aliases_shards or not self.shard_numel:
            return
        source, group, world = self.sharded_flat, route.group, route.world
        if kept is not None and route.secondary is not None:
            source, group, world = kept, route.secondary.group, route.secondary.world
        wire = route.lowbit
        if wire is not None:
            codec = wire.codec("params", "all_gather", f"the {str(self.unsharded_dtype).replace('torch.', '')} parameters of {route.unit}", source)
            if codec is not None:
                self._pending = start_lowbit_all_gather(wire, codec, source, self.unsharded_dtype)
                return
            wire.count_exact("all_gather", source.numel(), self.unsharded_dtype, world - 1)
        self._pending = start_all_gather(source, self.unsharded_dtype, self.compute_device, group, world, route.custom)

    def finish(self, keep_secondary: Optional[SecondaryShardGroup]) -> None:
        """Wait for the gather, keep the secondary shard if asked, fill the unsharded buffer."""
        if self._pending is None:
            return
        gathered, self._pending = self._pending.wait(), None
        if keep_secondary is not None:
            self._secondary_shard = keep_secondary.cut(gathered, self.world)
        self._allocate_unsharded()
        torch._foreach_copy_(self._copy_out_blocks, self._gathered_blocks(gathered))

    def discard(self) -> None:
        """Finish a gather in flight unused; drop a kept secondary shard."""
        if self._pending is not None:
            self._pending.wait()
        self._pending = self._secondary_shard = None

    def full_copies(self, route: GatherRoute, where: str) -> list[torch.Tensor]:
        """Collective: fresh full tensors of every parameter, in the shards' dtype."""
        self._ensure_shards_current(where)
        gathered = start_all_gather(self.sharded_flat, self.dtype, self.compute_device, route.group, route.world).wait()
        buffer = torch.empty(self.world * self.shard_numel, dtype=gathered.dtype, device=gathered.device)
        starts = self._offsets(self.world)
        blocks = [_rank_major(sp, buffer[s : s + self.world * w]) for sp, s, w in zip(self.params, starts, self.widths)]
        torch._foreach_copy_(blocks, self._gathered_blocks(gathered))
        return [buffer[s : s + sp.geometry.numel].view(sp.geometry.shape) for sp, s in zip(self.params, starts)]

    # ---------------------------------------------------------------------- unsharded

    @property
    def aliases_shards(self) -> bool:
        """One shard, same dtype and device: the unsharded parameters view the shards."""
        return self.placement.gathers_nothing(self.world, self.sharded_flat)

    @property
    def unsharded_dtype(self) -> torch.dtype:
        return self.placement.gathered_dtype(self.sharded_flat)

    def _prepare_unsharded(self) -> None:
        """(Re)build the unsharded buffer and parameters if the shards' dtype or storage changed."""
        key = (self.unsharded_dtype, self.sharded_flat.device, self.aliases_shards and self.sharded_flat.data_ptr())
        if key == self._unsharded_key:
            return
        self._unsharded_key = key
        if self.aliases_shards:
            flat, starts = self.sharded_flat, self._offsets(1)
        else:
            flat = torch.empty(self.world * self.shard_numel, dtype=self.unsharded_dtype, device=self.compute_device)
            starts = self._offsets(self.world)
            writer = flat.data  # its own version counter: refills are invisible to autograd
            self._copy_out_blocks = [_rank_major(sp, writer[s : s + self.world * w]) for sp, s, w in zip(self.params, starts, self.widths)]
        for sp, start in zip(self.params, starts):
            full = flat[start : start + sp.geometry.numel].view(sp.geometry.shape)
            sp.unsharded = nn.Parameter(sp.computes_as(full), requires_grad=sp.requires_grad)
        self._unsharded_flat = flat
        self.free()

    def _allocate_unsharded(self) -> None:
        if not self.aliases_shards and self._unsharded_flat is not None:
            ensure_allocated(self._unsharded_flat)

    def free(self) -> None:
        """Free the unsharded buffer's storage (its tensors stay, for the next gather)."""
        if not self.aliases_shards and self._unsharded_flat is not None:
            release(self._unsharded_flat)

    def unsharded_bytes(self) -> int:
        """Bytes the unsharded buffer holds right now (0 while freed or aliasing the shards)."""
        if self.aliases_shards or self._unsharded_flat is None:
            return 0
        return self._unsharded_flat.untyped_storage().nbytes()

    def _gathered_blocks(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's column block of a rank-major all-gather output, shaped as its
        :func:`_rank_major` target."""
        blocks = column_blocks(gathered, self.world, self.widths)
        if not self._cut_elsewhere:
            return blocks
        return [b if sp.geometry.dim == 0 else b.view(self.world, *sp.geometry.slot_shape) for sp, b in zip(self.params, blocks)]

    def _offsets(self, scale: int) -> list[int]:
        return [scale * offset for offset in offsets_of(self.widths)]


def _rank_major(sp: ShardedParam, region: torch.Tensor) -> torch.Tensor:
    """``region`` (``world`` padded slots of a full-parameter buffer) as the target of its
    column block of a rank-major buffer: ``world x slot`` for dim 0, which is the memory order;
    for another cut dim, the full tensor seen rank by rank (a strided view)."""
    g = sp.geometry
    if g.dim == 0:
        return region.view(g.world, g.slot_numel)
    return g.by_rank(region[: g.numel])
