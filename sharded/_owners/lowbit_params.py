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

A master stands for its replica only while nothing else writes the parameter: after
``model.load_state_dict(...)`` or any other write between two steps the value written is the
truth, so the owner drops that master (with a warning) instead of stepping a stale one. A write
is seen by the parameter's version counter and storage, confirmed by a float64 checksum of its
values (a write of the same values, as DDP's final sync under ``Join``, keeps the master).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import torch

from .._common import comm
from .._common.broadcast import Bucket, InFlight, start_broadcasts
from .._common.errors import on_rank
from .._common.lowbit import LowBit, LowBitWire, StepTraffic

__all__ = ["LowBitParams", "MASTER_KEY", "refuse_unsupported"]

logger = logging.getLogger(__name__)

# The per-parameter optimizer-state entry a master travels under (state dicts, checkpoints,
# a change of owner): it is the owner's state, as the optimizer's moments are.
MASTER_KEY = "lowbit_master"


class LowBitParams:
    """The masters this rank keeps for the parameters it owns, and the low-bit broadcasts that
    bring every replica within one rounding of them."""

    def __init__(self, policy: LowBit, group: comm.ProcessGroup) -> None:
        self.wire = LowBitWire(policy, group)
        self.group = group
        self.masters: dict[torch.Tensor, torch.Tensor] = {}  # owned parameter -> its exact value
        self._replicas: dict[torch.Tensor, torch.Tensor] = {}  # owned parameter -> replica before the step
        self._written: dict[torch.Tensor, _Stamp] = {}  # owned parameter -> how its replica was left
        self._warned_overwritten = False

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
        self._drop_overwritten([p for p in owned if p in self.masters])
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

    def adopt(self, param: torch.Tensor, master: torch.Tensor) -> None:
        """Take ``master`` (loaded, or moved here with its optimizer state) for ``param``, whose
        value now is its replica."""
        self.masters[param] = master
        self._written[param] = _Stamp.of(param)

    def keep_only(self, params: Sequence[torch.Tensor]) -> None:
        """Forget the masters of parameters this rank no longer sends (after a new partition:
        those that moved have taken theirs along with their optimizer state)."""
        kept = {id(p) for p in params}
        self.masters = {p: m for p, m in self.masters.items() if id(p) in kept}
        self._written = {p: w for p, w in self._written.items() if id(p) in kept}

    def _drop_overwritten(self, params: Sequence[torch.Tensor]) -> None:
        """Drop the masters of parameters written since their replica was left (all checked
        before any is written: bucket views share one version counter)."""
        overwritten = [p for p in params if p not in self._written or self._written[p].differs(p)]
        for p in overwritten:
            del self.masters[p]
            self._written.pop(p, None)
        if overwritten and not self._warned_overwritten:
            self._warned_overwritten = True
            logger.warning("%s", on_rank(
                f"OSS(lowbit): {len(overwritten)} parameters were written outside the optimizer since its last "
                "step (a model.load_state_dict?); their values now stand as their exact masters. Load a model "
                "before its optimizer's state dict, which holds the masters", self.rank))

    def start(self, buckets: Sequence[Bucket], frozen: Sequence[Bucket]) -> InFlight:
        """Start every bucket's broadcast (``buckets`` in low bits where the policy can, the
        stepped ``frozen`` ones exact). Collective; the same buckets on every rank."""
        replicas, self._replicas = self._replicas, {}
        finishes = [self._send(i, bucket, replicas) for i, bucket in enumerate(buckets)]
        finishes += [self._send_exact(bucket) for bucket in frozen]
        return InFlight(finishes, self._end_step)

    def _end_step(self) -> None:
        self.wire.end_step()

    def _send(self, position: int, bucket: Bucket, replicas: dict[torch.Tensor, torch.Tensor]) -> Callable[[], None]:
        dtype, numel = bucket.tensors[0].dtype, bucket.numel
        name = f"parameter bucket {position} from rank {bucket.src} ({numel} elements)"
        probe = torch.empty(numel, dtype=dtype, device="meta")
        codec = self.wire.codec("params", "broadcast", name, probe)
        if codec is None:
            return self._send_exact(bucket)
        sending = bucket.src == self.rank
        device = bucket.tensors[0].device
        if sending:
            change = torch.cat([(p.detach().float() - replicas[p].float()).reshape(-1) for p in bucket.tensors])
            self._keep_masters(bucket.tensors)
            bases = [replicas[p] for p in bucket.tensors]
        else:
            change = torch.zeros((), dtype=torch.float32, device=device).expand(numel)  # its size only: no memory
            bases = list(bucket.tensors)
        base = torch.cat([b.detach().float().reshape(-1) for b in bases]) if self.wire.checking else None
        pending = self.wire.broadcast(codec, change, bucket.src, base=base)

        def finish() -> None:
            decoded = pending.wait()
            assert decoded is not None  # a broadcast delivers to every rank
            _add_into(bucket.tensors, bases, decoded)
            if sending:
                for p in bucket.tensors:
                    self._written[p] = _Stamp.of(p)

        return finish

    def _send_exact(self, bucket: Bucket) -> Callable[[], None]:
        """A bucket that travels exact, as without ``lowbit``: its owner's parameters hold their
        new masters, which every replica then equals."""
        sending = bucket.src == self.rank
        if sending:
            for p in bucket.tensors:
                self.masters.pop(p, None)
                self._written.pop(p, None)
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


class _Stamp:
    """How a replica was left: its version counter and storage, and a float64 checksum that
    tells a write of other values from one of the same values."""

    def __init__(self, version: int, data_ptr: int, checksum: torch.Tensor) -> None:
        self.version, self.data_ptr, self.checksum = version, data_ptr, checksum

    @classmethod
    def of(cls, param: torch.Tensor) -> "_Stamp":
        return cls(param._version, param.data_ptr(), _checksum(param))

    def differs(self, param: torch.Tensor) -> bool:
        if param._version == self.version and param.data_ptr() == self.data_ptr:
            return False
        return not torch.equal(_checksum(param), self.checksum)


def _checksum(param: torch.Tensor) -> torch.Tensor:
    values = param.detach()
    return torch.stack((values.sum(dtype=torch.float64), values.abs().sum(dtype=torch.float64)))


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
