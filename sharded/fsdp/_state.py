"""What drives a unit through each step: its modules' hooks, which reach the model's root.

``fully_shard`` puts a forward pre-hook and a forward hook on each module of a unit; both call the
unit's :class:`UnitState`, which sets the autograd hooks that tell when backward reaches the unit
and when the unit's backward is done (:mod:`._hooks`). At each of these events the state does the
unit's part by calling the :class:`~._unit.Unit`, and the model's part (order, prefetching,
reductions in flight, the end of backward) by calling the :class:`~._root.Root`, which the first
unit to run claims at the model's first forward. As in FSDP2, where the param group never
references the state that drives it, the unit knows neither the state nor the root: the layers
run unit <- root <- state, with no way back up.

``fully_shard.state(module)`` returns the state: it also answers the two members of torch's
``FSDPState`` that torch's own ``register_fsdp_forward_method`` calls.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch
from torch import nn

from .._common.errors import on_rank
from ._hooks import register_pre_backward
from ._root import Root
from ._unit import TrainingState, Unit
from .policies import BackwardPrefetch

__all__ = ["UnitState", "state_of", "register_with_torch"]

# on the unit's modules, beside the unit itself (see _unit.unit_of)
_STATE_ATTRIBUTE = "_sharded_fsdp_state"


def state_of(module: nn.Module) -> Optional["UnitState"]:
    """``fully_shard.state(module)``: the state of the ``fully_shard`` call applied to ``module``
    (the same object every time; one for all modules of a list unit), or ``None`` if none was,
    as torch's returns its ``FSDPState``."""
    return module.__dict__.get(_STATE_ATTRIBUTE)


class UnitState:
    """The hooks of one ``fully_shard`` call: what runs when its modules' forward starts and
    ends, when backward reaches the unit and when its backward is done."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        self.root: Optional[Root] = None  # the model's root, from the model's first forward on
        for module in unit.modules:
            module.__dict__[_STATE_ATTRIBUTE] = self

    # ------------------------------------------------------------------------ forward

    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        root, unit = self._claimed_root(), self.unit
        root.check_no_pending_reduction()
        if root.in_backward and not unit.runs_as_new_forward():
            unit.unshard()  # recomputed for a backward already set up (non-reentrant checkpointing)
            return args, kwargs
        if unit.training_state is not TrainingState.FORWARD:  # the first of a list unit's modules
            self._begin_forward(root)
        args, kwargs = unit.cast_inputs(args, kwargs)
        if torch.is_grad_enabled():
            unit.backward.watch_forward_call(args, kwargs, unit.settings.requires_gradient_sync, self._backward_done)
        return args, kwargs

    def _begin_forward(self, root: Root) -> None:
        """The unit's forward starts: gather. A model's forward also records the order units run
        in and prefetches the next; a forward recomputed inside backward touches neither (that
        order is the model's forward, and the unit's backward follows at once)."""
        unit = self.unit
        unit.begin_forward()
        if root.in_backward:
            unit.unshard()
            return
        if root.unit is unit:
            root.begin_forward()
        root.record_forward(unit)
        unit.unshard(async_op=unit.settings.unshard_async_op)
        root.prefetch_forward(unit)
        unit.wait_for_unshard()

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        root, unit = self._running_root(), self.unit
        if root.in_backward and unit.training_state is not TrainingState.FORWARD:
            return output  # a recompute that only refilled saved tensors
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            register_pre_backward(self.pre_backward, output)
        if unit.forward_done_after(module):
            if root.in_backward:
                unit.end_recomputed_forward()
            else:
                root.complete_forward(unit, grad_enabled)
        output = unit.cast_output(output)
        if root.unit is unit and not root.in_backward:
            root.end_forward(grad_enabled)
        return output

    # ----------------------------------------------------------------------- backward

    def pre_backward(self) -> None:
        root, unit = self._running_root(), self.unit
        root.begin_backward()
        if unit.begin_backward() and unit.settings.backward_prefetch_timing is BackwardPrefetch.BACKWARD_PRE:
            root.prefetch_backward(unit)

    def _backward_done(self) -> None:
        if self.unit.training_state is TrainingState.PRE_BACKWARD:
            self._running_root().post_backward(self.unit)

    # --------------------------------------------------------------------------- root

    def _claimed_root(self) -> Root:
        """The model's root; at the model's first forward, the first unit to run claims every
        unit below it, whose states then reach that root too (collective)."""
        root = self.root
        if root is None:
            root = Root.claim(self.unit)
            for unit in root.units:
                unit.module.__dict__[_STATE_ATTRIBUTE].root = root
        return root

    def _running_root(self) -> Root:
        """The root, known from the model's first forward on (every hook but the first runs after)."""
        if self.root is None:
            raise RuntimeError(f"{self.unit!r} has no root yet: the model has not run forward")
        return self.root

    # ------------------------------------------------------------ torch's FSDPState

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return self.pre_forward(module, args, kwargs)

    def _post_forward(self, module: nn.Module, _input: Any, output: Any) -> Any:
        return self.post_forward(module, output)

    # torch 2.13's pipelining ends its micro-batches' backward itself
    # (PipelineStage.perform_reduce_grad): each param group's post_backward() for every state
    # under the stage's root, then the root's final callback

    @property
    def _state_ctx(self) -> "_TorchStateContext":
        return _TorchStateContext([state_of(u.module) for u in self._running_root().units])

    @property
    def _fsdp_param_groups(self) -> list["_TorchParamGroup"]:
        return [_TorchParamGroup(self)]

    def _root_post_backward_final_callback(self) -> None:
        self._running_root().finish_backward()

    def send_gradients(self) -> None:
        """Send what the unit holds now (what its backward computed, with what it accumulated
        while sync was off), as torch's param group ``post_backward()`` does."""
        self._running_root().post_backward(self.unit)

    def __getattr__(self, name: str) -> Any:
        raise NotImplementedError(on_rank(
            f"torch FSDP internals asked a sharded.fully_shard module for FSDPState.{name}; sharded's "
            "units keep their state in sharded.fsdp, not in torch's FSDPState"
        ))


class _TorchStateContext:
    """torch's ``FSDPStateContext``, as far as its pipelining reads it: the model's states."""

    def __init__(self, all_states: list[Optional[UnitState]]) -> None:
        self.all_states = all_states


class _TorchParamGroup:
    """torch's ``FSDPParamGroup``, as far as its pipelining calls it."""

    def __init__(self, state: UnitState) -> None:
        self._state = state

    def post_backward(self) -> None:
        self._state.send_gradients()


def register_with_torch(modules: list[nn.Module], state: UnitState) -> None:
    """Make ``state`` what torch's own ``fully_shard.state(module)`` returns for ``modules``, where
    torch's pipelining looks a stage's FSDP state up (it asks ``isinstance(m, FSDPModule)``,
    which ours are, then reads torch's state). torch's function is taken where torch defines it,
    which ``use_for_torch_fsdp`` leaves alone. Where torch keeps composable states otherwise (no
    ``STATE_KEY``, or its ``fully_shard`` not a wrapped function), nothing is registered."""
    torch_fully_shard = importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard").fully_shard
    contract = importlib.import_module("torch.distributed._composable.contract")  # the package's name is the function
    key, func = getattr(contract, "STATE_KEY", None), getattr(torch_fully_shard, "__wrapped__", None)
    if key is None or func is None:
        return
    for module in modules:
        module.__dict__.setdefault(key, {})[func] = state
