"""Where a unit's communication runs relative to computation.

On CUDA, all-gathers (with their copy-in and copy-out) run on one side stream and
reduce-scatters (with their packing) on another, so both overlap the compute stream; events and
stream waits order them:

* all-gathers read the shards, which the optimizer writes on the compute stream: each starts
  after the computation queued before it (so a prefetch overlaps the computation queued after);
* the compute stream waits for a unit's copy-out before using its parameters;
* freeing a unit's gathered storage (allocated on the all-gather stream) first makes that stream
  wait for the computation that used it, so the allocator never hands the memory to a new
  all-gather early;
* a reduce-scatter waits for the backward computation that produced its gradients, those
  gradients are recorded on its stream, and the compute stream waits for it before the step.

Everywhere else (CPU with gloo) there are no streams: every context here is a no-op and the
overlap comes from asynchronous work handles alone.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterable, Optional

import torch

__all__ = ["CommStreams"]


class CommStreams:
    """The side streams of one compute device (none unless it is a CUDA device)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._all_gather = torch.cuda.Stream(device)
            self._reduce_scatter = torch.cuda.Stream(device)

    def on_all_gather(self) -> ContextManager:
        return torch.cuda.stream(self._all_gather) if self._cuda else contextlib.nullcontext()

    def on_reduce_scatter(self) -> ContextManager:
        return torch.cuda.stream(self._reduce_scatter) if self._cuda else contextlib.nullcontext()

    def all_gather_after_compute(self) -> None:
        """Order later all-gather-stream work after everything queued for computation so far."""
        if self._cuda:
            self._all_gather.wait_stream(torch.cuda.current_stream())

    def all_gather_waits(self, event: Any) -> None:
        """Order later all-gathers after ``event`` (``set_post_optim_event``: the optimizer step)."""
        if self._cuda:
            self._all_gather.wait_event(event)

    def reduce_scatter_after_compute(self, grads: Iterable[torch.Tensor]) -> None:
        """Order the next reduce-scatter after the computation that produced ``grads``, and keep
        their memory from being reused by the compute stream until it has read them."""
        if self._cuda:
            self._reduce_scatter.wait_stream(torch.cuda.current_stream())
            for grad in grads:
                grad.record_stream(self._reduce_scatter)

    def compute_after_reduce_scatter(self) -> None:
        """Order later computation (the optimizer step) after every reduce-scatter so far."""
        if self._cuda:
            torch.cuda.current_stream().wait_stream(self._reduce_scatter)

    def record(self) -> Optional[torch.cuda.Event]:
        """An event marking the current stream's position (``None`` without CUDA)."""
        return torch.cuda.current_stream().record_event() if self._cuda else None

    def compute_waits(self, event: Optional[torch.cuda.Event]) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def host_waits(self, event: Optional[torch.cuda.Event]) -> None:
        """Block the CPU until ``event`` (device-to-host copies the CPU is about to read)."""
        if event is not None:
            event.synchronize()
