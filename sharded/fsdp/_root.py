"""What the outermost unit of a model does for all of them.

The first unit whose forward runs becomes the root of every unit below it (lazily, as in FSDP2:
only then is the whole tree known). The units' hooks (:mod:`._state`) call the root at each event
of the step; the root calls the units, which never call it back (they share its
:class:`~._settings.StepContext`, nothing more).

The root names units and parameters by their full paths (module paths are what errors and
profiler labels show, as torch's FQNs), checks that every rank built the same model before the
first collective can hang on a mismatch, records the orders units start and end their forward in
(to prefetch the next one's all-gather in forward and in backward), keeps a bounded number of
gradient reductions in flight, and owns the end of backward: one autograd-engine callback,
queued when backward first reaches any unit, that sends what is left, waits for every gradient
in flight, and returns the units to rest. With manual finalization (:mod:`._finalization`) the
callback keeps what is left instead and leaves the reductions in flight, for
:meth:`Root.finalize_backward` to send and wait for when the caller says.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from torch import nn

from .._common.checks import check_same_across_ranks
from .._common.errors import on_rank
from .._common.in_flight import MAX_REDUCTIONS_IN_FLIGHT, InFlight
from ._extension import check_no_late_hooks
from ._finalization import GradientReductionHandle
from ._graph_task import accumulates_gradient
from ._lowbit import end_step, share_wires
from ._reduction import UnitReduction
from ._unit import ShardState, TrainingState, Unit, unit_of, units_under
from .policies import BackwardPrefetch

__all__ = ["Root"]

logger = logging.getLogger(__name__)


class Root:
    """The model-wide state of a forward and backward: the outermost unit (``unit``) and every
    unit below it (``units``, outermost first), which all reach it through their hooks."""

    def __init__(self, unit: Unit, units: list[Unit]) -> None:
        self.unit = unit
        self.units = units
        self.forward_order: list[Unit] = []  # in the order their forward started
        self.backward_order: list[Unit] = []  # the reverse of the order their forward ended
        self._after: dict[str, dict[Unit, Unit]] = {"forward": {}, "backward": {}}  # each order's next unit
        self._this_forward: dict[Unit, None] = {}
        self._ended_this_forward: dict[Unit, None] = {}
        self._reductions: InFlight[UnitReduction] = InFlight()
        self._kept: dict[Unit, None] = {}  # units whose last backward kept its gradients unsent
        self._fills_grads_by_task: dict[int, bool] = {}  # of this backward's graph tasks

    @classmethod
    def claim(cls, unit: Unit) -> "Root":
        """Make ``unit`` the root of every unit in its module's subtree (collective)."""
        if len(unit.modules) > 1:
            raise RuntimeError(on_rank(
                f"fully_shard({unit.module_name}) made one unit over several modules, and one of them ran "
                "forward first, so it would be the root; apply fully_shard to their common parent too"
            ))
        units = units_under(unit.module)
        paths = {id(m): path for path, m in unit.module.named_modules()}
        for u in units:
            u.name_by_paths([paths.get(id(m), "") for m in u.modules])
        busy = [u for u in units if u.training_state is not TrainingState.IDLE]
        if busy:
            raise RuntimeError(f"{busy[0]} is in {busy[0].training_state.name} while {unit} starts its first forward as the root")
        manual = [u for u in units if u is not unit and u.context.finalization.enabled]
        if manual:
            raise RuntimeError(on_rank(
                f"set_manual_backward_finalization must be called on the root module ({unit.module_name}), "
                f"not on {manual[0].module_name}"
            ))
        root = cls(unit, units)
        share_wires(units)
        for u in units:
            u.context = unit.context
            if u.settings.reshard_after_forward is None:  # FSDP2's default: True, except for the root
                u.settings.reshard_after_forward = u is not unit
        for u in units:  # parameters assigned before the first forward are named by their paths too
            u.adopt_assigned_params(shards_only=True)
        root._name_params_by_paths(unit.module)
        root._check_same_across_ranks()
        check_no_late_hooks([sp for u in units for sp in u.params])
        logger.debug("%s is the root of %d units", unit, len(units))
        return root

    def _name_params_by_paths(self, module: nn.Module) -> None:
        """Each parameter by its full name below ``module``."""
        names = {id(p): name for name, p in module.named_parameters()}
        for u in self.units:
            for sp in u.params:
                sp.fqn = names.get(id(sp.sharded), sp.fqn)

    def _check_same_across_ranks(self) -> None:
        named = [(sp.fqn, sp.sharded) for u in self.units for sp in u.params]
        info = self.unit.mesh_info
        groups = [info.shard_group] + ([info.replicate_group] if info.replicate_group is not None else [])
        try:
            for group in groups:
                check_same_across_ranks(named, group, "fully_shard parameters")
        except ValueError as mismatch:
            raise ValueError(on_rank(str(mismatch))) from mismatch

    @property
    def in_backward(self) -> bool:
        """From the first unit backward reaches to the end of backward."""
        return self.unit.context.in_backward

    # ------------------------------------------------------------------------ forward

    def check_no_pending_reduction(self) -> None:
        """A forward of any unit waits for the handle of an asynchronous finalization first."""
        if self.unit.context.finalization.pending is not None:
            raise RuntimeError(on_rank(
                "The previous gradient reduction must be waited on before forward: call wait() on the "
                "handle finalize_backward(async_op=True) returned"
            ))

    def begin_forward(self) -> None:
        self._this_forward = {}
        self._ended_this_forward = {}
        event, self.unit.context.post_optim_event = self.unit.context.post_optim_event, None
        if event is not None:
            for streams in {u.streams for u in self.units}:
                streams.all_gather_waits(event)

    def record_forward(self, unit: Unit) -> None:
        self._this_forward.setdefault(unit)

    def complete_forward(self, unit: Unit, grad_enabled: bool) -> None:
        """Every module of ``unit`` has run (or this forward ended without some of them)."""
        self._ended_this_forward.setdefault(unit)
        unit.complete_forward(grad_enabled)

    def end_forward(self, grad_enabled: bool) -> None:
        """Remember this forward's orders; free whatever no backward will need."""
        for u in self.units:
            if u is not self.unit and u.training_state is TrainingState.FORWARD:
                self.complete_forward(u, grad_enabled)  # a list unit some of whose modules did not run
        self.forward_order = list(self._this_forward)
        # backward runs a unit's gradients once every unit that used its outputs is done: in
        # the reverse of the order forwards ended (the root first, then its last child), not of
        # the order they started (where the root comes first and so would prefetch nothing)
        self.backward_order = list(reversed(self._ended_this_forward))
        for name, order in (("forward", self.forward_order), ("backward", self.backward_order)):
            self._after[name] = dict(zip(order, order[1:]))
        for u in self.units:
            unused_prefetch = u is not self.unit and not u.backward.awaiting and u.settings.reshard_after_forward
            if not grad_enabled or (unused_prefetch and u.shard_state is not ShardState.SHARDED):
                u.reshard()

    def prefetch_forward(self, unit: Unit) -> None:
        """Start the all-gather of the unit(s) to run after ``unit``."""
        asked = unit.settings.forward_prefetch
        targets = _units_of(asked) if asked is not None else self._next("forward", unit)
        for target in targets:
            target.unshard(async_op=True)

    def prefetch_backward(self, unit: Unit) -> None:
        """Start the all-gather of the unit(s) whose backward comes after ``unit``'s."""
        asked = unit.settings.backward_prefetch
        if asked is not None:
            targets = _units_of(asked)
        else:
            targets = [u for u in self._next("backward", unit) if u.backward.awaiting]
        for target in targets:
            if target.training_state is not TrainingState.POST_BACKWARD:
                target.unshard(async_op=True)

    def _next(self, order: str, unit: Unit) -> list[Unit]:
        """The unit after ``unit`` in the last forward's ``order`` ("forward" or "backward"):
        none if it is last or did not run."""
        after = self._after[order].get(unit)
        return [after] if after is not None else []

    # ----------------------------------------------------------------------- backward

    def begin_backward(self) -> None:
        """Queue the end-of-backward callback once per backward."""
        if not self.in_backward:
            self.unit.context.in_backward = True
            self.unit.context.finalization.begin_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _fills_grads(self) -> bool:
        """Whether the running backward accumulates into the gathered parameters of any unit
        (``torch.autograd.grad`` does not: it returns what it was asked for). Decided for the
        whole model, never per unit (a unit whose parameters a rank's forward happened not to use
        still sends zeros, as the other ranks' reduction expects), once per graph task: the
        backward a reentrant checkpoint runs inside another differentiates other parameters."""
        task = torch._C._current_graph_task_id()
        if task == -1:  # called outside any backward
            return True
        if task not in self._fills_grads_by_task:
            gathered = (sp.unsharded for u in self.units for sp in u.params if sp.requires_grad)
            self._fills_grads_by_task[task] = any(accumulates_gradient(p) for p in gathered if p is not None and p.requires_grad)
        return self._fills_grads_by_task[task]

    def post_backward(self, unit: Unit) -> None:
        """``unit``'s backward is done: its gradients go, and (``BACKWARD_POST``) the next
        unit's all-gather starts."""
        # manual finalization follows torch 2.15 (whose pipelining turns sync off between a
        # microbatch's forward and its backward): the setting when the backward is done decides;
        # automatic, the setting at the unit's forward, as DDP's no_sync
        syncs = unit.settings.requires_gradient_sync if self.unit.context.finalization.active else None
        self._send_or_keep(unit, syncs)
        if unit.settings.backward_prefetch_timing is BackwardPrefetch.BACKWARD_POST:
            self.prefetch_backward(unit)

    def _send_or_keep(self, unit: Unit, syncs: Optional[bool] = None) -> None:
        """``unit``'s post-backward: start reducing its gradients, or (sync off) note that it
        keeps them, for a finalization to send."""
        fills_grads = self._fills_grads()
        start = unit.post_backward(fills_grads, syncs)
        if start is None:
            self._kept.setdefault(unit)
            return
        self._kept.pop(unit, None)
        self._add_reduction(start)

    def _add_reduction(self, start: Callable[[], UnitReduction]) -> None:
        """Start a unit's reduction (``start()`` packs its gradients and sends them), finishing
        the oldest in flight first when the limit is reached: their send buffers are freed
        before the new one is allocated, not after."""
        for older in self._reductions:
            if older.hybrid:  # its scatter done, start its all-reduce
                older.advance()
        for oldest in self._reductions.beyond(self._max_in_flight() - 1):
            oldest.finish()
        self._reductions.add(start())

    def _max_in_flight(self) -> int:
        """``set_reduce_scatter_max_input_buffers``: the largest any unit asked for."""
        asked = [u.settings.max_reductions_in_flight for u in self.units if u.settings.max_reductions_in_flight is not None]
        return max(asked, default=MAX_REDUCTIONS_IN_FLIGHT)

    def reset(self) -> None:
        """``reset_iter_state``: wait for every collective in flight (so the ranks stay in step),
        drop the gradients they carry, and return every unit to rest (each unit's ``reset`` says
        which gradients go)."""
        for reduction in self._reductions.beyond(0):
            reduction.abandon()
        for u in self.units:
            u.reset()
        self._kept = {}
        self._this_forward = {}
        self._ended_this_forward = {}
        self.unit.context.in_backward = False
        self.unit.context.finalization.end_iteration()  # a pending handle's wait() now raises
        self._fills_grads_by_task = {}

    def finish_backward(self) -> None:
        """End the backward now: what the end-of-backward callback does, for torch's pipelining
        schedules, which end their micro-batches' backward themselves."""
        self._finish_backward()

    def _finish_backward(self) -> None:
        """The autograd engine's callback at the end of a backward that reached a unit."""
        try:
            if self.unit.context.finalization.active:  # manual: keep what is left, for finalize_backward
                for u in self.units:
                    if u.needs_post_backward:
                        self._send_or_keep(u, syncs=False)
                    u.finish_step()
                return
            for u in self.units:
                if u.needs_post_backward:
                    self.post_backward(u)
            if self.unit.context.is_last_backward:
                self._end_iteration()
            else:  # set_is_last_backward(False) (microbatching): the newest reductions may land later
                self._land_reductions(keep=self._max_in_flight())
        finally:
            self.unit.context.in_backward = False
            self._fills_grads_by_task = {}

    def _land_reductions(self, keep: int) -> None:
        """Finish the reductions in flight but the newest ``keep``; return the units to rest."""
        for oldest in self._reductions.beyond(keep):
            oldest.finish()
        for streams in {u.streams for u in self.units}:
            streams.compute_after_reduce_scatter()
            if any(u.settings.offloads for u in self.units):
                streams.host_waits(streams.record())  # gradients copied to the CPU
        for u in self.units:
            u.finish_step()

    def _end_iteration(self) -> None:
        """Every gradient lands; the next backward starts an iteration of its own. Where no
        unit keeps gradients unsent (accumulating with sync off), the step ends: the low-bit
        wires count their bytes and report their checks once per step."""
        self._land_reductions(keep=0)
        self.unit.context.finalization.end_iteration()
        if self._has_wires and not any(sp.unsynced_grad is not None for u in self.units for sp in u.params):
            end_step(self.units)

    @property
    def _has_wires(self) -> bool:
        """Whether any unit sends through a low-bit wire (without one, a step's end has nothing to
        count, and the per-parameter walk above is skipped)."""
        return any(u.lowbit_wire is not None for u in self.units)

    # -------------------------------------------------------------- manual finalization

    def finalize_backward(self, unit: Unit, async_op: bool) -> Optional[GradientReductionHandle]:
        """``finalize_backward`` called on ``unit``'s module: each unit that kept gradients
        sends them if gradient sync is on now (else keeps them); the others reshard if
        resharding after backward is on now; then every reduction is waited for, now or, with
        ``async_op``, at the handle's ``wait()``."""
        mode = self.unit.context.finalization
        self._check_finalizable(unit)
        for u in reversed(self.units):  # innermost first, the root last, as backward sends
            if u in self._kept and u.settings.requires_gradient_sync:
                self._send_or_keep(u, syncs=True)
            elif u.settings.reshard_after_backward:
                u.reshard()
        if not async_op:
            self._end_iteration()
            return None
        token = mode.pending = object()
        return GradientReductionHandle(lambda: self._wait_for_reductions(token))

    def _wait_for_reductions(self, token: object) -> None:
        if self.unit.context.finalization.pending is not token:
            raise RuntimeError(on_rank(
                "This gradient reduction handle was invalidated: reset_iter_state() dropped its reductions"
            ))
        self._end_iteration()

    def _check_finalizable(self, unit: Unit) -> None:
        """torch's conditions on ``finalize_backward``, in its order."""
        mode = self.unit.context.finalization
        if mode.pending is not None:
            raise RuntimeError(on_rank("The previous gradient reduction must be waited on before finalizing backward again"))
        if unit is not self.unit:
            raise RuntimeError(on_rank(
                f"finalize_backward must be called on the root module ({self.unit.module_name}), not on {unit.module_name}"
            ))
        if not mode.manual:
            raise RuntimeError(on_rank(
                "finalize_backward requires manual backward finalization: call "
                "set_manual_backward_finalization(True) on the root before forward"
            ))
        if self.in_backward:
            raise RuntimeError(on_rank("finalize_backward must be called after backward completes"))
        self._check_no_deferred_all_reduce()

    def _check_no_deferred_all_reduce(self) -> None:
        """Hybrid sharding: finalization ends with every gradient all-reduced across replicas,
        so an all-reduce deferred by ``set_requires_all_reduce(False)`` is refused, as torch's."""
        deferring = [u for u in self.units if u.mesh_info.replicate_group is not None and self._defers_all_reduce(u)]
        if deferring or any(r.defers_all_reduce for r in self._reductions):
            where = f" for {deferring[0].module_name}" if deferring else ""
            raise RuntimeError(on_rank(
                f"manual backward finalization does not support partial gradient reductions{where}: call "
                "set_requires_all_reduce(True) before the backward and the finalization, or use automatic finalization"
            ))

    def _defers_all_reduce(self, unit: Unit) -> bool:
        sends_now = unit in self._kept and unit.settings.requires_gradient_sync
        return unit.reducer.holds_partial or (sends_now and not unit.settings.requires_all_reduce)


def _units_of(modules: list[nn.Module]) -> list[Unit]:
    """The units of prefetch targets (modules ``fully_shard`` was applied to, checked when set)."""
    return [u for u in map(unit_of, modules) if u is not None]
