"""One unit's gradient reduction: its set-up, and the reduction in flight until its gradients land.

A unit's :class:`GradientReducer` packs its gradients (:func:`._gradient_rows.pack_gradients`),
scales them and starts the reduce-scatter (:mod:`._collectives`), as the unit's settings say at
that moment; a :class:`Reduction` then waits for it, adds what earlier backwards left (hybrid
sharding with the all-reduce deferred), all-reduces across replicas, applies the user's hook and
the last scaling, unpacks this rank's row into one gradient shard per parameter and adds those
to the parameters' ``.grad``. The root decides when (a bounded number of reductions stays in
flight; the rest at the end of backward).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .._common import comm
from ._collectives import PendingReduceScatter, ProfilerLabels, new_buffer, start_reduce_scatter
from ._gradient_rows import GradientLayout, pack_gradients
from ._lowbit_reduce import GradientWire, LowBitReduceScatter, start_gradient_reduce_scatter
from ._owned import OwnedReduction, start_owned_reduction
from ._param import ShardedParam
from ._placement.mesh import MeshInfo
from ._reduce_ops import DivisionPlan, division_plan
from ._settings import UnitSettings
from ._streams import CommStreams

__all__ = ["ReduceSettings", "GradientShards", "Reduction", "UnitReduction", "GradientReducer"]

# (parameter, this rank's rows of its reduced gradient), for each parameter that gets one
GradientShards = list[tuple[ShardedParam, torch.Tensor]]


@dataclass(frozen=True)
class ReduceSettings:
    """How a unit reduces this backward's gradients (FSDP2's per-module settings)."""

    plan: DivisionPlan
    replicate_group: Optional[dist.ProcessGroup] = None  # hybrid: all-reduce across replicas
    all_reduce_now: bool = True  # hybrid: False keeps the scattered sum for a later all-reduce
    carried: Optional[torch.Tensor] = None  # scattered sums kept from earlier backwards
    keep_partial: Optional[Callable[[torch.Tensor], None]] = None  # takes the output when deferring
    hook: Optional[Callable[[torch.Tensor], None]] = None  # ``set_all_reduce_hook``
    hook_stream: Optional[tuple[Any, torch.device]] = None  # its ``stream=``, on the unit's device
    land_unused: bool = False  # ``set_reduce_scatter_unused_params``: zeros, not None
    comm: Optional[Any] = None  # a user's ``ReduceScatter`` (``set_custom_reduce_scatter``)


@contextlib.contextmanager
def _on_stream(stream_on: Optional[tuple[Any, torch.device]]) -> Iterator[None]:
    """Run the block on a user's stream, after the work queued so far and before the work queued
    after it (no-ops on the CPU, whose streams order nothing)."""
    if stream_on is None:
        yield
        return
    stream, device = stream_on
    backend = torch.get_device_module(device)
    current = backend.current_stream()
    stream.wait_stream(current)
    with backend.stream(stream):
        yield
    current.wait_stream(stream)


class Reduction:
    """A unit's gradient reduce-scatter in flight (then, for hybrid sharding, the all-reduce
    across replicas); :meth:`finish` hands ``land`` the gradient shards.

    Args:
        scatter: the reduce-scatter started on the packed gradients.
        layout: where the gradients are in the packed buffer (and so in the received row).
        settings: how to reduce.
        streams: the device's streams (the reduction's work runs on the reduce-scatter stream).
        label: the profiler label for unpacking and landing.
        land: the writer of ``param.grad``.
    """

    def __init__(
        self,
        scatter: Union[PendingReduceScatter, LowBitReduceScatter],
        layout: GradientLayout,
        settings: ReduceSettings,
        streams: CommStreams,
        label: str,
        land: Callable[[GradientShards], None],
    ) -> None:
        self.settings = settings
        self._scatter = scatter
        self._layout = layout
        self._streams = streams
        self._label = label
        self._land = land
        self._received: Optional[torch.Tensor] = None  # this rank's row, once scattered
        self._replica_work: Optional[dist.Work] = None

    @property
    def hybrid(self) -> bool:
        return self.settings.replicate_group is not None

    @property
    def defers_all_reduce(self) -> bool:
        """Hybrid with the all-reduce deferred: it will keep the scattered sum, not land it."""
        return self.hybrid and not self.settings.all_reduce_now

    def advance(self) -> torch.Tensor:
        """Wait for the reduce-scatter and start the all-reduce across replicas, if any; return
        this rank's row."""
        if self._received is not None:
            return self._received
        with self._streams.on_reduce_scatter():
            received = self._received = self._scatter.wait()
            settings = self.settings
            if settings.carried is not None:
                received.add_(settings.carried)
            if settings.replicate_group is not None and settings.all_reduce_now:
                self._replica_work = comm.start_all_reduce(received, settings.replicate_group, settings.plan.replica_op)
        return received

    def finish(self) -> None:
        """Wait for everything, then hand the unit its gradient shards (or, hybrid with the
        all-reduce deferred, the scattered sum)."""
        received = self.advance()
        with self._streams.on_reduce_scatter(), record_function(self._label):
            if self._reduced(received):
                self._land(self._layout.unpack(received, every=self.settings.land_unused))

    def abandon(self) -> None:
        """Wait for every collective (so the ranks stay in step) and land nothing."""
        self.advance()
        if self._replica_work is not None:
            self._replica_work.wait()

    def _reduced(self, received: torch.Tensor) -> bool:
        """Finish reducing ``received`` in place: whether it is ready to land (else the unit
        keeps it for a later all-reduce)."""
        settings = self.settings
        if settings.replicate_group is not None and not settings.all_reduce_now and settings.keep_partial is not None:
            settings.keep_partial(received)
            return False
        if self._replica_work is not None:
            self._replica_work.wait()
        if settings.hook is not None:
            with _on_stream(settings.hook_stream):
                settings.hook(received)
        settings.plan.scale_received(received)
        return True


