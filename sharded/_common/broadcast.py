"""Bucketed broadcasts of tensors from the ranks that hold their true values.

After a sharded optimizer step only the owner of a parameter has its new value. These helpers
plan (once per partition) and run (every step) the broadcasts that bring every replica up to
date: tensors of one owner, device and dtype are packed into flat buckets so that a model of many
small parameters costs a few large messages. For parameters the buckets are made *resident*:
the parameters become views of the bucket, so the bucket is sent as it is, with no copy on
either side (on a CPU, packing and unpacking cost as much as the transfer). All broadcasts are
issued asynchronously and waited on together.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from . import comm
from .flat import (
    flatten,
    group_by_device_and_dtype,
    lives_in,
    move_into_flat,
    plan_buckets,
    unflatten_into,
    wire_dtype_for,
)

__all__ = [
    "Bucket",
    "InFlight",
    "PendingBroadcasts",
    "make_resident",
    "plan_broadcasts",
    "release_residents",
    "start_broadcasts",
]


@dataclass(frozen=True)
class Bucket:
    """Tensors that travel together from rank ``src`` in one message.

    ``flat`` is set when the tensors are *resident*: views of consecutive pieces of ``flat``,
    which is then their storage and is sent as it is, with no packing or unpacking copies.
    """

    src: int
    tensors: tuple[torch.Tensor, ...]
    flat: Optional[torch.Tensor] = None

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors)

    def is_resident(self) -> bool:
        """Whether the tensors still live in ``flat`` (``module.to()`` or ``p.data = ...`` move them out)."""
        return self.flat is not None and lives_in(self.tensors, self.flat)


def plan_broadcasts(
    tensors_by_src: Sequence[Sequence[torch.Tensor]], max_numel: int
) -> tuple[Bucket, ...]:
    """Buckets for sending ``tensors_by_src[r]`` from rank ``r`` to every other rank."""
    buckets: list[Bucket] = []
    for src, tensors in enumerate(tensors_by_src):
        nonempty = [t for t in tensors if t.numel() > 0]
        for same_kind in group_by_device_and_dtype(nonempty).values():
            buckets.extend(Bucket(src, tuple(b)) for b in plan_buckets(same_kind, max_numel))
    return tuple(buckets)


def make_resident(buckets: Sequence[Bucket]) -> tuple[Bucket, ...]:
    """Give each bucket's tensors one flat storage, so that broadcasting them copies nothing.

    The tensors' data is moved into the bucket's buffer (their ``.data`` becomes a view of it),
    so code holding a tensor keeps seeing its value. A tensor that cannot move without breaking
    something (not contiguous, or overlapping another tensor's memory) gets a bucket of its own.
    So does a tensor left alone in its bucket: its own storage is already one flat message.
    """
    aliased = _overlapping(t for b in buckets for t in b.tensors)
    resident = []
    for bucket in buckets:
        movable = [t for t in bucket.tensors if t.is_contiguous() and id(t) not in aliased]
        if len(movable) > 1:
            resident.append(Bucket(bucket.src, tuple(movable), move_into_flat(movable)))
            movable_ids = {id(t) for t in movable}
            resident.extend(Bucket(bucket.src, (t,)) for t in bucket.tensors if id(t) not in movable_ids)
        else:
            resident.extend(Bucket(bucket.src, (t,)) for t in bucket.tensors)
    return tuple(resident)


def release_residents(old: Sequence[Bucket], keep: Sequence[Bucket]) -> None:
    """Give the tensors of ``old`` buckets that no bucket of ``keep`` holds their own storage,
    so the old flat buffers are freed instead of being kept alive by a few views."""
    kept = {id(t) for b in keep for t in b.tensors}
    for bucket in old:
        if bucket.flat is None:
            continue
        for t in bucket.tensors:
            if id(t) not in kept and t.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr():
                t.data = t.detach().clone()


class InFlight:
    """Pieces of work started in sequence, each completed by its ``finish`` once, in the order
    asked: :meth:`wait_for` completes only some (by position), so a reader goes on as soon as
    the pieces it needs have arrived; ``on_done`` runs once the last one has completed."""

    def __init__(self, finishes: Sequence[Callable[[], None]], on_done: Optional[Callable[[], None]] = None) -> None:
        self._finishes: list[Optional[Callable[[], None]]] = list(finishes)
        self._left, self._on_done = len(self._finishes), on_done
        if not self._finishes and on_done is not None:
            on_done()

    @property
    def done(self) -> bool:
        """Whether every piece has been waited for."""
        return self._left == 0

    def wait(self) -> None:
        self.wait_for(range(len(self._finishes)))

    def wait_for(self, positions: Iterable[int]) -> None:
        """Complete the pieces started at ``positions`` (those already complete are skipped)."""
        for i in positions:
            finish = self._finishes[i]
            if finish is None:
                continue
            self._finishes[i] = None
            self._left -= 1
            finish()
            if self._left == 0 and self._on_done is not None:
                self._on_done()


class PendingBroadcasts(InFlight):
    """Broadcasts in flight, bucket by bucket; completing one waits for it and unpacks what was
    received."""

    def __init__(self, me: int, in_flight: list[tuple[Bucket, torch.Tensor, bool, Any]]) -> None:
        super().__init__([functools.partial(_complete, me, *entry) for entry in in_flight])


def _complete(me: int, bucket: Bucket, message: torch.Tensor, in_place: bool, work: Any) -> None:
    with torch.profiler.record_function("sharded::wait_broadcast"):
        work.wait()
    if me != bucket.src and not in_place:
        with torch.profiler.record_function("sharded::unpack_broadcast"):
            if bucket.flat is not None:
                bucket.flat.copy_(message)
            else:
                unflatten_into(message, bucket.tensors)


def start_broadcasts(
    buckets: Sequence[Bucket],
    group: comm.ProcessGroup,
    wire_dtype: Optional[torch.dtype] = None,
) -> PendingBroadcasts:
    """Start overwriting every rank's copy of each bucket's tensors with the values on its ``src``.

    With ``wire_dtype`` (e.g. ``torch.float16``) floating tensors of a wider type travel in that
    type: half the bytes, and receivers get the sender's values rounded to it. The sender keeps
    its exact values, so rounding never accumulates from step to step. Call ``wait()`` on the
    result before the tensors are read.
    """
    me = comm.group_rank(group)
    in_flight = []
    if comm.group_size(group) > 1:
        for bucket in buckets:
            dtype = wire_dtype_for(bucket.tensors[0].dtype, wire_dtype)
            home = _home(bucket)
            in_place = home is not None and home.dtype == dtype
            message = _message(bucket, home, dtype, sending=me == bucket.src)
            work = comm.broadcast(message, bucket.src, group)
            in_flight.append((bucket, message, in_place, work))
    return PendingBroadcasts(me, in_flight)


def _message(bucket: Bucket, home: Optional[torch.Tensor], dtype: torch.dtype, sending: bool) -> torch.Tensor:
    """What travels: the bucket's own storage when it can, else a packed copy or a receive buffer."""
    if home is not None and home.dtype == dtype:
        return home
    if sending:
        return home.to(dtype) if home is not None else flatten(bucket.tensors, dtype)
    return torch.empty(bucket.numel, dtype=dtype, device=bucket.tensors[0].device)


def _home(bucket: Bucket) -> Optional[torch.Tensor]:
    """The storage of the bucket's tensors as one flat tensor, if they have one."""
    if bucket.flat is not None:
        return bucket.flat
    if len(bucket.tensors) == 1 and bucket.tensors[0].is_contiguous():  # sent as it is
        return bucket.tensors[0].detach().view(-1)
    return None


def _overlapping(tensors: Iterable[torch.Tensor]) -> set[int]:
    """``id``s of the tensors whose memory overlaps another's: aliases that a move would split.

    Tensors that merely share a storage without overlapping (e.g. the views of an earlier
    bucket) do not count. A non-contiguous tensor is taken to span its whole storage.
    """
    spans = sorted(_span(t) + (id(t),) for t in tensors)
    overlapping: set[int] = set()
    reach: Optional[tuple[str, int, int]] = None  # (device, end, id) of the furthest span so far
    for device, start, end, tensor_id in spans:
        if reach is not None and reach[0] == device and start < reach[1]:
            overlapping.update((tensor_id, reach[2]))
        if reach is None or reach[0] != device or end > reach[1]:
            reach = (device, end, tensor_id)
    return overlapping


def _span(t: torch.Tensor) -> tuple[str, int, int]:
    if t.is_contiguous():
        start = t.data_ptr()
        return str(t.device), start, start + t.numel() * t.element_size()
    storage = t.untyped_storage()
    return str(t.device), storage.data_ptr(), storage.data_ptr() + storage.nbytes()
