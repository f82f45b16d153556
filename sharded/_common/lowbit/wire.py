"""One wrapper's low-bit collectives: the codecs its policy names, its error-feedback residuals,
its byte counts, fallbacks and shadow checks, and the four collectives the stages send through.

Each collective encodes on this rank, starts the collective on the ``uint8`` messages and returns
a :class:`Pending`; ``wait()`` completes it and decodes. Every message and receive buffer is
held by the ``Pending`` until then: gloo and NCCL read and write them while the work is in
flight. Received pieces are decoded to float32 and summed in rank order, so the sum is the same
whatever order the messages arrived in.

The stage decides what a message is (a bucket, a unit's shard) and calls :meth:`LowBitWire.codec`
first: it answers the codec, or ``None`` where the policy sends that message exact (no format for
that kind, too small, not floating point), counting the fallback or raising as the policy says.
On a step :meth:`LowBitWire.checking` says is a shadow step, each collective also runs its exact
counterpart first (synchronously, in the same order on every rank) and compares at ``wait()``.
The stage calls :meth:`LowBitWire.end_step` once per optimizer step.
"""

from __future__ import annotations

from typing import Callable, Literal, Optional

import torch
import torch.distributed as dist

from .. import comm
from .codecs import Codec, codec_for
from .feedback import ErrorFeedback
from .policy import LowBit
from .report import Fallbacks, ShadowErrors, StepTraffic, Traffic

__all__ = ["LowBitWire", "Pending"]

Kind = Literal["params", "grads"]


class Pending:
    """A low-bit collective in flight; :meth:`wait` returns what this rank receives (float32),
    or ``None`` on a rank that receives nothing (the sources of a reduce)."""

    def __init__(self, work: Optional[comm.Waitable], finish: Callable[[], Optional[torch.Tensor]], buffers: tuple[torch.Tensor, ...]) -> None:
        self._work, self._finish, self._buffers = work, finish, buffers
        self._result: Optional[torch.Tensor] = None
        self._done = False

    def wait(self) -> Optional[torch.Tensor]:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            self._result, self._done = self._finish(), True
            self._buffers, self._work = (), None
            self._finish = _finished  # the closure holds the messages and inputs: let them go
        return self._result

    def is_completed(self) -> bool:
        """Whether the collective has finished (``wait()`` then only decodes)."""
        if self._done or self._work is None:
            return True
        probe = getattr(self._work, "is_completed", None)
        return bool(probe()) if probe is not None else False


def _finished() -> Optional[torch.Tensor]:
    return None


