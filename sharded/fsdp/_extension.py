"""The all-gather extension point: parameters whose sharded local tensor defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (tensor subclasses such as torchao's float8
weights), all-gathered through those hooks as torch 2.13's ``fully_shard`` calls them.

Before the all-gather, ``local.fsdp_pre_all_gather(mesh)`` (the old signature) or
``local.fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` returns the
tensors to gather (e.g. the weight cast to bfloat16 or float8: fewer bytes on the wire) and
metadata. After it, ``local.fsdp_post_all_gather(outputs, metadata, param_dtype)`` builds the
unsharded tensor from the gathered ``outputs`` (each input's shards concatenated on dim 0) and
names the tensors to free at reshard; from the second gather on, the same outputs and inner
tensors are refilled and the hook writes into the existing parameter (``out=``), so tensors
autograd saved stay valid.

A unit's extension parameters are not in its flat buffers (their local tensors are the
subclass's own); :class:`ExtensionGather`, their :class:`._gather.ParamGather`, gathers them by
one collective of their own, their inputs packed back to back (as bytes when their dtypes
differ), from their shards every time (no secondary shard). The gradients are plain tensors and
take the unit's ordinary reduce-scatter.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .._common.errors import on_rank
from .._common.flat import column_blocks
from ._collectives import PendingGather, start_all_gather
from ._gather import GatherRoute
from ._param import ShardedParam
from ._placement.secondary_shard import SecondaryShardGroup
from .policies import MixedPrecisionPolicy

__all__ = ["has_gather_extension", "check_no_late_hooks", "shard_with_extension", "ExtensionGather"]


def has_gather_extension(tensor: torch.Tensor, name: str, shard_dim: int) -> bool:
    """Whether ``tensor`` defines the pair of hooks (one without the other is an error, and
    so, here, is the extension on a parameter cut on another dim than 0)."""
    pre, post = hasattr(tensor, "fsdp_pre_all_gather"), hasattr(tensor, "fsdp_post_all_gather")
    if pre != post:
        raise TypeError(on_rank(
            f"fully_shard: parameter {name} defines {'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'} "
            "but not its pair; the all-gather extension needs both"
        ))
    if pre and shard_dim != 0:
        raise NotImplementedError(on_rank(
            f"fully_shard: parameter {name} has the all-gather extension (fsdp_pre_all_gather) and "
            f"shard_placement_fn chose Shard({shard_dim}); sharded gathers extension parameters on dim 0 only"
        ))
    return pre


def check_no_late_hooks(params: Sequence[ShardedParam]) -> None:
    """torch also honours hooks set on a sharded parameter's local tensor after ``fully_shard``
    (e.g. after ``to_empty``); sharded reads them at ``fully_shard`` time only, so such hooks
    raise here (at the model's first forward) rather than being silently skipped."""
    for sp in params:
        if not sp.gather_extension and hasattr(cast(DTensor, sp.sharded)._local_tensor, "fsdp_pre_all_gather"):
            raise NotImplementedError(on_rank(
                f"parameter {sp.fqn}: fsdp_pre_all_gather was set on its local tensor after fully_shard; sharded "
                "takes the all-gather extension only from the parameter given to fully_shard (define it on its class)"
            ))


def shard_with_extension(sp: ShardedParam, full: torch.Tensor) -> None:
    """Give ``sp`` its local shard as torch does for a subclass: a zeroed padded slot made by
    the subclass (``new_zeros``), this rank's part of it viewed and filled."""
    with torch.no_grad():
        detached = full.detach()
        local = sp.real_rows(detached.new_zeros(sp.geometry.slot_numel))
        if not full.is_meta:
            local.copy_(sp.rows_of(detached))
    sp.attach_local(local, requires_grad=full.requires_grad)


@dataclass
class _Gathered:
    """One extension parameter's state between its gathers."""

    sp: ShardedParam
    input_shapes: list[torch.Size] = field(default_factory=list)
    metadata: Any = None
    outputs: list[torch.Tensor] = field(default_factory=list)  # persistent, freed at reshard
    inner: Sequence[torch.Tensor] = ()  # what fsdp_post_all_gather said to free


class ExtensionGather:
    """The extension parameters of one unit, their :class:`._gather.ParamGather`:
    pre-all-gather hooks, one all-gather of their inputs, post-all-gather hooks; and freeing what
    those built.

    Args:
        params: the unit's parameters with the extension.
        mesh: the mesh the unit shards over (the hooks see its shard dim).
        mp_policy: the unit's mixed precision (``param_dtype`` goes to the post hook).
        device: the compute device (offloaded shards are moved there first).
    """

    def __init__(self, params: Sequence[ShardedParam], mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, device: torch.device) -> None:
        self._params = [_Gathered(sp) for sp in params]
        self._mesh = mesh if mesh.ndim == 1 else _shard_submesh(mesh)
        self._mp_policy = mp_policy
        self._device = device
        self._pending: Optional[PendingGather] = None
        self._world = 1  # of the gather in flight
        self._layout: list[tuple[torch.dtype, int]] = []  # each input's dtype and numel, in order

    @property
    def params(self) -> list[ShardedParam]:
        return [state.sp for state in self._params]

    @property
    def dtype(self) -> torch.dtype:
        return self._params[0].sp.local_shard().dtype

    def shard_from_full(self, fulls: Sequence[torch.Tensor]) -> None:
        for state, full in zip(self._params, fulls):
            shard_with_extension(state.sp, full)

    def prepare(self, where: str) -> None:
        """Nothing: the subclass's shards are gathered from where they are."""

    def start(self, route: GatherRoute) -> None:
        """Run the pre-all-gather hooks and start gathering what they returned."""
        inputs: list[torch.Tensor] = []
        for state in self._params:
            inputs.extend(self._pre_all_gather(state))
        self._layout = [(t.dtype, t.numel()) for t in inputs]
        sent = _pack(inputs)
        self._world = route.world
        self._pending = start_all_gather(sent, sent.dtype, self._device, route.group, route.world, route.custom)

    def finish(self, keep_secondary: Optional[SecondaryShardGroup]) -> None:
        """Wait for the all-gather; refill each parameter's outputs and run its post hook
        (``keep_secondary`` does not apply: these are gathered from their shards every time)."""
        if self._pending is None:
            return
        gathered, self._pending = self._pending.wait(), None
        blocks = iter(_unpack(gathered, self._world, self._layout))
        for state in self._params:
            received = [next(blocks) for _ in state.input_shapes]
            self._post_all_gather(state, received, self._world)

    def discard(self) -> None:
        """Finish a gather in flight without using it."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def full_copies(self, route: GatherRoute, where: str) -> list[torch.Tensor]:
        """Collective: each parameter's full value, as its DTensor gathers it."""
        return [cast(DTensor, state.sp.sharded).full_tensor() for state in self._params]

    def free(self) -> None:
        """Free the gathered outputs and what the post hooks built (their storage; the tensor
        objects stay for the next gather to refill)."""
        for state in self._params:
            for tensor in [*state.outputs, *state.inner]:
                tensor.untyped_storage().resize_(0)

    # -------------------------------------------------------------------------- hooks

    def _pre_all_gather(self, state: _Gathered) -> list[torch.Tensor]:
        sp = state.sp
        local = cast(DTensor, sp.sharded)._local_tensor
        if local.device != self._device:
            local = local.to(self._device, non_blocking=True)
        hook = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
        arity = len(inspect.signature(hook).parameters)
        if arity == 1:
            inputs, state.metadata = hook(self._mesh)
        elif arity == 5:
            module = sp.registered_as[0][0]
            inputs, state.metadata = hook(self._mesh, sp.geometry.shape, sp.geometry.stride(), module, _torch_policy(self._mp_policy))
        else:
            raise TypeError(on_rank(
                f"parameter {sp.fqn}: fsdp_pre_all_gather{inspect.signature(hook)} must take (mesh) or "
                "(mesh, outer_size, outer_stride, module, mp_policy)"
            ))
        inputs = list(inputs)
        self._check_padded(sp, local, inputs)
        state.input_shapes = [t.shape for t in inputs]
        return inputs

    def _check_padded(self, sp: ShardedParam, local: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        """On a rank holding fewer rows than the others, every rank must still send as much."""
        padded = torch.Size(sp.geometry.slot_shape) if not sp.geometry.replicated else local.shape
        if local.shape != padded and any(t.shape != padded for t in inputs):
            raise ValueError(on_rank(
                f"parameter {sp.fqn} (shape {tuple(sp.geometry.shape)}) is sharded unevenly: its "
                f"fsdp_pre_all_gather must return inputs of the padded shard shape {tuple(padded)}, "
                f"got {[tuple(t.shape) for t in inputs]}"
            ))

    def _post_all_gather(self, state: _Gathered, received: list[torch.Tensor], world: int) -> None:
        sp = state.sp
        first = not state.outputs
        if first:
            state.outputs = [torch.empty(block.numel(), dtype=block.dtype, device=block.device) for block in received]
        for output, block in zip(state.outputs, received):
            if output.untyped_storage().nbytes() == 0:
                output.untyped_storage().resize_(output.numel() * output.element_size())
            output.data.view(world, -1).copy_(block)  # .data: autograd sees no in-place change
        for tensor in state.inner:
            if tensor.untyped_storage().nbytes() == 0:
                tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        outputs = tuple(o.view(-1, *shape[1:]) for o, shape in zip(state.outputs, state.input_shapes))
        local = cast(DTensor, sp.sharded)._local_tensor
        param_dtype = self._mp_policy.param_dtype or local.dtype
        if not first and sp.unsharded is not None:
            local.fsdp_post_all_gather(outputs, state.metadata, param_dtype, out=sp.unsharded)  # type: ignore[attr-defined]
            return
        unsharded, state.inner = local.fsdp_post_all_gather(outputs, state.metadata, param_dtype)  # type: ignore[attr-defined]
        g = sp.geometry
        full = torch.as_strided(unsharded, g.shape, g.stride(), 0)
        sp.unsharded = nn.Parameter(full, requires_grad=sp.requires_grad)


def _pack(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The inputs back to back in one 1-D buffer: in their dtype if they share one, else as bytes."""
    dtypes = {t.dtype for t in inputs}
    flat = [t.reshape(-1) for t in inputs]
    if len(dtypes) == 1:
        return torch.cat(flat) if len(flat) > 1 else flat[0]
    return torch.cat([t.contiguous().view(torch.uint8) for t in flat])


def _unpack(gathered: torch.Tensor, world: int, layout: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Each input's ``world x numel`` block of the rank-major output, in its dtype."""
    if gathered.dtype != torch.uint8 or all(dtype == torch.uint8 for dtype, _ in layout):
        return column_blocks(gathered, world, [numel for _, numel in layout])
    widths = [numel * torch.empty((), dtype=dtype).element_size() for dtype, numel in layout]
    blocks = column_blocks(gathered, world, widths)
    return [_reinterpret(block, dtype) for block, (dtype, _) in zip(blocks, layout)]


def _reinterpret(block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    typed = torch.empty(block.shape[0], block.shape[1] // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=block.device)
    typed.view(torch.uint8).copy_(block)
    return typed


def _shard_submesh(mesh: DeviceMesh) -> DeviceMesh:
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(on_rank("the all-gather extension on a 2-D mesh needs mesh_dim_names (its hooks get the shard dim's mesh)"))
    return mesh[names[-1]]


def _torch_policy(policy: MixedPrecisionPolicy) -> Any:
    """The policy as torch's own class, which the hooks are written against."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    return TorchPolicy(policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs)
