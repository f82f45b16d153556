"""One parameter of a unit: its sharded DTensor (what the module holds at rest) and its
unsharded tensor (what forward and backward compute with).

Dim 0 is cut as ``torch.chunk`` cuts it (``ceil(rows / world)`` rows per rank, the last ranks
holding fewer or none), which is the layout DTensor's ``Shard(0)`` describes; internally every
rank's slot is padded to the full chunk size so that collectives move equal sizes. Users never
see the padding: the DTensor's global shape is the parameter's shape. A 0-dim parameter cannot
be cut, so it is replicated: every slot holds the whole value.

``fully_shard(shard_placement_fn=...)`` may cut another dim (``Shard(1)``): then, as in torch,
that dim must divide evenly (no padding), each rank's slot holds its contiguous chunk, and the
gathered rank-major buffer is re-laid out into the full tensor (:meth:`ShardGeometry.by_rank`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from .._common.dtensors import held_here
from .._common.errors import on_rank
from ._grad_dtypes import carry_grad_dtype, grad_dtype_of, grads_follow_grad_dtype, wider
from ._placement.dtensor import DTensorLayout, shard_as_dtensor

__all__ = ["ShardGeometry", "ShardedParam"]


@dataclass(frozen=True)
class ShardGeometry:
    """Where a parameter of ``shape`` lives across ``world`` shards (pure arithmetic)."""

    shape: torch.Size
    world: int
    dim: int = 0  # the dim cut (``Shard(dim)``); any other than 0 divides evenly

    @property
    def replicated(self) -> bool:
        return len(self.shape) == 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        """Elements in one index of the cut dim (a row, for dim 0)."""
        return 1 if self.replicated else math.prod(s for i, s in enumerate(self.shape) if i != self.dim)

    @property
    def rows_per_shard(self) -> int:
        """Indices of the cut dim in each rank's (padded) slot."""
        return 1 if self.replicated else -(-self.shape[self.dim] // self.world)

    @property
    def slot_shape(self) -> tuple[int, ...]:
        """The shape of each rank's (padded) slot."""
        if self.replicated:
            return (1,)
        return tuple(self.rows_per_shard if i == self.dim else size for i, size in enumerate(self.shape))

    @property
    def slot_numel(self) -> int:
        """Elements in each rank's (padded) slot."""
        return self.rows_per_shard * self.row_numel

    def rows_held_by(self, rank: int) -> int:
        """Indices of the cut dim of the real (unpadded) parameter in ``rank``'s slot."""
        if self.replicated:
            return 1
        return max(0, min(self.rows_per_shard, self.shape[self.dim] - rank * self.rows_per_shard))

    def by_rank(self, full: torch.Tensor) -> torch.Tensor:
        """A view of ``full`` (the parameter's shape, or for dim 0 its ``world`` padded slots
        flat) as ``world x slot_shape``: entry ``r`` is what rank ``r`` holds. For dim 0 that is
        the memory order; for another dim a strided view, which is how a rank-major all-gather
        output is re-laid out into the full tensor, and a full gradient packed rank-major."""
        if self.dim == 0 or self.replicated:
            return full.reshape(self.world, *self.slot_shape)
        return full.reshape(self.shape).unflatten(self.dim, (self.world, self.rows_per_shard)).movedim(self.dim, 0)

    def stride(self) -> tuple[int, ...]:
        """The contiguous stride of the full parameter."""
        strides, step = [], 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= size
        return tuple(reversed(strides))


def placements_for(geometry: ShardGeometry, mesh: DeviceMesh, owned: bool = False) -> tuple[Placement, ...]:
    """``Shard(dim)`` on the last mesh dim (replicated on an outer one, if any); 0-dim, or an
    owner-placed parameter on its owner mesh: replicated."""
    if geometry.replicated or owned:
        return tuple(Replicate() for _ in range(mesh.ndim))
    return tuple(Replicate() for _ in range(mesh.ndim - 1)) + (Shard(geometry.dim),)


class ShardedParam:
    """A parameter of one unit, in its two forms.

    ``sharded`` is an ``nn.Parameter`` wrapping a DTensor whose local tensor is this rank's rows,
    a view of the unit's flat shard buffer: the object the module holds at rest, the optimizer
    steps and checkpoints see. ``unsharded`` is a plain ``nn.Parameter`` viewing the unit's
    gathered buffer: the module holds it while it computes, and autograd accumulates its
    ``.grad``, which the unit then reduce-scatters into ``sharded.grad``.

    A parameter registered under several names (tied weights) has one ``ShardedParam`` with
    several entries in ``registered_as``; all of them are switched together.

    An owner-placed parameter (``owner`` set: a rank of the shard group, ``sharded.fsdp.Owned``)
    is not cut: its geometry is one whole shard, ``mesh`` is its owner mesh (the ranks holding
    it, ``Replicate()`` on it) and only the owner's local tensor holds its value.
    """

    def __init__(
        self,
        fqn: str,
        registered_as: Sequence[tuple[nn.Module, str]],
        geometry: ShardGeometry,
        mesh: DeviceMesh,
        shard_rank: int,
        layout: Optional[DTensorLayout] = None,
        owner: Optional[int] = None,
    ) -> None:
        self.fqn = fqn
        self.registered_as = list(registered_as)  # (module, attribute name) pairs
        self.geometry = geometry
        self.shard_rank = shard_rank
        self.owner = owner  # the shard-group rank holding it whole (None: cut, as ``geometry`` says)
        self._mesh = mesh
        self._placements = placements_for(geometry, mesh, owned=owner is not None)
        self.layout = layout  # a tensor-parallel parameter's DTensors (None: plain, the above)
        self._sharded: Optional[nn.Parameter] = None  # set by the first attach_shard
        self.unsharded: Optional[nn.Parameter] = None  # set by the unit's storage before a gather
        # its local tensor defines fsdp_pre/post_all_gather: gathered through them (._extension)
        self.gather_extension = False
        # the dtype it is gathered and computed in (None: its own), as the unit's mixed precision
        # policy says for it (``param_dtype_override_fn``)
        self.compute_dtype: Optional[torch.dtype] = None
        # the gradient summed locally while gradient sync is off (no_sync), in the reduce dtype
        self.unsynced_grad: Optional[torch.Tensor] = None

    # ----------------------------------------------------------------------- sharded form

    @property
    def sharded(self) -> nn.Parameter:
        """The sharded parameter (exists from ``fully_shard`` on: the storage attaches it)."""
        if self._sharded is None:
            raise RuntimeError(f"parameter {self.fqn} has no shard attached yet")
        return self._sharded

    @property
    def requires_grad(self) -> bool:
        return self.sharded.requires_grad

    @property
    def held_here(self) -> bool:
        """Whether this rank holds (its rows of) the value: false only for an owner-placed
        parameter on a rank other than its owner."""
        return held_here(self.sharded)

    def real_rows(self, slot: torch.Tensor) -> torch.Tensor:
        """The real (unpadded) rows of this rank's padded ``slot`` (a 1-D piece of a flat buffer),
        shaped as its shard."""
        g = self.geometry
        if g.replicated:
            return slot.view(())
        return slot.view(g.slot_shape).narrow(g.dim, 0, g.rows_held_by(self.shard_rank))

    def rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full-shape tensor (the whole of a replicated one)."""
        g = self.geometry
        if g.replicated:
            return full
        start = self.shard_rank * g.rows_per_shard
        return full[(slice(None),) * g.dim + (slice(start, start + g.rows_held_by(self.shard_rank)),)]

    def as_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's rows) as a DTensor of the parameter's global shape."""
        if self.layout is not None:
            return self.layout.sharded(local)
        g = self.geometry
        return shard_as_dtensor(local, self._mesh, tuple(self._placements), g.shape, g.stride())

    def attach_shard(self, slot: torch.Tensor, requires_grad: bool) -> None:
        """Make the sharded parameter's local tensor a view of ``slot``.

        The first call creates the parameter; later calls (after ``to_empty`` or a dtype change
        gave it new storage) keep the same Python object, which an optimizer may already hold,
        and carry its gradient and attributes over.
        """
        self.attach_local(self.real_rows(slot), requires_grad)

    def attach_local(self, local: torch.Tensor, requires_grad: bool) -> None:
        """Make ``local`` (this rank's rows) the sharded parameter's local tensor (see
        :meth:`attach_shard`)."""
        fresh = nn.Parameter(self.as_dtensor(local), requires_grad=requires_grad)
        if self._sharded is None:
            self._sharded = fresh
            return
        carry_grad_dtype(self._sharded, fresh)
        fresh.grad = self._sharded.grad
        fresh.__dict__.update(self._sharded.__dict__)
        torch.utils.swap_tensors(self._sharded, fresh)

    def adopt(self, replacement: Optional[torch.Tensor]) -> None:
        """Make ``replacement``, which a module now holds in this parameter's place (assigned by
        ``load_state_dict(assign=True)`` or plain attribute assignment), the sharded parameter,
        as torch's FSDP2 adopts it: the optimizer built after the load holds that object.
        It must be a shard laid out as the one it replaces (a DTensor of the same global shape,
        mesh and placements); its values are taken as they are (the unit repacks them into its
        buffer before the next gather)."""
        current = cast(DTensor, self.sharded)
        if replacement is None:
            raise ValueError(f"parameter {self.fqn} was removed from its module after fully_shard")
        if not isinstance(replacement, DTensor):
            raise TypeError(
                f"parameter {self.fqn} was replaced after fully_shard by a {type(replacement).__name__} of shape "
                f"{tuple(replacement.shape)}, not a DTensor shard: assign nn.Parameter(distribute_tensor(full, "
                f"{current.device_mesh}, {list(current.placements)})), or load a full state dict with "
                "torch.distributed.checkpoint.state_dict.set_model_state_dict(..., full_state_dict=True)"
            )
        found = (replacement.shape, replacement.device_mesh, tuple(replacement.placements), replacement.to_local().shape)
        expected = (current.shape, current.device_mesh, tuple(current.placements), current.to_local().shape)
        if found != expected:
            raise ValueError(
                f"parameter {self.fqn} was replaced after fully_shard by a DTensor laid out as "
                f"(shape, mesh, placements, local shape) {found}, but its shard is {expected}"
            )
        carry_grad_dtype(current, replacement)
        self._sharded = cast(nn.Parameter, replacement)
        self.show(self._sharded)

    def local_shard(self) -> torch.Tensor:
        """The sharded parameter's current local tensor."""
        with torch.no_grad():
            return cast(DTensor, self.sharded).to_local()

    # ---------------------------------------------------------------- what modules hold

    def computes_as(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` (a view of the gathered buffer) as the module computes with it: itself, or
        for a tensor-parallel parameter, its DTensor on the TP mesh."""
        return full if self.layout is None else self.layout.unsharded(full)

    def show(self, tensor: nn.Parameter) -> None:
        """Register ``tensor`` under every name this parameter has."""
        for module, name in self.registered_as:
            module._parameters[name] = tensor

    def show_sharded(self) -> None:
        self.show(self.sharded)

    def show_unsharded(self) -> None:
        """Register the gathered parameter (built by the storage before any gather)."""
        if self.unsharded is None:
            raise RuntimeError(f"parameter {self.fqn} has no unsharded form yet")
        self.unsharded.requires_grad_(self.requires_grad)
        self.show(self.unsharded)

    def held_by_module(self) -> Optional[torch.Tensor]:
        """What the first name it is registered under holds now (a user may have replaced it)."""
        module, name = self.registered_as[0]
        return module._parameters.get(name)

    # -------------------------------------------------------------------- gradients

    @property
    def grad_dtype(self) -> Optional[torch.dtype]:
        """The dtype its gradients are kept in (``None``: whatever dtype they come in); see
        :mod:`._grad_dtypes`."""
        return grad_dtype_of(self.sharded)

    def take_unsharded_grad(self, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
        """The full gradient this rank has for the parameter so far (the unsharded ``.grad`` plus
        what was accumulated with sync off); clears both. A gradient accumulated with sync off is
        in ``dtype`` (``None``: its own); a lone ``.grad`` keeps its own, as the reduce-scatter
        casts while it packs (a cast here would copy every gradient once more)."""
        grad = self.unsharded.grad if self.unsharded is not None else None
        if grad is not None and grad.layout != torch.strided:
            raise RuntimeError(on_rank(
                f"parameter {self.fqn} got a sparse gradient ({grad.layout}); fully_shard reduce-scatters dense "
                "gradients only. Use sparse=False on the embedding (F.embedding(..., sparse=False)), or "
                "DistributedDataParallel for sparse gradients"))
        if self.unsharded is not None:
            self.unsharded.grad = None
        if grad is not None and self.layout is not None:
            grad = self.layout.local_grad(grad)
        total, self.unsynced_grad = self.unsynced_grad, None
        if grad is None:
            return total
        return grad if total is None else total.add_(grad)

    def add_to_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Add ``local_grad`` (this rank's rows of a reduced gradient, in the reduce dtype) to the
        sharded ``.grad``, cast to the parameter's gradient dtype (:attr:`grad_dtype`: the
        shard's own unless set; ``None``: left in the reduce dtype) and to its device."""
        master = self.local_shard()
        dtype = self.grad_dtype or local_grad.dtype
        grad = self.sharded.grad
        if grad is None:  # a copy to the CPU may land later: the unit's backward ends waiting for it
            self.sharded.grad = self.as_dtensor(local_grad.to(device=master.device, dtype=dtype, non_blocking=True))
        else:  # read at once by the addition: a copy to the CPU must have landed first
            cast(DTensor, grad).to_local().add_(local_grad.to(device=master.device, dtype=dtype))

    def accept_grads_in(self, accumulation: Optional[torch.dtype]) -> None:
        """Where torch's ``fully_shard`` follows ``grad_dtype`` (2.15): let autograd hand the
        unsharded parameter its gradients as torch's does. A gradient to accumulate in a wider
        dtype than the parameter computes in is taken in whatever dtype autograd makes it (an
        fp32 norm's gradient is not rounded to bf16 first), the widening left to the reduction;
        except one that may still be summed over tensor-parallel ranks, which autograd widens
        first so that sum runs in the wider dtype. Any other is taken in ``accumulation``."""
        if self.unsharded is None or not grads_follow_grad_dtype():
            return
        defer = wider(accumulation, self.unsharded.dtype) and not (self.layout is not None and self.layout.may_sum_grads_over_tp)
        self.unsharded.grad_dtype = None if defer else accumulation  # type: ignore[attr-defined]

    def keep_unsynced(self, dtype: Optional[torch.dtype]) -> None:
        """Move the unsharded ``.grad`` into the local accumulator, in ``dtype`` (sync is off;
        ``None``: the gradient's own)."""
        taken = self.take_unsharded_grad(dtype)
        self.unsynced_grad = taken if taken is None or dtype is None else taken.to(dtype)
