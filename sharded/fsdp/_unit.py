"""The unit: the parameters one ``fully_shard`` call groups, communicated together.

A unit all-gathers its shards before its module computes and frees the gathered parameters
after; it reduce-scatters its gradients as soon as its backward is done. Two enums say where it
is, instead of a scatter of booleans: :class:`ShardState` (what memory it holds) and
:class:`TrainingState` (where in the step it is).

A unit is FSDP2's param group, and like it does not know what drives it: its modules' hooks
(:class:`~._state.UnitState`) call it at each event of the step, and call the model's
:class:`~._root.Root` for what concerns the whole model (lazy set-up, execution order,
prefetching, reductions in flight, the end of backward). What the unit shares with the rest of
its model is data: the :class:`~._settings.StepContext`.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from .._common.errors import on_rank
from ._collectives import ProfilerLabels
from ._gather import GatherRoute, ParamGather
from ._gather_kinds import gathers_for
from ._grad_dtypes import accumulation_dtype, grads_follow_grad_dtype, reduce_dtype_for
from ._hooks import BackwardTracker, cast_floats
from ._lowbit import new_wire
from ._lowbit_reduce import GradientWire, row_key
from ._param import ShardedParam
from ._placement.mesh import MeshInfo
from ._placement.secondary_shard import SecondaryShardGroup
from ._reduction import GradientReducer, UnitReduction
from ._registry import register_sharded, retire
from ._settings import StepContext, UnitSettings
from ._streams import CommStreams

__all__ = ["ShardState", "TrainingState", "Unit", "unit_of", "units_under"]

# A module keeps the unit fully_shard made over it in its own __dict__: a global map would be
# kept alive by the unit's references to its modules, so a model dropped by its user, with every
# shard it holds, would never be freed.
_UNIT_ATTRIBUTE = "_sharded_fsdp_unit"
_STREAMS: dict[torch.device, CommStreams] = {}


class ShardState(enum.Enum):
    SHARDED = enum.auto()  # only this rank's shards; the module shows DTensor parameters
    GATHERING = enum.auto()  # an all-gather is in flight
    UNSHARDED = enum.auto()  # full parameters in place; the module shows them


class TrainingState(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()  # backward reached the unit; its own backward ops are running
    POST_BACKWARD = enum.auto()  # its backward is done and its gradients are on their way


def unit_of(module: nn.Module) -> Optional["Unit"]:
    """The unit ``fully_shard(module)`` made, if any."""
    return module.__dict__.get(_UNIT_ATTRIBUTE)


def units_under(module: nn.Module) -> list["Unit"]:
    """The units of ``module`` and its submodules, outermost first (a unit made over several
    modules once)."""
    found = {unit_of(m): None for m in module.modules()}
    return [u for u in found if u is not None]


class Unit:
    """One ``fully_shard`` call's parameters, with their collectives and lifecycle.

    The unit keeps where it is (the two enums) and drives its parts, each with one job:
    ``settings`` (:class:`~._settings.UnitSettings`: what ``fully_shard`` was given and what the
    module's methods, FSDP2's ``FSDPModule`` API, change later); ``gathers`` (a
    :class:`~._gather.ParamGather` per kind of storage: the plain parameters' flat buffers, the
    all-gather extension's); ``reducer`` (:class:`~._reduction.GradientReducer`); ``backward``
    (:class:`~._hooks.BackwardTracker`); ``lowbit_wire`` (the low-bit collectives of
    ``settings.lowbit``, ``None`` without it: :mod:`._lowbit`).

    ``modules``: the module(s) one ``fully_shard`` call was given; a list makes one unit that
    all of them use (e.g. a final norm and the output head).

    ``module_name`` names the unit in errors, warnings and profiler labels: its module's path in
    the model (``layers.3``; the root module by its class), as torch names an FSDP module by its
    FQN. Paths are known once the root is (:meth:`name_by_paths`); until then, the class names.
    """

    def __init__(self, modules: Sequence[nn.Module], params: Sequence[ShardedParam], mesh_info: MeshInfo, settings: UnitSettings) -> None:
        self.modules = list(modules)
        self._class_names = [type(m).__name__ for m in self.modules]  # before fully_shard swaps the classes
        self.name_by_paths([""] * len(self.modules))
        self.params = list(params)
        self.mesh_info = mesh_info
        self.settings = settings
        self.context = StepContext()  # the model's, once its root is known
        self.gathers = gathers_for(self.params, mesh_info, settings)
        self.streams = _streams_for(mesh_info.device)
        self.reducer = GradientReducer(mesh_info, settings, self.streams)
        # settings.lowbit's collectives; shared with the model's other units by the root (_lowbit)
        self.lowbit_wire = new_wire(settings.lowbit, mesh_info)
        self.backward = BackwardTracker()
        self.shard_state = ShardState.SHARDED
        self.training_state = TrainingState.IDLE
        self._modules_to_run: set[nn.Module] = set()  # of a list unit, in this forward
        for module in self.modules:
            module.__dict__[_UNIT_ATTRIBUTE] = self

    def __repr__(self) -> str:
        return f"fully_shard({self.module_name}) on rank {dist.get_rank()}"

    def name_by_paths(self, paths: Sequence[str]) -> None:
        """Name the unit by its modules' ``paths`` in the model (``""``: the root, or not yet
        known, shown as the module's class)."""
        names = [path or cls for cls, path in zip(self._class_names, paths)]
        self.module_name = names[0] if len(names) == 1 else f"[{', '.join(names)}]"
        self.labels = ProfilerLabels.naming(self.module_name)

    @property
    def module(self) -> nn.Module:
        """The module ``fully_shard`` was given (of a list, the first)."""
        return self.modules[0]

    def accumulation_dtype(self, sp: ShardedParam) -> Optional[torch.dtype]:
        """The dtype ``sp``'s gradient is accumulated in while sync is off and reduced in
        (``None``: its own): :func:`._grad_dtypes.accumulation_dtype`."""
        return accumulation_dtype(self.settings.mp_policy, self._master_dtype, sp.grad_dtype)

    def reduce_dtype_for(self, params: Sequence[ShardedParam], grads: Sequence[Optional[torch.Tensor]]) -> torch.dtype:
        """The dtype one reduction of ``params``' ``grads`` runs in: :func:`._grad_dtypes.reduce_dtype_for`."""
        return reduce_dtype_for([self.accumulation_dtype(sp) for sp in params], grads, self._master_dtype)

    @property
    def _master_dtype(self) -> torch.dtype:
        """The shards' dtype (the plain parameters' if there are any)."""
        return self.gathers[0].dtype

    def shard_from_full(self, fulls: Sequence[torch.Tensor]) -> None:
        """Build the shards from the full parameters (in ``params`` order)."""
        full_of = {id(sp): full for sp, full in zip(self.params, fulls)}
        for gather in self.gathers:
            gather.shard_from_full([full_of[id(sp)] for sp in gather.params])

    def reshard_at_rest(self) -> None:
        """Before a state dict is read or loaded: show the shards (a unit kept gathered after
        forward or backward would otherwise be read, or loaded into, in its gathered form)."""
        if self.training_state is TrainingState.IDLE:
            self.reshard()

    def adopt_assigned_params(self, shards_only: bool = False) -> None:
        """Take as the sharded parameter whatever the module now holds in its place while the
        unit is sharded (``load_state_dict(assign=True)``, as Accelerate's and DCP's loading of a
        meta-device model does, or plain assignment): the forward computes with it and its
        ``.grad`` gets the gradient, as with torch's FSDP2; the parameter it replaced is retired,
        so an optimizer still holding that one raises at its step instead of training nothing.

        ``shards_only``: leave alone a replacement that is not a DTensor (``summon_full_params``
        shows full ones), for the gather before the next forward to refuse, naming it.
        """
        if self.shard_state is not ShardState.SHARDED:
            return
        for sp in self.params:
            held = sp.held_by_module()
            if held is sp.sharded or (shards_only and not isinstance(held, DTensor)):
                continue
            replaced = sp.sharded
            try:
                sp.adopt(held)
            except (TypeError, ValueError) as bad:
                raise type(bad)(on_rank(f"fully_shard({self.module_name}): {bad}")) from None
            register_sharded(sp.sharded, self)
            retire(replaced, self, sp, before="load_state_dict(assign=True) or an assignment replaced it")

    # ------------------------------------------------------------------ communication

    def unshard(self, async_op: bool = False) -> None:
        """Start gathering the full parameters (if not yet); unless ``async_op``, wait for them."""
        if self.shard_state is ShardState.SHARDED:
            self._start_gather()
        if not async_op:
            self.wait_for_unshard()

    def _start_gather(self) -> None:
        self.adopt_assigned_params()
        for gather in self.gathers:
            gather.prepare(where=repr(self))
        self.streams.all_gather_after_compute()  # e.g. the optimizer step wrote the shards
        route = self._gather_route()
        with self.streams.on_all_gather(), record_function(self.labels.all_gather):
            for gather in self.gathers:
                gather.start(route)
        self.shard_state = ShardState.GATHERING

    def _gather_route(self) -> GatherRoute:
        """Over the shard group; in backward, a secondary shard kept by the forward is gathered
        within its group instead."""
        info, asked = self.mesh_info, self.settings
        secondary = asked.secondary_shard if self.context.in_backward else None
        return GatherRoute(info.shard_group, info.shard_world, asked.custom_all_gather, secondary, self.lowbit_wire, self.module_name)

    def wait_for_unshard(self) -> None:
        """Finish an all-gather in flight and show the full parameters to the module."""
        if self.shard_state is not ShardState.GATHERING:
            return
        keep = self._secondary_shard_to_keep()
        with self.streams.on_all_gather():
            for gather in self.gathers:
                gather.finish(keep)
            ready = self.streams.record()
        self.streams.compute_waits(ready)
        for sp in self.params:
            sp.show_unsharded()
            sp.accept_grads_in(self.accumulation_dtype(sp))
        self.shard_state = ShardState.UNSHARDED

    def _secondary_shard_to_keep(self) -> Optional[SecondaryShardGroup]:
        """``reshard_after_forward=k``: a grad-enabled forward's gather keeps this rank's
        secondary shard for backward."""
        forward = self.training_state is TrainingState.FORWARD and not self.context.in_backward
        return self.settings.secondary_shard if forward and torch.is_grad_enabled() else None

    def reshard(self) -> None:
        """Show the sharded parameters again and free the gathered ones."""
        if self.shard_state is ShardState.SHARDED:
            return
        self.wait_for_unshard()
        self._show_shards()

    def _show_shards(self) -> None:
        """The module holds the shards again; the gathered memory is freed, unless
        ``set_keep_unsharded_storage`` keeps it (the next gather refills it in place)."""
        for sp in self.params:
            sp.show_sharded()
        self.streams.all_gather_after_compute()
        for gather in self.gathers if not self.settings.keep_unsharded_storage else []:
            gather.free()
        self.shard_state = ShardState.SHARDED

    # ------------------------------------------------------------------------ forward

    def runs_as_new_forward(self) -> bool:
        """A forward during backward builds a graph of its own whose backward comes next, and is
        set up as any forward, when no earlier forward's backward is pending for the unit: the
        recompute of reentrant checkpointing (``use_reentrant=True``, Megatron's full recompute),
        whose first forward ran without grad, or which runs again after the unit sent its
        gradients (a block used twice). Otherwise it only refills tensors that the pending
        backward saved (non-reentrant checkpointing), and the hooks of the first forward stay in
        charge."""
        if not torch.is_grad_enabled():
            return False
        # FORWARD: a list unit between its modules within such a forward; POST_BACKWARD: it sent
        # its gradients already, so no backward of its is pending
        if self.training_state in (TrainingState.FORWARD, TrainingState.POST_BACKWARD):
            return True
        return not self.backward.awaiting

    def begin_forward(self) -> None:
        """Enter FORWARD: each of the unit's modules is expected to run once."""
        self.training_state = TrainingState.FORWARD
        self._modules_to_run = set(self.modules)

    def cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        mp = self.settings.mp_policy
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            return cast_floats((args, kwargs), mp.param_dtype)
        return args, kwargs

    def cast_output(self, output: Any) -> Any:
        dtype = self.settings.mp_policy.output_dtype
        return output if dtype is None else cast_floats(output, dtype)

    def forward_done_after(self, module: nn.Module) -> bool:
        """``module`` ran its forward: whether that ends the unit's forward (its last module)."""
        self._modules_to_run.discard(module)
        return not self._modules_to_run and self.training_state is TrainingState.FORWARD

    def complete_forward(self, grad_enabled: bool) -> None:
        """Every module of the unit has run (or the root's forward ended): free the gathered
        parameters unless backward will want them kept."""
        self._modules_to_run = set()
        if not (grad_enabled and self.settings.reshard_after_forward is False):
            self.reshard()
        self.training_state = TrainingState.IDLE

    def end_recomputed_forward(self) -> None:
        """A forward recomputed in backward ended: its backward runs next, so the parameters
        stay gathered for it."""
        self.training_state = TrainingState.IDLE

    # ----------------------------------------------------------------------- backward

    def begin_backward(self) -> bool:
        """Backward reached the unit: gather its parameters for it. Whether it had not already."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            return False
        self.training_state = TrainingState.PRE_BACKWARD
        if self.settings.unshard_in_backward:
            self.unshard(async_op=True)
        # the next unit's all-gather starts once this one's has landed and been copied out: two
        # gathers in flight beside a copy-out would hold a third unit-sized buffer at the moment
        # backward holds the most activations; its gather still overlaps this unit's backward
        self.wait_for_unshard()
        return True

    @property
    def needs_post_backward(self) -> bool:
        """At the end of backward: backward reached the unit but its gradients were not sent; or
        some arrived after they were sent (a module output that does not depend on its inputs can
        be differentiated after them); or it ran a grad-enabled forward that backward never
        reached (every rank then sends zeros alike)."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            return True
        if self.training_state is TrainingState.POST_BACKWARD:
            return any(sp.unsharded is not None and sp.unsharded.grad is not None for sp in self.params)
        return self.backward.awaiting

    def post_backward(self, fills_grads: bool = True, syncs: Optional[bool] = None) -> Optional[Callable[[], UnitReduction]]:
        """The unit's backward is done: take its gradients (with sync off, keep them locally),
        then reshard. Returns what starts sending them, for the root to call when a reduction
        may start (``None``: nothing to send). ``fills_grads=False``: the backward filled no
        ``.grad`` (``torch.autograd.grad``), and the unit leaves its gradients as they are.
        ``syncs``: whether to send, instead of the sync setting that applies to this backward
        (manual finalization decides at its own time)."""
        self.training_state = TrainingState.POST_BACKWARD
        trainable = [sp for sp in self.params if sp.requires_grad] if fills_grads else []
        sending = bool(trainable) and (self._syncs() if syncs is None else syncs)
        if sending:
            self._check_unused_can_land(trainable)
        grads = [sp.take_unsharded_grad(self.accumulation_dtype(sp)) for sp in trainable] if sending else []
        if not sending:
            for sp in trainable:
                sp.keep_unsynced(self.accumulation_dtype(sp))
        if self.settings.reshard_after_backward:  # first: the gathered parameters go before the send buffer comes
            self.reshard()
        if not sending:
            return None
        dtype = self.reduce_dtype_for(trainable, grads)
        return lambda: self.reducer.start(trainable, grads, dtype, self.labels, self._gradient_wire(trainable))

    def _gradient_wire(self, trainable: list[ShardedParam]) -> Optional[GradientWire]:
        """The low-bit wire the gradients go through. Their residuals are named by the unit's path
        and a checksum of the parameters in the row: a row of the same length holding other
        parameters (one frozen, another of its shape unfrozen) never takes their residuals."""
        if self.lowbit_wire is None:
            return None
        return GradientWire(self.lowbit_wire, self.module_name, row_key(self.module_name, trainable))

    def _check_unused_can_land(self, trainable: list[ShardedParam]) -> None:
        """``set_reduce_scatter_unused_params(True)`` sends zeros for a parameter without a
        gradient, which needs a dtype every rank agrees on: a parameter whose ``grad_dtype`` is
        ``None`` has none unless ``reduce_dtype`` is set. Checked on every rank alike, whether
        or not the gradient came, as torch checks it, so no rank waits for another."""
        if not self.settings.reduce_scatter_unused_params:
            return
        for sp in trainable:
            if self.accumulation_dtype(sp) is None:
                raise ValueError(on_rank(
                    f"fully_shard({self.module_name}): parameter {sp.fqn} has grad_dtype=None, and its gradient, when "
                    "unused, would be sent as zeros of no agreed dtype (set_reduce_scatter_unused_params(True)); "
                    "set MixedPrecisionPolicy(reduce_dtype=...) to the dtype its gradients have, or set its grad_dtype"
                ))

    def _syncs(self) -> bool:
        """Whether the gradients go now: ``requires_gradient_sync`` as it is (torch's FSDP2
        reads it in backward, where pipelining schedules turn it off), and as it was at the
        forward whose backward this is (DDP's habit: a forward inside ``no_sync``). Outside a
        backward (a schedule sending what its micro-batches accumulated), as it is."""
        return self.settings.requires_gradient_sync and (self.backward.syncs or not self.backward.awaiting)

    def reset(self) -> None:
        """Back to rest after a failed forward or backward: gathered parameters freed, the
        step's gradients not yet reduced (accumulated with sync off, or awaiting a deferred
        all-reduce) dropped; with torch 2.15 on, as its ``reset_iter_state`` does (in the same
        change as its gradient dtypes, :mod:`._grad_dtypes`), the sharded ``.grad`` too, so no
        step runs on the gradients of the units a failed backward had already reduced."""
        for gather in self.gathers:
            gather.discard()  # an all-gather in flight is waited for, not copied out
        if self.shard_state is not ShardState.SHARDED:
            self._show_shards()
        for sp in self.params:
            sp.unsynced_grad = None
            if sp.unsharded is not None:
                sp.unsharded.grad = None
            if grads_follow_grad_dtype():  # torch 2.15's reset also drops what earlier units landed
                sp.sharded.grad = None
        self.reducer.drop_partial()
        self._modules_to_run = set()
        self.training_state = TrainingState.IDLE
        self.backward.reset()

    def finish_step(self) -> None:
        """End of backward: every gradient has landed. An all-gather still in flight (prefetched
        for a backward that never reached the unit) is finished or freed here, not left for the
        next forward, or for the interpreter at exit, to find."""
        if self.settings.reshard_after_backward:
            self.reshard()
        else:
            self.wait_for_unshard()
        for gather in self.gathers:
            gather.discard()  # a secondary shard no backward gathered
        self.training_state = TrainingState.IDLE
        self.backward.reset()

    # ------------------------------------------------------------------ full parameters

    def gather_full_copies(self, device: Optional[torch.device] = None) -> list[torch.Tensor]:
        """Collective: fresh full copies of the parameters in the shards' own dtype."""
        self.adopt_assigned_params(shards_only=True)
        route = GatherRoute(self.mesh_info.shard_group, self.mesh_info.shard_world)
        with record_function(self.labels.all_gather):
            copies = {
                id(sp): full for gather in self.gathers for sp, full in zip(gather.params, gather.full_copies(route, where=repr(self)))
            }
        fulls = [copies[id(sp)] for sp in self.params]
        return [full.to(device) for full in fulls] if device is not None else fulls


def _streams_for(device: torch.device) -> CommStreams:
    """The side streams of ``device``, one pair for every unit computing there."""
    if device not in _STREAMS:
        _STREAMS[device] = CommStreams(device)
    return _STREAMS[device]
