"""One unit's gradient reduction in flight, between its start and its gradients landing.

The unit packs its gradients (:func:`._flat_buffers.pack_gradients`), scales them and starts
the reduce-scatter (:mod:`._collectives`); a :class:`Reduction` then waits for it, adds what
earlier backwards left (hybrid sharding with the all-reduce deferred), all-reduces across
replicas, applies the user's hook and the last scaling, unpacks this rank's row into one
gradient shard per parameter and hands those to the unit, which writes ``param.grad``. The
root decides when (a bounded number of reductions stays in flight; the rest at the end of
backward).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .._common import comm
from ._collectives import PendingReduceScatter
from ._flat_buffers import GradientLayout
from ._param import ShardedParam
from ._reduce_ops import DivisionPlan
from ._streams import CommStreams

__all__ = ["ReduceSettings", "GradientShards", "Reduction"]

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
        land: the unit's writer of ``param.grad``.
    """

    def __init__(
        self,
        scatter: PendingReduceScatter,
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
