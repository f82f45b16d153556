"""What a ``sharded.LowBit`` policy adds to a stage's memory and takes off its bytes sent, for
:func:`sharded.estimate_memory` (issue #39).

Which stage takes which field is the wrappers' rule (:func:`check_stage_policy` refuses the
same): ZeRO-1's ``OSS`` the ``params`` (its broadcast of updated parameters), ZeRO-2's
``ShardedDataParallel`` the ``grads`` (its reduce to the owner), ZeRO-3's ``fully_shard``
either or both. A message travels low-bit where the wire would send it so (a floating dtype,
at least ``min_numel`` elements: :meth:`LowBitCost.message_bytes`), else exact, as the stage's
fallback does.

What a message holds comes from the codec itself (``Codec.message_numel``), and the
temporaries of encoding and decoding one from running the codec and the error feedback on meta
tensors under :class:`~.trial.LiveBytes`: those are the largest transient costs (an ``int8``
encode with error feedback holds about twice the float32 message it encodes beside its
residual, at its worst), and measuring the code keeps them right when the codec changes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .._common.lowbit import Codec, ErrorFeedback, LowBit, codec_for
from .layout import STAGE_NAMES
from .trial import LiveBytes

__all__ = ["BroadcastCost", "LowBitCost", "UnitWire", "broadcast_cost", "check_stage_policy", "unit_wire"]

_FIELDS = {1: ("params",), 2: ("grads",), 3: ("params", "grads")}
_WRAPPER = {1: "OSS(lowbit=LowBit(params=...))", 2: "ShardedDataParallel(lowbit=LowBit(grads=...))",
            3: "fully_shard(lowbit=LowBit(params=..., grads=...))"}


def check_stage_policy(lowbit: Any, stage: int) -> Optional[LowBit]:
    """``lowbit`` as ``stage``'s wrapper takes it, or the ``ValueError`` (``TypeError`` for
    another type) that wrapper raises, naming the option and where the field belongs."""
    if lowbit is None:
        return None
    if not isinstance(lowbit, LowBit):
        raise TypeError(f"estimate_memory(lowbit=...) takes a sharded.LowBit or None, got {type(lowbit).__name__}")
    name = STAGE_NAMES[stage]
    if stage == 0:
        raise ValueError(f"estimate_memory(lowbit={lowbit!r}): stage 0 (DDP + the optimizer) has no low-bit path; "
                         "low-bit communication runs at stages 1-3 (OSS, ShardedDataParallel, fully_shard)")
    if not lowbit.active:
        raise ValueError(f"estimate_memory(lowbit={lowbit!r}) sends nothing in fewer bits; set params and/or grads, or pass lowbit=None")
    refused = [field for field in ("params", "grads") if getattr(lowbit, field) is not None and field not in _FIELDS[stage]]
    if refused:
        other = {"params": "stage 1 (OSS) or 3 (fully_shard)", "grads": "stage 2 (ShardedDataParallel) or 3 (fully_shard)"}[refused[0]]
        raise ValueError(f"estimate_memory(stage={stage}, lowbit=LowBit({refused[0]}={getattr(lowbit, refused[0])!r})): "
                         f"{name} sends its {refused[0]} exact ({_WRAPPER[stage]} refuses it); low-bit {refused[0]} "
                         f"travel at {other}")
    if stage == 1 and not lowbit.error_feedback:
        raise ValueError(f"estimate_memory(stage=1, lowbit={lowbit!r}): OSS refuses error_feedback=False (its change "
                         "always carries the last rounding)")
    if stage == 3 and lowbit.grads is None and not lowbit.error_feedback:
        raise ValueError(f"estimate_memory(stage=3, lowbit={lowbit!r}): fully_shard refuses error_feedback=False without "
                         "grads (the gathers keep no residual)")
    return lowbit


@dataclass(frozen=True)
class LowBitCost:
    """The byte costs of ``policy``'s messages for one stage's walk."""

    policy: LowBit
    world: int

    @property
    def feedback(self) -> bool:
        """Whether gradients keep an error-feedback residual (float32, per message, per rank)."""
        return self.policy.grads is not None and self.policy.error_feedback

    def codec(self, kind: str, numel: int, dtype: torch.dtype) -> Optional[Codec]:
        """The codec a message of ``numel`` elements of ``dtype`` travels in, ``None`` where it
        goes exact (the kind left exact, or the wire's fallback: too small, not floating)."""
        name = getattr(self.policy, kind)
        if name is None or self.policy.exact_reason(numel, dtype) is not None:  # the wire's own rule
            return None
        return codec_for(name)

    def message_bytes(self, kind: str, numel: int, dtype: torch.dtype) -> Optional[int]:
        """Bytes of the low-bit message of ``numel`` elements (``None``: it travels exact)."""
        codec = self.codec(kind, numel, dtype)
        return None if codec is None else codec.message_numel(numel, self.policy.block_size)

    def encode_peak(self, kind: str, numel: int, dtype: torch.dtype) -> int:
        """The most an encode of that message holds at once: its temporaries, the message, and
        for gradients under error feedback the new residual (the old one is counted as held)."""
        codec = self.codec(kind, numel, dtype)
        if codec is None:
            return 0
        with_feedback = kind == "grads" and self.feedback
        return _encode_peak(codec, numel, self.policy.block_size, dtype, with_feedback)

    def decode_peak(self, kind: str, numel: int, dtype: torch.dtype, summed: bool) -> int:
        """The most a decode of one received message holds at once: its float32 values, and
        (``summed``: a reduce's receiver) the float32 sum they are added into."""
        codec = self.codec(kind, numel, dtype)
        return 0 if codec is None else _decode_peak(codec, numel, self.policy.block_size, summed)


@dataclass(frozen=True)
class BroadcastCost:
    """ZeRO-1's low-bit parameter broadcast on one rank: ``masters`` (the exact master of every
    parameter it owns that travels low-bit, held all step long; the replicas set aside during the
    optimizer step are as many bytes again), ``in_flight`` (the most held at once by the
    messages, changes and their encoding and decoding after the step) and ``sent`` (this rank's
    share of the step's broadcast bytes, averaged over the ranks as the exact count is)."""

    masters: int
    in_flight: int
    sent: int


def broadcast_cost(cost: LowBitCost, buckets: Sequence[Any], rank: int, packs_exact: bool = False) -> BroadcastCost:
    """Walk ``OSS(lowbit=)``'s broadcast of ``buckets`` (its plan: ``Bucket`` s, every owner's)
    as :class:`~sharded._owners.lowbit_params.LowBitParams` runs it: every bucket started (the
    owner takes the float32 change of each of its parameters, joins them, encodes them and lets
    the change go; a receiver allocates the message), then each finished in turn (decoded in
    float32, added to the replica parameter by parameter). A bucket that
    travels exact is sent from its own storage, or (``packs_exact``:
    ``parameters_as_bucket_view=False``) as a packed copy of its several parameters."""
    masters = in_flight = peak = sent = 0
    held: list[int] = []
    finishing: list[int] = []
    for bucket in buckets:
        numel, dtype = bucket.numel, bucket.tensors[0].dtype
        message = cost.message_bytes("params", numel, dtype)
        if message is None:  # exact, as without low-bit
            sent += numel * dtype.itemsize * (cost.world - 1) // cost.world
            packed = numel * dtype.itemsize if packs_exact and len(bucket.tensors) > 1 and cost.world > 1 else 0
            in_flight += packed
            held.append(packed)
            finishing.append(0)
            continue
        sent += message * (cost.world - 1) // cost.world
        if bucket.src == rank:  # the parameters' changes, joined, then encoded; the message stays
            change = 4 * numel
            masters += numel * dtype.itemsize
            peak = max(peak, in_flight + 2 * change, in_flight + change + cost.encode_peak("params", numel, torch.float32))
        in_flight += message
        held.append(message)
        largest = max(t.numel() for t in bucket.tensors)
        finishing.append(max(cost.decode_peak("params", numel, torch.float32, summed=False), 4 * numel + 4 * largest))
    for freed, transient in zip(held, finishing):
        peak = max(peak, in_flight + transient)
        in_flight -= freed
    return BroadcastCost(masters, peak, sent)


@functools.lru_cache(maxsize=256)
def _encode_peak(codec: Codec, numel: int, block: int, dtype: torch.dtype, with_feedback: bool) -> int:
    x = torch.empty(numel, dtype=dtype, device="meta")
    feedback = ErrorFeedback()
    if with_feedback:  # the residual of the step before, held already: not counted here
        feedback.add("message", torch.empty(numel, dtype=torch.float32, device="meta"))
    with LiveBytes() as counter:
        if with_feedback:
            feedback.encode("message", x, codec, block)
        else:
            codec.encode(x, block)
    return counter.peak


@functools.lru_cache(maxsize=256)
def _decode_peak(codec: Codec, numel: int, block: int, summed: bool) -> int:
    message = torch.empty(codec.message_numel(numel, block), dtype=torch.uint8, device="meta")
    with LiveBytes() as counter:
        if summed:
            total = torch.zeros(numel, dtype=torch.float32, device="meta")
            total += codec.decode(message, numel, block)
        else:
            codec.decode(message, numel, block)
    return counter.peak


@dataclass(frozen=True)
class UnitWire:
    """What one ZeRO-3 unit's low-bit collectives hold on a rank (``None``: that collective is
    exact for the unit). ``gather_in_flight``: a gather's message and the ``W`` it receives (in
    place of the exact gather's output buffer); ``gather_finish``: the most its wait holds (the
    pieces decoded into one float32 output beside the messages, then that output copied into the
    unsharded parameters); ``reduce_in_flight``: a reduce-scatter's ``W``
    messages sent and ``W`` received (its float32 send buffer is freed once encoded);
    ``encoding``: the most its start holds at once (the packed gradients, the rows encoded one
    by one, then joined); ``residuals``: error feedback's float32 residual of every row this
    rank sends, held from the first backward on; ``*_message``: one message's bytes."""

    residuals: int = 0
    gather_in_flight: Optional[int] = None
    gather_message: Optional[int] = None
    gather_finish: int = 0
    reduce_in_flight: Optional[int] = None
    reduce_message: Optional[int] = None
    encoding: int = 0


def unit_wire(cost: LowBitCost, shard_numel: int, shard_dtype: torch.dtype, gathered_bytes: int, row_numel: int,
              reduce_dtype: torch.dtype) -> UnitWire:
    """A unit's :class:`UnitWire`: ``shard_numel`` elements of ``shard_dtype`` gathered (its
    flat shard) into ``gathered_bytes`` of unsharded parameters, ``row_numel`` per row of its
    packed gradients (``gradient_widths``) in ``reduce_dtype`` (0: nothing trainable)."""
    world = cost.world
    gather = cost.message_bytes("params", shard_numel, shard_dtype) if shard_numel else None
    gathering = {}
    if gather is not None:
        decoded = 4 * world * shard_numel
        decoding = (world + 1) * gather + cost.decode_peak("params", shard_numel, shard_dtype, summed=False)
        gathering = {"gather_in_flight": (world + 1) * gather, "gather_message": gather,
                     "gather_finish": decoded + max(decoding, gathered_bytes)}
    row = cost.message_bytes("grads", row_numel, reduce_dtype) if row_numel else None
    if row is None:
        return UnitWire(**gathering)
    packed = world * row_numel * reduce_dtype.itemsize
    encoding = packed + max((world - 1) * row + cost.encode_peak("grads", row_numel, reduce_dtype), 3 * world * row)
    return UnitWire(
        residuals=world * row_numel * 4 if cost.feedback else 0,
        reduce_in_flight=2 * world * row,
        reduce_message=row,
        encoding=encoding,
        **gathering,
    )

