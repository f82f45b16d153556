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
found again at the next step and after a rebuild that plans the same bucket. A bucket the plan no
longer has (re-planned from the first backward's order, or rebuilt by ``refresh_trainable``)
leaves its residual per parameter, carried into the new buckets that hold them
(:meth:`LowBitBuckets.keep_only`); a checkpoint saves and loads residuals per parameter too
(:meth:`LowBitBuckets.residuals_by_param`, :meth:`LowBitBuckets.carry`), so a resumed run folds
them into whatever buckets it plans. Corrections for late gradients travel exact: they are
rare, and a residual is per bucket.
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


def _by_param(bucket: ReduceBucket, residual: torch.Tensor) -> dict[torch.Tensor, torch.Tensor]:
    """A bucket's residual cut into its parameters' (each of the parameter's shape)."""
    return {p: residual[offset : offset + p.numel()].view(p.shape).clone() for p, offset in zip(bucket.params, bucket.offsets)}


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
        if codec is not None:
            self._take_carried(bucket, name)
        copies = 0 if bucket.owner == self.wire.rank else 1
        if codec is None:
            self.wire.count_exact("reduce", buffer.numel(), buffer.dtype, copies)
            return comm.start_reduce(buffer, bucket.owner, self.wire.group)
        gradients = self.wire.reduce(codec, name, grads, bucket.owner)
        self.wire.count_exact("reduce", flags.numel(), flags.dtype, copies)
        return LowBitReduce(gradients, comm.start_reduce(flags, bucket.owner, self.wire.group), grads)

    def keep_only(self, buckets: Sequence[ReduceBucket]) -> int:
        """Carry, per parameter, the residuals of messages ``buckets`` no longer send (the new
        buckets holding those parameters take them at their next send; a parameter none holds
        drops its); returns how many messages were re-planned away."""
        feedback, old = self.wire.feedback, list(self._message_names.values())
        self._message_names = {}  # a re-plan: the old buckets' names go with them
        kept = {self._message_name(b) for b in buckets}
        residuals = feedback.state_dict()
        for bucket, name in old:
            if name not in kept and name in residuals:
                feedback.carry(_by_param(bucket, residuals[name]))
        held = {id(p) for b in buckets for p in b.params}
        feedback.take_carried([p for p in feedback.carried if id(p) not in held])
        return feedback.keep_only(kept)

    def residuals_by_param(self) -> dict[torch.Tensor, torch.Tensor]:
        """This rank's residuals per parameter (its shape, float32): those of the buckets the
        plan sends and those carried. What they add to the reduced gradient: a bucket holds
        gradients already divided by the world size, so a residual counts as it is."""
        residuals = self.wire.feedback.state_dict()
        found: dict[torch.Tensor, torch.Tensor] = {}
        for bucket, name in self._message_names.values():
            if name in residuals:
                found.update(_by_param(bucket, residuals[name]))
        for param, residual in self.wire.feedback.carried.items():
            assert isinstance(param, torch.Tensor)
            found[param] = found[param] + residual if param in found else residual
        return found

    def carry(self, by_param: dict[torch.Tensor, torch.Tensor]) -> None:
        """Take residuals per parameter (:meth:`residuals_by_param`'s form, from a checkpoint):
        the next message of a bucket holding the parameter adds them."""
        self.wire.feedback.carry(dict(by_param))

    def _take_carried(self, bucket: ReduceBucket, name: str) -> None:
        carried = self.wire.feedback.take_carried(bucket.params)
        if not carried:
            return
        residual = torch.zeros(bucket.numel, dtype=torch.float32, device=bucket.device)
        for param, offset in zip(bucket.params, bucket.offsets):
            if param in carried:
                residual[offset : offset + param.numel()] = carried[param].reshape(-1)
        self.wire.feedback.add(name, residual)

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