class LowBitWire:
    """The low-bit collectives of one wrapper over ``group`` under ``policy``."""

    def __init__(self, policy: LowBit, group: comm.ProcessGroup) -> None:
        self.policy, self.group = policy, group
        self.rank, self.world = comm.group_rank(group), comm.group_size(group)
        self._codecs = {"params": _codec(policy.params), "grads": _codec(policy.grads)}
        self.feedback = ErrorFeedback()
        self.traffic = Traffic()
        self.fallbacks = Fallbacks(policy.fallback, self.rank)
        self.shadow = ShadowErrors(policy.check_every, policy.on_check, self.rank)

    # ------------------------------------------------------------------ policy
    def codec(self, kind: Kind, collective: str, name: str, tensor: torch.Tensor) -> Optional[Codec]:
        """The codec for this message, or ``None`` where it travels exact (a fallback is counted,
        or raised under ``fallback="raise"``; a kind the policy leaves exact is not a fallback)."""
        codec = self._codecs[kind]
        if codec is None:
            return None
        return codec if self.fallbacks.note(collective, name, self.policy.exact_reason(tensor.numel(), tensor.dtype), tensor.dtype) else None

    @property
    def checking(self) -> bool:
        """Whether this step is a shadow step (``check_every``)."""
        return self.shadow.due(self.traffic.step)

    def end_step(self) -> StepTraffic:
        """Close the step: fallbacks reported once, shadow checks reported, residuals dropped
        after a step that received non-finite gradients (:meth:`ErrorFeedback.end_step`); the
        step's bytes returned."""
        self.fallbacks.end_step()
        self.feedback.end_step()
        self.shadow.end_step(self.traffic.step)
        return self.traffic.end_step()

    def count_exact(self, collective: str, numel: int, dtype: torch.dtype, pieces_sent: int) -> None:
        """Count a message that travelled exact (a fallback, or a kind left exact), so the step's
        bytes are whole: ``pieces_sent`` is how many copies this rank put on the wire."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size() * pieces_sent
        self.traffic.add(collective, nbytes, nbytes)

    # ------------------------------------------------------------------ collectives
    def broadcast(self, codec: Codec, x: torch.Tensor, src: int, base: Optional[torch.Tensor] = None) -> Pending:
        """``src``'s ``x`` (1-D) to every rank; every rank (``src`` too) gets the decoded values, so
        all hold the same. Receivers pass a tensor of the same numel and dtype (its values unused).
        ``base`` (float32, ``x``'s numel; given on shadow steps): the values the received ``x`` is
        a change of (ZeRO-1 sends parameter changes); the check then reports the divergence of
        ``base + received`` from ``base + exact``. A receiver's ``x`` may be an expanded scalar
        (``torch.zeros((), ...).expand(n)``): it costs nothing."""
        block, n = self.policy.block_size, x.numel()
        sending = self.rank == src
        if sending:
            message = codec.encode(x, block)
        else:
            message = torch.empty(codec.message_numel(n, block), dtype=torch.uint8, device=x.device)
        exact = self._exact_broadcast(x, src) if self.checking else None
        work = comm.broadcast(message, src, self.group) if self.world > 1 else None
        copies = self.world - 1 if sending else 0
        self.traffic.add("broadcast", message.numel() * copies, x.numel() * x.element_size() * copies)

        def finish() -> torch.Tensor:  # holds no reference to ``x``: the sender's change goes once encoded
            decoded = codec.decode(message, n, block)
            if exact is not None:
                after = None if base is None else (base + decoded, base + exact.float())
                self.shadow.compare("broadcast", decoded, exact, divergence_of=after)
            return decoded

        return Pending(work, finish, (message,))

    def all_gather(self, codec: Codec, shard: torch.Tensor, exact_dtype: Optional[torch.dtype] = None) -> Pending:
        """Every rank's equal-sized ``shard`` (1-D), rank after rank, decoded: this rank's own piece
        goes through the codec too, so every rank computes with the same values. ``exact_dtype``:
        the dtype the exact gather sends (default ``shard``'s; ZeRO-3 with a ``param_dtype`` sends
        that), for the exact bytes counted and the shadow check's reference."""
        block, n = self.policy.block_size, shard.numel()
        exact_dtype = exact_dtype or shard.dtype
        message = codec.encode(shard, block)
        received = torch.empty(self.world * message.numel(), dtype=torch.uint8, device=shard.device)
        exact = None
        if self.checking:  # evaluation forwards before the step's end are that step's gathers too
            exact = torch.empty(self.world * n, dtype=exact_dtype, device=shard.device)
            comm.all_gather_into_tensor(exact, shard.to(exact_dtype).contiguous(), self.group, async_op=False)
        work = comm.all_gather_into_tensor(received, message, self.group) if self.world > 1 else None
        if self.world == 1:
            received.copy_(message)
        exact_bytes = n * torch.empty((), dtype=exact_dtype).element_size() * (self.world - 1)
        self.traffic.add("all_gather", message.numel() * (self.world - 1), exact_bytes)

        def finish() -> torch.Tensor:
            out = torch.empty(self.world * n, dtype=torch.float32, device=shard.device)
            for r, piece in enumerate(received.split(message.numel())):
                codec.decode(piece, n, block, out[r * n:(r + 1) * n])
            if exact is not None:
                used = out.to(exact_dtype)  # what the unit computes with
                self.shadow.compare("all_gather", used, exact, divergence_of=(used, exact))
            return out

        return Pending(work, finish, (message, received))

    def reduce_scatter(self, codec: Codec, name: str, flat: torch.Tensor, checked_numel: Optional[int] = None,
                       exact_numel: Optional[int] = None) -> Pending:
        """The float32 sum over ranks of chunk ``r`` of every rank's ``flat`` (``world`` equal
        chunks, 1-D), for this rank ``r``: each chunk is encoded (with this rank's residual for it
        under error feedback), exchanged all-to-all, decoded and summed in rank order.
        ``checked_numel``: the chunk's leading elements a shadow check compares (default all);
        ``exact_numel``: the chunk's elements as the exact collective would send it, for the
        exact bytes counted (default its own)."""
        block, world = self.policy.block_size, self.world
        if flat.numel() % world:
            raise ValueError(f"low-bit reduce-scatter of {name}: {flat.numel()} elements do not split into {world} equal chunks")
        chunks = flat.reshape(-1).chunk(world)
        n = chunks[0].numel()
        messages = [self._encode_grad(codec, f"{name}[{r}]", chunk) for r, chunk in enumerate(chunks)]
        sent = torch.cat(messages)
        received = torch.empty_like(sent)
        exact = None
        if self.checking:
            exact = torch.empty(n, dtype=torch.float32, device=flat.device)
            comm.reduce_scatter_tensor(exact, flat.reshape(-1).float(), self.group, dist.ReduceOp.SUM, async_op=False)
        if world > 1:
            work: Optional[comm.Waitable] = comm.all_to_all_single(received, sent, self.group, async_op=True)
        else:
            work = None
            received.copy_(sent)
        each, device = messages[0].numel(), flat.device
        self.traffic.add("reduce_scatter", each * (world - 1), (exact_numel or n) * flat.element_size() * (world - 1))

        def finish() -> torch.Tensor:  # holds no reference to ``flat``: the caller may free it
            total = self._sum_decoded(codec, received.split(each), n, device)
            if exact is not None:
                k = n if checked_numel is None else checked_numel  # the gradients, not a tail of flags
                self.shadow.compare("reduce_scatter", total[:k], exact[:k])
            return total

        return Pending(work, finish, (sent, received))

    def reduce(self, codec: Codec, name: str, flat: torch.Tensor, dst: int) -> Pending:
        """The float32 sum over ranks of ``flat`` (1-D), on ``dst`` only (``wait()`` answers
        ``None`` elsewhere): every rank's message is gathered to ``dst``, decoded and summed there
        in rank order."""
        block, n = self.policy.block_size, flat.numel()
        message = self._encode_grad(codec, name, flat)
        receiving = self.rank == dst
        received = torch.empty(self.world * message.numel(), dtype=torch.uint8, device=flat.device) if receiving else None
        exact = None
        if self.checking:
            exact = flat.reshape(-1).float().clone()
            comm.start_reduce(exact, dst, self.group).wait()
        if self.world > 1:
            pieces = list(received.split(message.numel())) if received is not None else None
            work: Optional[comm.Waitable] = comm.start_gather(message, pieces, dst, self.group)
        else:
            work = None
            assert received is not None
            received.copy_(message)
        self.traffic.add("reduce", 0 if receiving else message.numel(), 0 if receiving else n * flat.element_size())

        def finish() -> Optional[torch.Tensor]:
            if received is None:
                return None
            total = self._sum_decoded(codec, received.split(message.numel()), n, flat.device)
            if exact is not None:
                self.shadow.compare("reduce", total, exact)
            return total

        return Pending(work, finish, tuple(t for t in (message, received) if t is not None))

    # ------------------------------------------------------------------ parts
    def _encode_grad(self, codec: Codec, key: str, x: torch.Tensor) -> torch.Tensor:
        if self.policy.error_feedback:
            return self.feedback.encode(key, x, codec, self.policy.block_size)
        return codec.encode(x, self.policy.block_size)

    def _sum_decoded(self, codec: Codec, pieces: tuple[torch.Tensor, ...], n: int, device: torch.device) -> torch.Tensor:
        total = torch.zeros(n, dtype=torch.float32, device=device)
        for piece in pieces:
            total += codec.decode(piece, n, self.policy.block_size)
        return total

    def _exact_broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        exact = x.detach().reshape(-1).clone()
        if self.world > 1:
            comm.broadcast(exact, src, self.group, async_op=False)
        return exact


def _codec(name: Optional[str]) -> Optional[Codec]:
    return codec_for(name) if name is not None else None
