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
nothing is gathered, copied or freed.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch
from torch import nn

from .._flat import column_blocks
from ._param import ShardedParam

__all__ = ["UnitStorage"]


class UnitStorage:
    """Sharded and unsharded flat buffers of one unit's parameters.

    Args:
        params: the unit's parameters, in buffer order.
        world: shards per parameter (the shard group's size).
        compute_device: where unsharded parameters live.
        offload_to_cpu / pin_memory: keep the sharded buffer on the CPU (pinned if possible).
        unsharded_dtype: dtype of the unsharded parameters (``None``: the shards' dtype).
    """

    def __init__(
        self,
        params: Sequence[ShardedParam],
        world: int,
        compute_device: torch.device,
        offload_to_cpu: bool,
        pin_memory: bool,
        unsharded_dtype: Optional[torch.dtype],
    ) -> None:
        self.params = list(params)
        self.world = world
        self.compute_device = compute_device
        self._offload = offload_to_cpu
        self._pin = pin_memory and offload_to_cpu and torch.cuda.is_available()
        self._unsharded_dtype = unsharded_dtype
        self.widths = [sp.geometry.slot_numel for sp in self.params]
        self.shard_numel = sum(self.widths)
        self.sharded_flat = torch.empty(0)
        self._unsharded_flat: Optional[torch.Tensor] = None
        self._unsharded_key: tuple = ()
        self._copy_out_blocks: list[torch.Tensor] = []

    # ------------------------------------------------------------------------- shards

    def shard_from_full(self, fulls: Sequence[torch.Tensor]) -> None:
        """Build the sharded buffer from the full parameters (meta ones stay unallocated)."""
        on_meta = any(full.is_meta for full in fulls)
        device = torch.device("meta") if on_meta else self._storage_device(self.compute_device)
        flat = self._new_flat(fulls[0].dtype if fulls else torch.float32, device)
        for sp, full, slot in zip(self.params, fulls, self._slots(flat)):
            if not on_meta:
                sp.local_part(slot).copy_(sp.rows_of(full.detach()))
            sp.attach_shard(slot, requires_grad=full.requires_grad)
        self.sharded_flat = flat

    def ensure_shards_current(self, where: str) -> None:
        """Repack if a parameter's local tensor is no longer a view of its slot (``to_empty``,
        ``module.to(...)`` or a replaced parameter gave it new storage)."""
        locals_ = [sp.local_shard() for sp in self.params]
        if all(_is_view(local, sp.local_part(slot)) for sp, local, slot in zip(self.params, locals_, self._slots(self.sharded_flat))):
            return
        self._check_materialised(locals_, where)
        dtypes = {local.dtype for local in locals_}
        if len(dtypes) > 1:
            raise TypeError(f"{where}: the unit's parameters now have different dtypes {sorted(map(str, dtypes))}; a unit needs one dtype")
        flat = self._new_flat(locals_[0].dtype, self._storage_device(locals_[0].device))
        for sp, local, slot in zip(self.params, locals_, self._slots(flat)):
            sp.local_part(slot).copy_(local)
            sp.attach_shard(slot, requires_grad=sp.requires_grad)
        self.sharded_flat = flat

    @property
    def dtype(self) -> torch.dtype:
        return self.sharded_flat.dtype

    def _check_materialised(self, locals_: Sequence[torch.Tensor], where: str) -> None:
        for sp, local in zip(self.params, locals_):
            if local.is_meta:
                raise RuntimeError(
                    f"{where}: parameter {sp.fqn} is still on the meta device; materialise the model "
                    "(module.to_empty(device=...) and initialise it) before its first forward"
                )

    def _storage_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu") if self._offload else device

    def _new_flat(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        pin = self._pin and device.type == "cpu"
        return torch.zeros(self.shard_numel, dtype=dtype, device=device, pin_memory=pin)

    def _slots(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(flat.split(self.widths))

    # ---------------------------------------------------------------------- unsharded

    @property
    def aliases_shards(self) -> bool:
        """One shard, same dtype and device: the unsharded parameters view the shards."""
        flat = self.sharded_flat
        return self.world == 1 and self.unsharded_dtype == flat.dtype and flat.device == self.compute_device

    @property
    def unsharded_dtype(self) -> torch.dtype:
        return self._unsharded_dtype or self.sharded_flat.dtype

    def prepare_unsharded(self) -> None:
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
            self._copy_out_blocks = [writer[s : s + self.world * w].view(self.world, w) for s, w in zip(starts, self.widths)]
        for sp, start in zip(self.params, starts):
            full = flat[start : start + sp.geometry.numel].view(sp.geometry.shape)
            sp.unsharded = nn.Parameter(full, requires_grad=sp.requires_grad)
        self._unsharded_flat = flat
        self.free_unsharded()

    def allocate_unsharded(self) -> None:
        if not self.aliases_shards and self._unsharded_flat is not None:
            storage = self._unsharded_flat.untyped_storage()
            nbytes = self._unsharded_flat.numel() * self._unsharded_flat.element_size()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)

    def free_unsharded(self) -> None:
        if not self.aliases_shards and self._unsharded_flat is not None:
            self._unsharded_flat.untyped_storage().resize_(0)

    def unsharded_bytes(self) -> int:
        """Bytes the unsharded buffer holds right now (0 while freed or aliasing the shards)."""
        if self.aliases_shards or self._unsharded_flat is None:
            return 0
        return self._unsharded_flat.untyped_storage().nbytes()

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Rank-major all-gather output -> the unsharded parameters."""
        torch._foreach_copy_(self._copy_out_blocks, column_blocks(gathered, self.world, self.widths))

    def full_copies(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """Fresh full tensors of every parameter from a rank-major all-gather output."""
        buffer = torch.empty(self.world * self.shard_numel, dtype=gathered.dtype, device=gathered.device)
        starts = self._offsets(self.world)
        blocks = [buffer[s : s + self.world * w].view(self.world, w) for s, w in zip(starts, self.widths)]
        torch._foreach_copy_(blocks, column_blocks(gathered, self.world, self.widths))
        return [buffer[s : s + sp.geometry.numel].view(sp.geometry.shape) for sp, s in zip(self.params, starts)]

    def _offsets(self, scale: int) -> list[int]:
        return [scale * offset for offset in itertools.accumulate([0] + self.widths[:-1])]


def _is_view(local: torch.Tensor, expected: torch.Tensor) -> bool:
    same_place = local.dtype == expected.dtype and local.device == expected.device and not local.is_meta
    if not same_place:
        return False
    if local.untyped_storage().data_ptr() != expected.untyped_storage().data_ptr():
        return False
    return local.numel() == 0 or local.data_ptr() == expected.data_ptr()