class GradientReducer:
    """How one unit's gradients are reduced: each backward's full gradients packed, scaled and
    reduce-scattered as the unit's settings say when the reduction starts, the shards that come
    back added to the parameters' ``.grad``. Between backwards it keeps the scattered sum that a
    deferred all-reduce left (hybrid sharding, ``set_requires_all_reduce(False)``).

    Args:
        mesh_info: the unit's mesh.
        settings: the unit's settings.
        streams: the device's streams.
    """

    def __init__(self, mesh_info: MeshInfo, settings: UnitSettings, streams: CommStreams) -> None:
        self._mesh_info = mesh_info
        self._settings = settings
        self._streams = streams
        self._partial: Optional[torch.Tensor] = None  # scattered sums awaiting a deferred all-reduce

    def start(self, params: list[ShardedParam], grads: list[Optional[torch.Tensor]], dtype: torch.dtype, labels: ProfilerLabels,
              lowbit: Optional[GradientWire] = None) -> UnitReduction:
        """Pack the full ``grads`` of ``params`` (``None`` where this rank has none) in
        ``dtype``, scale them and start reducing them: reduce-scattered, as the all-gather's
        mirror image (through ``lowbit``'s wire where the unit has one,
        :mod:`._lowbit_reduce`), and for owner-placed parameters reduced onto their owners.
        Empties ``grads`` once packed: the full gradients are freed before the collectives run."""
        if self._settings.reduction_override is not None:
            return self._settings.reduction_override(params, grads)
        settings = self._reduce_settings(dtype)
        cut = [(sp, g) for sp, g in zip(params, grads) if sp.owner is None]
        owned = [(sp, g) for sp, g in zip(params, grads) if sp.owner is not None]
        self._streams.reduce_scatter_after_compute([g for g in grads if g is not None])
        grads.clear()
        parts: list[Any] = []
        with self._streams.on_reduce_scatter(), record_function(labels.reduce_scatter):
            if cut:
                parts.append(self._start_reduce_scatter(cut, dtype, settings, labels, lowbit))
            if owned:
                parts.append(self._start_owned(owned, dtype, settings))
        return UnitReduction(parts)

    def _start_reduce_scatter(self, pairs: list[tuple[ShardedParam, Optional[torch.Tensor]]], dtype: torch.dtype,
                              settings: ReduceSettings, labels: ProfilerLabels, lowbit: Optional[GradientWire]) -> Reduction:
        info, world = self._mesh_info, self._mesh_info.shard_world
        device, custom = info.device, settings.comm
        low_bit = lowbit if lowbit is not None and lowbit.sends_grads else None
        params, grads = [sp for sp, _ in pairs], [g for _, g in pairs]
        sent, layout = pack_gradients(params, grads, world, lambda numel: new_buffer(numel, dtype, device, custom),
                                      tail_align=low_bit.tail_align if low_bit is not None else 1)
        grads.clear()
        pairs.clear()
        settings.plan.scale_sent(sent)
        group = self._settings.reduce_scatter_group or info.shard_group
        scatter: Union[PendingReduceScatter, LowBitReduceScatter]
        if low_bit is not None:
            scatter = start_gradient_reduce_scatter(low_bit, sent, layout, settings.plan, group, world)
        else:
            if lowbit is not None:
                lowbit.count_exact(sent, world)
            scatter = start_reduce_scatter(sent, group, world, settings.plan.scatter_op, custom)
        reduction = Reduction(scatter, layout, settings, self._streams, labels.land_gradients, _land_gradients)
        if world == 1:
            reduction.advance()  # nothing to wait for: start the all-reduce across replicas now
        return reduction

    def _start_owned(self, pairs: list[tuple[ShardedParam, Optional[torch.Tensor]]], dtype: torch.dtype,
                     settings: ReduceSettings) -> OwnedReduction:
        """Reduce owner-placed gradients onto their owners, scaled as the reduce-scatter is."""
        info = self._mesh_info
        group = self._settings.reduce_scatter_group or info.shard_group
        params, grads = [sp for sp, _ in pairs], [g for _, g in pairs]
        pairs.clear()
        return start_owned_reduction(
            params, grads, dtype, settings.plan, group, info.shard_rank, info.shard_world,
            settings.replicate_group, settings.land_unused, info.device, _land_gradients,
        )

    @property
    def holds_partial(self) -> bool:
        """A deferred all-reduce left a scattered sum for a later backward."""
        return self._partial is not None

    def drop_partial(self) -> None:
        """Forget the scattered sum a deferred all-reduce left (a reset)."""
        self._partial = None

    def division_plan(self, dtype: torch.dtype) -> DivisionPlan:
        """How a reduction of ``dtype`` gradients divides them, as the settings say now."""
        info, asked = self._mesh_info, self._settings
        replicas = info.mesh.size(0) if info.replicate_group is not None else 1
        return division_plan(dtype, info.shard_world, replicas, asked.gradient_divide_factor, asked.force_sum_reduction)

    def _reduce_settings(self, dtype: torch.dtype) -> ReduceSettings:
        info, asked = self._mesh_info, self._settings
        plan = self.division_plan(dtype)
        carried, self._partial = self._partial, None
        return ReduceSettings(
            plan,
            replicate_group=info.replicate_group,
            all_reduce_now=asked.requires_all_reduce,
            carried=carried,
            keep_partial=self._keep_partial,
            hook=asked.all_reduce_hook,
            hook_stream=(asked.all_reduce_hook_stream, info.device) if asked.all_reduce_hook_stream is not None else None,
            land_unused=asked.reduce_scatter_unused_params,
            comm=asked.custom_reduce_scatter,
        )

    def _keep_partial(self, scattered: torch.Tensor) -> None:
        self._partial = scattered


class UnitReduction:
    """A unit's reductions of one backward, in flight together: the reduce-scatter of its
    element-sharded gradients and the reduces of its owner-placed ones onto their owners (each
    if any). The root drives it as one."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts  # Reduction / OwnedReduction: hybrid, advance(), finish(), abandon()

    @property
    def hybrid(self) -> bool:
        return any(part.hybrid for part in self.parts)

    @property
    def defers_all_reduce(self) -> bool:
        return any(isinstance(part, Reduction) and part.defers_all_reduce for part in self.parts)

    def advance(self) -> None:
        for part in self.parts:
            part.advance()

    def finish(self) -> None:
        for part in self.parts:
            part.finish()

    def abandon(self) -> None:
        for part in self.parts:
            part.abandon()


def _land_gradients(shards: GradientShards) -> None:
    """Add each reduced gradient shard to its parameter's sharded ``.grad``."""
    for sp, local_grad in shards:
        sp.add_to_sharded_grad(local_grad)
