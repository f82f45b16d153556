"""One backward's reduction in progress: the bucket buffers being filled, the reduces in flight,
and the bookkeeping of which gradients arrived and how often.

:class:`sharded._owners.grad_router.GradRouter` drives it; a new :class:`Pass` starts with every
synced backward (or explicit reduce).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from .._common import comm
from .._common.flat import used_anywhere, used_flags
from .._common.in_flight import MAX_SENDS_IN_FLIGHT
from .lowbit_reduce import LowBitBuckets, Reduction
from .reduce_plan import ReduceBucket

__all__ = ["Fill", "Pass", "Sent"]


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

    def empty_slots(self) -> list[int]:
        """Slots no gradient was written to yet."""
        return [slot for slot, written in enumerate(self.written) if not written]

    def add(self, slot: int, grad: torch.Tensor, scale: float) -> None:
        """Write (first time) or add ``grad * scale`` into the slot."""
        view = self.grad_view(slot)
        if self.written[slot]:
            view.add_(grad, alpha=scale)
        else:
            torch.mul(grad, scale, out=view)
            self.written[slot] = True
            self.num_written += 1

    def seal(self) -> None:
        """Ready the buffer to send: slots with nothing are zeroed and the used flags written."""
        used = self.buffer[self.bucket.numel :]
        if self.num_written == len(self.written):  # every parameter arrived: the common case
            used.fill_(1)
            return
        for slot in self.empty_slots():
            self.grad_view(slot).zero_()
        used.copy_(used_flags(self.written, used.dtype, used.device))

    def hand_out(self, add_to_existing: bool, used: Optional[Sequence[float]] = None) -> list[int]:
        """On the owner: make each used slot its parameter's gradient (or add it to the one there).
        Returns the slots handed out.

        ``used`` (one entry per slot, > 0 where some rank produced the gradient) replaces the
        reduced flags, whose read is a host sync on an accelerator.
        """
        if used is None:
            used = used_anywhere(self.buffer[self.bucket.numel :])
        handed = [slot for slot in range(len(self.bucket.params)) if used[slot] > 0]
        for slot in handed:
            p = self.bucket.params[slot]
            reduced = self.grad_view(slot)
            if add_to_existing and p.grad is not None:
                p.grad.add_(reduced.to(p.dtype))
            else:
                p.grad = reduced if reduced.dtype == p.dtype else reduced.to(p.dtype)
        return handed


@dataclass
class Sent:
    """A bucket's reduce in flight; a correction adds to the owner's first result."""

    fill: Fill
    work: Reduction
    is_correction: bool


class Pass:
    """Bookkeeping of one synced backward (or one explicit reduce) on this rank."""

    def __init__(self, num_params: int, waiting: Sequence[int], rank: int, is_backward: bool = True) -> None:
        self.started_at = self.flushed_at = time.perf_counter()
        self.first_launch_at: Optional[float] = None
        self.rank = rank
        self.fills: list[Optional[Fill]] = [None] * len(waiting)
        self.waiting = list(waiting)  # per bucket: parameters whose expected count is not reached
        self.arrivals = [0] * num_params
        self.completed_at = [0] * num_params  # when each last arrived: the observed order
        self.clock = 0
        self.next_launch = 0
        self.in_flight: deque[Sent] = deque()
        self.partial: set[int] = set()  # arrived, but fewer times than expected so far
        self.launch_clocks: list[int] = []  # arrivals seen when each bucket left from a hook, in plan order
        self.late_reduces = 0
        self.is_backward = is_backward  # False: an explicit reduce(), which no hook started
        self.held_bytes = 0
        self.peak_bytes = 0

    def arrive(self, index: int) -> int:
        """Count one arrival of parameter ``index``'s gradient; return its arrivals so far."""
        self.arrivals[index] += 1
        self.clock += 1
        self.completed_at[index] = self.clock
        return self.arrivals[index]

    def hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def send(self, fill: Fill, group: comm.ProcessGroup, is_correction: bool = False, lowbit: Optional[LowBitBuckets] = None) -> None:
        """Start reducing ``fill`` to its owner (through ``lowbit`` when the wrapper has a policy)."""
        with torch.profiler.record_function("sharded::reduce_bucket"):
            work: Reduction
            if lowbit is None:
                work = comm.start_reduce(fill.buffer, fill.bucket.owner, group)
            else:
                work = lowbit.start(fill.bucket, fill.buffer, exact=is_correction)
        self.in_flight.append(Sent(fill, work, is_correction))

    def release_sent(self) -> None:
        """Free the buffers of buckets this rank has finished sending to another owner, and wait
        for the older ones so that at most ``MAX_SENDS_IN_FLIGHT`` are held: the next bucket
        fills beside them, so a rank holds at most that many plus one buckets of other owners'
        gradients however far the communication lags behind the backward.

        Owned buckets wait for the flush: reading their 'used' flags would make an accelerator
        synchronise in the middle of backward.
        """
        sending = sum(1 for sent in self.in_flight if sent.fill.bucket.owner != self.rank)
        still_in_flight: deque[Sent] = deque()
        for sent in self.in_flight:
            if sent.fill.bucket.owner != self.rank and (sending > MAX_SENDS_IN_FLIGHT or sent.work.is_completed()):
                self._wait(sent)
                sending -= 1
            else:
                still_in_flight.append(sent)
        self.in_flight = still_in_flight

    def wait_all(self) -> Iterator[Sent]:
        """Wait for every reduce in flight, oldest first; yield those whose results this rank owns."""
        while self.in_flight:
            sent = self.in_flight.popleft()
            self._wait(sent)
            if sent.fill.bucket.owner == self.rank:
                yield sent

    def _wait(self, sent: Sent) -> None:
        with torch.profiler.record_function("sharded::wait_reduce"):
            sent.work.wait()
        if sent.fill.bucket.owner != self.rank:
            self.held_bytes -= sent.fill.nbytes
