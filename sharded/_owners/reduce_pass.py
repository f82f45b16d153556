"""One backward's reduction in progress: the bucket buffers being filled, and the bookkeeping of
which gradients arrived, how often, and which came too late for their bucket.

Plain state with no communication; :class:`sharded._owners.grad_router.GradRouter` drives it.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional, Sequence, cast

import torch
import torch.distributed as dist

from .reduce_plan import ReduceBucket

__all__ = ["Fill", "Pass"]


class Fill:
    """One bucket's buffer during one backward: gradients, then one 'used' flag per parameter."""

    def __init__(self, bucket: ReduceBucket, index: int) -> None:
        self.bucket = bucket
        self.index = index  # the bucket's position in the plan
        self.buffer = torch.empty(bucket.numel + len(bucket.params), dtype=bucket.wire_dtype, device=bucket.device)
        self.written = [False] * len(bucket.params)
        self.num_written = 0

    @property
    def nbytes(self) -> int:
        return self.bucket.buffer_nbytes

    def grad_view(self, slot: int) -> torch.Tensor:
        p, offset = self.bucket.params[slot], self.bucket.offsets[slot]
        return self.buffer[offset : offset + p.numel()].view(p.shape)

    def add(self, slot: int, grad: torch.Tensor, scale: float) -> None:
        """Write (first time) or add ``grad * scale`` into the slot."""
        view = self.grad_view(slot)
        if self.written[slot]:
            view.add_(grad, alpha=scale)
        else:
            torch.mul(grad, scale, out=view)
            self.written[slot] = True
            self.num_written += 1

    def seal(
        self,
        scale: float,
        take_held_grads: bool = True,
        check: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
    ) -> None:
        """Ready the buffer to send: slots with nothing are zeroed and the used flags written.

        With ``take_held_grads``, gradients the parameters hold but never announced (kept from
        ``no_sync`` steps, set by hand, or zeros left by ``zero_grad(set_to_none=False)``) are
        taken in first, each passed to ``check`` (which may raise) before any is taken.
        """
        used = self.buffer[self.bucket.numel :]
        if self.num_written == len(self.written):  # every parameter arrived: the common case
            used.fill_(1)
            return
        empty = [slot for slot, written in enumerate(self.written) if not written]
        params = self.bucket.params
        held = [slot for slot in empty if params[slot].grad is not None] if take_held_grads else []
        if check is not None:
            for slot in held:
                check(params[slot], cast(torch.Tensor, params[slot].grad))
        for slot in held:
            self.add(slot, cast(torch.Tensor, params[slot].grad), scale)
            params[slot].grad = None
        for slot in empty:
            if not self.written[slot]:
                self.grad_view(slot).zero_()
        flags = torch.tensor(self.written, dtype=self.bucket.wire_dtype)
        used.copy_(flags, non_blocking=True)

    def hand_out(self, add_to_existing: bool, used: Optional[Sequence[float]] = None) -> list[int]:
        """On the owner: make each used slot its parameter's gradient (or add it to the one there).
        Returns the slots handed out.

        ``used`` (one entry per slot, > 0 where some rank produced the gradient) replaces the
        reduced flags, whose read is a host sync on an accelerator.
        """
        if used is None:
            used = self.buffer[self.bucket.numel :].tolist()
        handed = [slot for slot in range(len(self.bucket.params)) if used[slot] > 0]
        for slot in handed:
            p = self.bucket.params[slot]
            reduced = self.grad_view(slot)
            if add_to_existing and p.grad is not None:
                p.grad.add_(reduced.to(p.dtype))
            else:
                p.grad = reduced if reduced.dtype == p.dtype else reduced.to(p.dtype)
        return handed


class Pass:
    """Bookkeeping of one synced backward (or one explicit reduce)."""

    def __init__(self, num_params: int, waiting: Sequence[int], is_backward: bool = True) -> None:
        self.started_at = self.flushed_at = time.perf_counter()
        self.first_launch_at: Optional[float] = None
        self.fills: list[Optional[Fill]] = [None] * len(waiting)
        self.waiting = list(waiting)  # per bucket: parameters whose expected count is not reached
        self.arrivals = [0] * num_params
        self.completed_at = [0] * num_params  # when each last arrived: the observed order
        self.clock = 0
        self.next_launch = 0
        self.in_flight: deque[tuple[Fill, dist.Work, bool]] = deque()
        self.partial: set[int] = set()  # arrived, but fewer times than expected so far
        self.late: dict[int, torch.Tensor] = {}  # arrived after the bucket left: scaled gradients
        self.launch_clocks: list[int] = []  # arrivals seen when each bucket left from a hook, in plan order
        self.late_reduces = 0
        self.is_backward = is_backward  # False: an explicit reduce(), which no hook started
        self.held_bytes = 0
        self.peak_bytes = 0

    def hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
