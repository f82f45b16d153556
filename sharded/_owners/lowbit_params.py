"""ZeRO-1's broadcast of updated parameters in fewer bits (``OSS(lowbit=LowBit(params=...))``).

Every rank computes with the same values, as under DDP: the model's parameters on every rank,
the owner's included, are the *replica*, what the broadcasts delivered. The owner of a parameter
also keeps its exact *master* (its own dtype; its partition once more in memory), and its
optimizer steps the master: :meth:`LowBitParams.master_values` puts the masters into the owned
parameters for the inner step and keeps their replicas aside.

What travels is the change: for each bucket the owner sends ``encode(master - replica)`` and
every rank, the owner too, adds the decoded change to its replica. So after every step

    ``|replica - master| <= error_bound(master - old replica)``   (per element, float32)

and the error does not add up over steps: the next message carries what this one rounded away.
A bucket the format cannot take (``LowBit.min_numel``) travels exact, as the plain broadcast
does, and its parameters' replicas then equal their masters (the masters are dropped). At one
rank the change still goes through the codec, so a run at one rank computes with the same kind
of values as at ``W``; nothing is sent. Frozen parameters stepped by their owner travel exact.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import torch

from .._common import comm
from .._common.broadcast import Bucket, start_broadcasts
from .._common.errors import on_rank
from .._common.lowbit import LowBit, LowBitWire, StepTraffic

__all__ = ["LowBitParams", "PendingChanges", "MASTER_KEY", "refuse_unsupported"]

# The per-parameter optimizer-state entry a master travels under (state dicts, checkpoints,
# a change of owner): it is the owner's state, as the optimizer's moments are.
MASTER_KEY = "lowbit_master"


class PendingChanges:
    """The changes of one step in flight, bucket by bucket (the positions ``ParamBroadcaster``
    waits for); ``on_done`` runs once the last one has been applied."""

    def __init__(self, finishes: list[Callable[[], None]], on_done: Callable[[], None]) -> None:
        self._finishes: list[Optional[Callable[[], None]]] = list(finishes)
        self._left, self._on_done = len(finishes), on_done
        if not finishes:
            on_done()

    @property
    def done(self) -> bool:
        return self._left == 0

    def wait(self) -> None:
        self.wait_for(range(len(self._finishes)))

    def wait_for(self, positions: Sequence[int] | range) -> None:
        for i in positions:
            finish = self._finishes[i]
            if finish is None:
                continue
            self._finishes[i] = None
            self._left -= 1
            finish()
            if self._left == 0:
                self._on_done()


class LowBitParams:
    """The masters this rank keeps for the parameters it owns, and the low-bit broadcasts that
    bring every replica within one rounding of them."""

    def __init__(self, policy: LowBit, group: comm.ProcessGroup) -> None:
        self.wire = LowBitWire(policy, group)
        self.group = group
        self.masters: dict[torch.Tensor, torch.Tensor] = {}  # owned parameter -> its exact value
        self._replicas: dict[torch.Tensor, torch.Tensor] = {}  # owned parameter -> replica before the step

    @property
    def rank(self) -> int:
        return self.wire.rank

    @property
    def traffic(self) -> Optional[StepTraffic]:
        return self.wire.traffic.last

    @contextmanager
    def master_values(self, buckets: Sequence[Bucket]) -> Iterator[None]:
        """Inside, the parameters this rank sends hold their masters (the optimizer steps those);
        their replicas are kept aside for :meth:`start`. If the step raises, the replicas are put
        back and the masters are left as they were."""
        owned = [p for bucket in buckets if bucket.src == self.rank for p in bucket.tensors]
        replicas = {p: p.detach().clone() for p in owned}
        with torch.no_grad():
            for p in owned:
                master = self.masters.get(p)
                if master is not None:
                    p.copy_(master)
        try:
            yield
        except BaseException:
            with torch.no_grad():
                for p, replica in replicas.items():
                    p.copy_(replica)
            raise
        self._replicas = replicas

    def keep_only(self, params: Sequence[torch.Tensor]) -> None:
        """Forget the masters of parameters this rank no longer sends (after a new partition:
        those that moved have taken theirs along with their optimizer state)."""
        kept = {id(p) for p in params}
        self.masters = {p: m for p, m in self.masters.items() if id(p) in kept}

    def start(self, buckets: Sequence[Bucket], frozen: Sequence[Bucket]) -> PendingChanges:
        """Start every bucket's broadcast (``buckets`` in low bits where the policy can, the
        stepped ``frozen`` ones exact). Collective; the same buckets on every rank."""
        replicas, self._replicas = self._replicas, {}
        finishes = [self._send(i, bucket, replicas) for i, bucket in enumerate(buckets)]
        finishes += [self._send_exact(bucket, replicas) for bucket in frozen]
        return PendingChanges(finishes, self._end_step)

    def _end_step(self) -> None:
        self.wire.end_step()

    def _send(self, position: int, bucket: Bucket, replicas: dict[torch.Tensor, torch.Tensor]) -> Callable[[], None]:
        dtype, numel = bucket.tensors[0].dtype, bucket.numel
        name = f"parameter bucket {position} from rank {bucket.src} ({numel} elements)"
        probe = torch.empty(numel, dtype=dtype, device="meta")
        codec = self.wire.codec("params", "broadcast", name, probe)
        if codec is None:
            return self._send_exact(bucket, replicas)
        sending = bucket.src == self.rank
        device = bucket.tensors[0].device
        if sending:
            change = torch.cat([(p.detach().float() - replicas[p].float()).reshape(-1) for p in bucket.tensors])
            self._keep_masters(bucket.tensors)
            bases = [replicas[p] for p in bucket.tensors]
        else:
            change = torch.empty(numel, dtype=torch.float32, device=device)
            bases = list(bucket.tensors)
        base = torch.cat([b.detach().float().reshape(-1) for b in bases]) if self.wire.checking else None
        pending = self.wire.broadcast(codec, change, bucket.src, base=base)

        def finish() -> None:
            decoded = pending.wait()
            assert decoded is not None  # a broadcast delivers to every rank
            _add_into(bucket.tensors, bases, decoded)

        return finish

    def _send_exact(self, bucket: Bucket, replicas: dict[torch.Tensor, torch.Tensor]) -> Callable[[], None]:
        """A bucket that travels exact, as without ``lowbit``: its owner's parameters hold their
        new masters, which every replica then equals."""
        sending = bucket.src == self.rank
        if sending:
            for p in bucket.tensors:
                self.masters.pop(p, None)
        world = comm.group_size(self.group)
        self.wire.count_exact("broadcast", bucket.numel, bucket.tensors[0].dtype, world - 1 if sending else 0)
        return start_broadcasts([bucket], self.group).wait

    def _keep_masters(self, params: Sequence[torch.Tensor]) -> None:
        """The owner's parameters hold their stepped masters: keep them (before the replicas
        are written back into the parameters)."""
        for p in params:
            master = self.masters.get(p)
            if master is None or master.shape != p.shape or master.dtype != p.dtype or master.device != p.device:
                self.masters[p] = p.detach().clone()
            else:
                master.copy_(p.detach())


def _add_into(params: Sequence[torch.Tensor], bases: Sequence[torch.Tensor], change: torch.Tensor) -> None:
    """``param = base + change`` (float32 sum, rounded once to the parameter's dtype), the
    parameters' pieces of ``change`` one after another."""
    offset = 0
    with torch.no_grad():
        for param, base in zip(params, bases):
            n = param.numel()
            param.copy_((base.detach().float().reshape(-1) + change[offset:offset + n]).view_as(param))
            offset += n


def refuse_unsupported(policy: Optional[LowBit], rank: int, *, broadcast_fp16: bool = False, overlap_with_ddp: bool = False) -> None:
    """Raise, naming the field and the rank, for what ZeRO-1's broadcast cannot honour."""
    if policy is None:
        return
    if not isinstance(policy, LowBit):
        raise TypeError(on_rank(f"OSS(lowbit=...) takes a sharded.LowBit, got {type(policy).__name__}", rank))
    if policy.grads is not None:
        raise ValueError(on_rank(
            f"OSS(lowbit=LowBit(grads={policy.grads!r})): OSS sends parameters only; gradients are reduced by "
            "DistributedDataParallel or ShardedDataParallel: pass LowBit(grads=...) to ShardedDataParallel(lowbit=) "
            "and LowBit(params=...) here", rank))
    if policy.params is None:
        raise ValueError(on_rank(
            "OSS(lowbit=LowBit(params=None)) would change nothing: give LowBit(params='int8') or another "
            "parameter format, or lowbit=None", rank))
    if not policy.error_feedback:
        raise ValueError(on_rank(
            "OSS(lowbit=LowBit(error_feedback=False)): OSS always sends the change from the replica to the "
            "exact master, so each message carries what the last one rounded away; it cannot round the "
            "parameters afresh each step (error_feedback concerns gradients)", rank))
    if broadcast_fp16:
        raise ValueError(on_rank(
            "OSS(broadcast_fp16=True, lowbit=...): one wire format for the parameter broadcasts; "
            "choose LowBit(params=...) or broadcast_fp16", rank))
    if overlap_with_ddp:
        raise ValueError(on_rank(
            "OSS(overlap_with_ddp=True, lowbit=...): the steps run inside DDP's comm hook send exact "
            "parameters; use overlap_with_ddp=False with lowbit", rank))
