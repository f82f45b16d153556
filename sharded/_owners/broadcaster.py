"""After a sharded step, bring every replica's parameters up to date from their owners.

Only a parameter's owner steps it, so only the owner holds its new value. A
:class:`ParamBroadcaster` keeps everything that brings the other ranks up to date in one place:

* the **plan**: the owners' trainable parameters packed into flat buckets (once per partition),
  in the order a forward reads them;
* **residency** (``resident=True``, OSS's default): those parameters are made views of their
  bucket, so a bucket is sent and received as it is, with no copy on either side; otherwise
  (``parameters_as_bucket_view=False``) each parameter keeps its own storage, and a bucket of
  several is packed into a message by its owner and unpacked by the others, a transient copy
  of the bucket's bytes on every rank while the broadcasts are in flight;
* **frozen-parameter agreement**: a frozen parameter moves only when its owner stepped it (it had
  a gradient), which only the owner knows, so the ranks agree with one small all-reduce per
  step, which only models with frozen parameters pay;
* the **broadcasts in flight** and their waits: all of them at the end of the step, or, when
  waits are deferred (``ShardedDataParallel(overlap_param_broadcast=True)``), bucket by bucket
  as the next forward reaches the modules that hold them (:mod:`.param_waits`).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from .._common import comm
from .._common.broadcast import (
    Bucket,
    InFlight,
    make_resident,
    plan_broadcasts,
    release_residents,
    start_broadcasts,
)
from .lowbit_params import LowBitParams
from .partition import Partition

__all__ = ["ParamBroadcaster"]


class ParamBroadcaster:
    """The owners' broadcasts of updated parameters: their plan, residency and waits.

    Call :meth:`plan` whenever the partition changes, :meth:`start` after each step, and
    :meth:`wait` (or :meth:`wait_for`) before the parameters are read.

    Args:
        group: the process group the parameters are sharded over.
        bucket_numel: parameters are packed into buckets of at most this many elements; larger
            ones are sent alone, uncopied.
        wire_fp16: send floating-point parameters wider than fp16 as fp16 (receivers see the
            values rounded; owners keep the exact ones).
        resident: make each bucket of several parameters their storage (their ``.data`` views
            of it), so nothing is copied to send or receive it; ``False`` leaves every
            parameter's storage where it is and packs and unpacks the bucket at each step.
        lowbit: send each bucket's change in fewer bits instead (:mod:`.lowbit_params`: the
            owners keep the masters); its waits are deferred and completed as the exact ones.
    """

    def __init__(self, group: comm.ProcessGroup, bucket_numel: int, wire_fp16: bool, resident: bool = True,
                 lowbit: Optional[LowBitParams] = None) -> None:
        self.group = group
        self.bucket_numel = bucket_numel
        self.wire_fp16 = wire_fp16
        self.resident = resident
        self.lowbit = lowbit
        # Whether start() leaves the broadcasts in flight, for wait_for() to complete on use.
        self.defer_waits = False
        self._rank = comm.group_rank(group)
        self._partition = Partition.build([], comm.group_size(group))
        self._buckets: tuple[Bucket, ...] = ()
        self._bucket_of: dict[int, int] = {}  # id(parameter) -> position of its bucket, per plan
        self._in_flight: Optional[InFlight] = None

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The trainable parameters' buckets, in the order they are sent."""
        return self._buckets

    def plan(self, partition: Partition) -> None:
        """Bucket ``partition``'s trainable parameters by owner, each bucket their storage
        when ``resident``.

        Waits for what is in flight first: the old buckets' values must land before they are
        replaced. Parameters no new bucket holds get storage of their own again, so the old
        buffers are freed.
        """
        self.wait()
        trainable_by_owner = [
            [partition.params[i] for i in partition.owned_indices(rank, trainable_only=True)]
            for rank in range(partition.world_size)
        ]
        old = self._buckets
        buckets = plan_broadcasts(trainable_by_owner, self.bucket_numel)
        self._buckets = _in_order_of_use(make_resident(buckets) if self.resident else buckets, partition.params)
        # a parameter no new flat buffer holds (a bucket of its own, or no residency) leaves the old
        release_residents(old, keep=[b for b in self._buckets if b.flat is not None])
        self._bucket_of = {id(t): i for i, bucket in enumerate(self._buckets) for t in bucket.tensors}
        self._partition = partition

    def start(self) -> None:
        """Start sending every parameter its owner stepped to the other ranks. Collective.

        Waits for them before returning, unless waits are deferred (and no frozen parameter
        travels: those buckets are not part of the plan that :meth:`wait_for` looks in).
        """
        self.wait()
        if not all(b.is_resident() for b in self._buckets if b.flat is not None):
            self.plan(self._partition)  # e.g. module.to(dtype) gave the parameters new storage
        with torch.profiler.record_function("sharded::broadcast_params"):
            frozen = self._stepped_frozen_buckets()
            in_flight: InFlight
            if self.lowbit is not None:
                in_flight = self.lowbit.start(self._buckets, frozen)
            else:
                in_flight = start_broadcasts(self._buckets + frozen, self.group, self._wire_dtype())
            if self.defer_waits and not frozen and not in_flight.done:
                self._in_flight = in_flight
            else:
                in_flight.wait()

    def wait(self) -> None:
        """Complete every broadcast in flight. Local; a no-op when none is."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.wait()

    def wait_for(self, params: Iterable[torch.Tensor]) -> None:
        """Complete the broadcasts of the buckets that hold any of ``params``. Local."""
        in_flight = self._in_flight
        if in_flight is None:
            return
        in_flight.wait_for(sorted({self._bucket_of[id(p)] for p in params if id(p) in self._bucket_of}))
        if in_flight.done:
            self._in_flight = None

    def _wire_dtype(self) -> Optional[torch.dtype]:
        return torch.float16 if self.wire_fp16 else None

    def _stepped_frozen_buckets(self) -> tuple[Bucket, ...]:
        """Buckets for the frozen parameters that their owners just stepped.

        Only the owner knows whether a frozen parameter holds a gradient (under ZeRO-2 the
        others released theirs), so the ranks agree with one small all-reduce; a model without
        frozen parameters skips it.
        """
        partition = self._partition
        frozen = partition.frozen_indices()
        if not frozen or partition.world_size == 1:
            return ()
        params, owners = partition.params, partition.owners
        stepped = torch.tensor(
            [owners[i] == self._rank and params[i].grad is not None for i in frozen],
            dtype=torch.int32,
            device=comm.comm_device(self.group),
        )
        comm.all_reduce(stepped, self.group, dist.ReduceOp.MAX)
        by_owner: list[list[torch.Tensor]] = [[] for _ in range(partition.world_size)]
        for i, was_stepped in zip(frozen, stepped.tolist()):
            if was_stepped:
                by_owner[owners[i]].append(params[i])
        return plan_broadcasts(by_owner, self.bucket_numel)


def _in_order_of_use(buckets: tuple[Bucket, ...], params: Sequence[torch.Tensor]) -> tuple[Bucket, ...]:
    """``buckets`` sorted by their first parameter in ``params`` order (the order a forward
    usually reads them), so that broadcasts are issued, and arrive, roughly as they are needed."""
    position = {id(p): i for i, p in enumerate(params)}
    return tuple(sorted(buckets, key=lambda b: min(position.get(id(t), len(position)) for t in b.tensors)))
