"""ZeRO-2's low-bit reduce: a bucket's gradients to their owner in the policy's ``grads`` format.

A bucket's buffer holds this rank's gradients, already divided by the world size as the exact
reduce sends them, then one 'used' flag per parameter. With low-bit the gradients go through
:meth:`~sharded._common.lowbit.LowBitWire.reduce`: every rank encodes its part (plus its
error-feedback residual for that bucket), the owner gathers the messages, decodes them and sums
them in float32 in rank order, and the sum is cast back into the owner's buffer where the exact
reduce would have left it, so the router hands out gradients as it always does. The flags travel
exact beside it (a reduce of a few numbers), so the owner knows which gradients some rank
produced exactly as without low-bit.

A bucket's message is named by its content (the names of its parameters), so its residual is
found again at the next step, after a rebuild that plans the same bucket, and after a checkpoint
is loaded; a bucket the plan no longer has takes its residual with it (:meth:`LowBitBuckets.keep_only`).
Corrections for late gradients travel exact: they are rare, and a residual is per bucket.
"""

from __future__ import annotations

import zlib
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from .._common import comm
from .._common.errors import on_rank
from .._common.lowbit import LowBit, LowBitWire, Pending, StepTraffic
from .reduce_plan import ReduceBucket

__all__ = ["LowBitBuckets", "LowBitReduce", "bucket_message_name", "lowbit_buckets_for"]


def lowbit_buckets_for(
    lowbit: Optional[LowBit], reduce_fp16: bool, group: comm.ProcessGroup, names: dict[torch.Tensor, str]
) -> Optional[LowBitBuckets]:
    """``ShardedDataParallel(lowbit=...)``'s buckets, or ``None`` when off; raises, naming the
    field and the rank, for a policy this stage cannot honour."""
    if lowbit is None:
        return None
    rank = comm.group_rank(group)
    if not isinstance(lowbit, LowBit):
        raise TypeError(on_rank(f"ShardedDataParallel(lowbit=...) takes a sharded.LowBit or None, got {type(lowbit).__name__}", rank))
    if lowbit.params is not None:
        raise ValueError(on_rank(
            f"ShardedDataParallel(lowbit=LowBit(params={lowbit.params!r})): ShardedDataParallel reduces gradients only; "
            "the broadcast of updated parameters is the optimizer's: pass OSS(..., lowbit=LowBit(params=...))", rank))
    if lowbit.grads is None:
        raise ValueError(on_rank(
            "ShardedDataParallel(lowbit=LowBit(grads=None)) sends nothing in fewer bits: "
            "name a gradient format (LowBit(grads='int8')) or pass lowbit=None", rank))
    if reduce_fp16:
        raise ValueError(on_rank(
            f"ShardedDataParallel(reduce_fp16=True, lowbit=LowBit(grads={lowbit.grads!r})): one wire format per "
            "gradient; choose one of them", rank))
    return LowBitBuckets(LowBitWire(lowbit, group), names)


def bucket_message_name(bucket: ReduceBucket, names: dict[torch.Tensor, str]) -> str:
    """The name of ``bucket``'s message: its first and last parameter, how many, and a checksum
    of every name in order, so two different buckets never share a residual."""
    member_names = [names.get(p, f"#{i}") for i, p in enumerate(bucket.params)]
    digest = zlib.crc32("\n".join(member_names).encode())
    return f"reduce {member_names[0]}..{member_names[-1]} ({len(member_names)} params, {digest:08x})"


class LowBitReduce:
    """One bucket's low-bit reduce in flight: ``wait()`` leaves the owner's buffer as the exact
    reduce would (the decoded float32 sum cast to the buffer's dtype, the flags summed)."""

    def __init__(self, gradients: Pending, flags: dist.Work, into: torch.Tensor) -> None:
        self._gradients, self._flags, self._into = gradients, flags, into

    def is_completed(self) -> bool:
        return self._gradients.is_completed() and self._flags.is_completed()

    def wait(self) -> None:
        total = self._gradients.wait()
        self._flags.wait()
        if total is not None:  # the owner
            self._into.copy_(total)


Reduction = Union[dist.Work, LowBitReduce]


class LowBitBuckets:
    """How one wrapper's buckets travel under a low-bit policy; it outlives the routers a
    ``refresh_trainable`` rebuilds, so the residuals, byte counts and step count carry on.

    Args:
        wire: the wrapper's low-bit collectives (its policy's ``grads`` format).
        names: parameter -> its name in the module, which names the buckets' messages.
    """

    def __init__(self, wire: LowBitWire, names: dict[torch.Tensor, str]) -> None:
        self.wire = wire
        self._names = names
        self._message_names: dict[int, tuple[ReduceBucket, str]] = {}  # id -> (bucket, name): named once, not per backward

    def start(self, bucket: ReduceBucket, buffer: torch.Tensor, exact: bool = False) -> Reduction:
        """Start reducing ``buffer`` (``bucket``'s gradients then flags) to its owner: low-bit,
        or exact where ``exact`` (a correction) or the policy falls back for this message."""
        grads, flags = buffer[: bucket.numel], buffer[bucket.numel :]
        name = self._message_name(bucket)
        codec = None if exact else self.wire.codec("grads", "reduce", name, grads)
        copies = 0 if bucket.owner == self.wire.rank else 1
        if codec is None:
            self.wire.count_exact("reduce", buffer.numel(), buffer.dtype, copies)
            return comm.start_reduce(buffer, bucket.owner, self.wire.group)
        gradients = self.wire.reduce(codec, name, grads, bucket.owner)
        self.wire.count_exact("reduce", flags.numel(), flags.dtype, copies)
        return LowBitReduce(gradients, comm.start_reduce(flags, bucket.owner, self.wire.group), grads)

    def keep_only(self, buckets: Sequence[ReduceBucket]) -> int:
        """Drop the residuals of messages ``buckets`` no longer send; returns how many."""
        self._message_names = {}  # a re-plan: the old buckets' names go with them
        return self.wire.feedback.keep_only({self._message_name(b) for b in buckets})

    def _message_name(self, bucket: ReduceBucket) -> str:
        known = self._message_names.get(id(bucket))
        if known is None or known[0] is not bucket:
            known = self._message_names[id(bucket)] = (bucket, bucket_message_name(bucket, self._names))
        return known[1]

    def end_step(self) -> StepTraffic:
        """Close the step (one synced backward or explicit reduce): fallbacks and shadow checks
        reported, the step's bytes returned."""
        return self.wire.end_step()

    @property
    def last_traffic(self) -> Optional[StepTraffic]:
        return self.wire.traffic.last
