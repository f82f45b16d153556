"""The DDP, ZeRO-1 and ZeRO-2 layouts for :func:`sharded.estimate_memory`: every rank holds
every parameter; ZeRO-1 and -2 shard the optimizer state by the partition ``OSS`` builds, and
ZeRO-2 sends each gradient away in the reduce buckets ``ShardedDataParallel`` plans.

The backward is walked gradient by gradient over the trial's :class:`ActivationProfile`: the
activations are at their largest as backward starts and leave as it goes, while the gradients a
stage keeps (all of them under DDP, the owned ones and the buckets in flight under ZeRO-2)
arrive, so the peak is the largest sum at one moment, not the sum of the two peaks.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .._common.broadcast import plan_broadcasts
from .._common.flat import DEFAULT_BUCKET_NUMEL, plan_buckets
from .._common.in_flight import MAX_SENDS_IN_FLIGHT, InFlight
from .._owners.partition import Partition
from .._owners.reduce_plan import ReduceBucket, plan_reduce_buckets
from .._owners.step_cost import ParamCost, bytes_cost, param_costs
from .layout import DDP_BUCKET_BYTES, Layout
from .lowbit import LowBitCost, broadcast_cost
from .trial import ActivationProfile

__all__ = ["replicated_layout"]


def replicated_layout(
    model: nn.Module, world: int, stage: int, profile: Optional[ActivationProfile], declared_activations: int,
    device: torch.device, param_cost: ParamCost = bytes_cost, parameters_as_bucket_view: bool = True,
    lowbit: Optional[LowBitCost] = None,
) -> Layout:
    """The busiest rank's layout at ``stage`` 0 (DDP), 1 (DDP + ``OSS``) or 2 (``ShardedDataParallel``).

    ``backward_bytes`` includes the activations: walked over ``profile`` when there is one, else
    ``declared_activations`` added to everything the stage holds at the end of backward.
    ``param_cost``: what ``OSS`` balances for the optimizer (its ``param_cost``), so that the
    partition walked is the one it builds; the busiest rank is the one with the most bytes.
    ``parameters_as_bucket_view``: ``OSS``'s option; ``False`` packs the broadcast buckets of
    several parameters into messages every step (``broadcast_bytes``). ``lowbit``: the costs of
    the stage's low-bit policy (ZeRO-1: :func:`.lowbit.broadcast_cost`; ZeRO-2: each bucket's
    message, its encoding, the owner's receive buffer, and error feedback's residuals).
    """
    all_params = list(model.parameters())
    params = [p for p in all_params if p.requires_grad]
    param_bytes = sum(_nbytes(p) for p in all_params)
    grad_bytes = sum(_nbytes(p) for p in params)
    ring = (world - 1) / world
    sent = int(2 * ring * grad_bytes)
    ready = _ready_order(all_params, params, profile)
    if stage == 0:
        shapes, calls, share, packed = [(p.shape, p.dtype) for p in params], 0, 1.0, 0
    else:
        partition = Partition.build([list(params)], world, param_costs([params], param_cost, group_rank=0))
        loads = partition.trainable_bytes_per_rank()
        busiest = max(range(world), key=loads.__getitem__)
        owned = [params[i] for i in partition.owned_indices(busiest, trainable_only=True)]
        shapes = [(p.shape, p.dtype) for p in owned]
        calls, share = _broadcast_count(partition), loads[busiest] / max(1, sum(loads))
        packed = 0 if parameters_as_bucket_view or world == 1 else _packed_broadcast_bytes(partition)
    if stage < 2:  # DDP's all-reduce (then, for ZeRO-1, the owners' broadcasts)
        calls = (_ddp_bucket_count(params) + calls) if world > 1 else 0
        backward = grad_bytes + _keep_all_walk(ready, profile, declared_activations)
        masters = 0
        if lowbit is not None:  # the owners' masters, all step; the replicas set aside in the optimizer step
            cast = broadcast_cost(lowbit, _broadcast_buckets(partition), busiest, not parameters_as_bucket_view)
            masters, packed, sent = cast.masters, cast.in_flight, int(ring * grad_bytes) + cast.sent
        return Layout(param_bytes, grad_bytes, grad_bytes, backward + masters, grad_bytes + 2 * masters, 2 * param_bytes, 0,
                      shapes, sent, calls, share, packed)
    buckets = plan_reduce_buckets(ready, partition.owner_of(), DEFAULT_BUCKET_NUMEL, False)
    owned_grads = sum(_nbytes(p) for p in owned)
    wire = lowbit if lowbit is not None and world > 1 else None  # one rank reduces nothing, low-bit or not
    residuals = _residual_bytes(buckets, wire)

    def backward_on(rank: int) -> tuple[int, int]:
        if profile is None:
            in_flight = _reduce_window_bytes(buckets, rank, wire)
            own = sum(b.grad_nbytes for b in buckets if b.owner == rank)
            return declared_activations + own + in_flight, in_flight
        return _zero2_walk(ready, buckets, rank, profile, device.type == "cpu", wire)

    # low-bit: each rank's encodes and received messages differ by the buckets it owns, so the
    # rank whose backward holds the most need not be the one that owns the most; walk every rank
    backward, communication = max(backward_on(r) for r in (range(world) if wire is not None else [busiest]))
    calls = (len(buckets) + calls) if world > 1 else 0
    if wire is not None:
        sent = int(ring * grad_bytes) + _reduce_sent(buckets, wire)
    return Layout(param_bytes, owned_grads, communication, backward + residuals, residuals, 2 * param_bytes, 0,
                  shapes, sent, calls, share, packed)


def _ready_order(
    all_params: Sequence[nn.Parameter], params: Sequence[nn.Parameter], profile: Optional[ActivationProfile]
) -> list[nn.Parameter]:
    """The trainable parameters in gradient-ready order: the trial's, then any it did not reach
    (unused in the trial's forward) in reverse, the order the wrappers assume before they learn."""
    if profile is None:
        return list(reversed(params))
    ready = [all_params[i] for i in profile.ready_order]
    seen = {id(p) for p in ready}
    return ready + [p for p in reversed(params) if id(p) not in seen]


def _keep_all_walk(ready: Sequence[nn.Parameter], profile: Optional[ActivationProfile], declared: int) -> int:
    """DDP's backward beyond its buckets: the activations alive beside every gradient made so far."""
    if profile is None:
        return declared + sum(_nbytes(p) for p in ready)
    kept, peak = 0, profile.stretch_peaks[0]
    for k, p in enumerate(ready[: len(profile.ready_order)]):
        kept += _nbytes(p)
        peak = max(peak, profile.stretch_peaks[k + 1] + kept)
    return peak


def _zero2_walk(
    ready: Sequence[nn.Parameter], buckets: Sequence[ReduceBucket], rank: int, profile: ActivationProfile,
    lazy_pages: bool, wire: Optional[LowBitCost] = None,
) -> tuple[int, int]:
    """The most bytes alive at once in a ZeRO-2 backward on ``rank`` (activations and buckets),
    and the other owners' buckets alive at that moment, replaying ``ShardedDataParallel``'s
    bucket life: a bucket's buffer is taken at its first gradient, launched once complete, in
    order; ``rank``'s own buckets stay (they become its gradients), another owner's is freed
    once at most ``MAX_SENDS_IN_FLIGHT`` newer sends are left (the worst case: a link that
    never completes early).

    ``lazy_pages`` (CPU): a fresh buffer costs only the pages written so far (the allocator maps
    large blocks and the kernel backs a page when it is first written), so a bucket grows with
    its gradients until it is sealed whole for sending; on an accelerator it costs its full
    size from its allocation.

    ``wire`` (low-bit gradients): a launch encodes the bucket (its temporaries at their worst
    beside everything held), and its message stays with the bucket until the reduce is waited
    for; an owner also holds the ``W`` messages it gathers, until the end of backward, where it
    decodes and sums them bucket by bucket. The residuals are not counted here."""
    location = {id(p): b for b, bucket in enumerate(buckets) for p in bucket.params}
    waiting = [len(bucket.params) for bucket in buckets]
    alive: dict[int, int] = {}
    sent: InFlight[int] = InFlight()
    next_launch = 0
    peak, comm_at_peak = 0, 0

    def moment(activations: int, transient: int = 0) -> None:
        nonlocal peak, comm_at_peak
        held = sum(alive.values()) + transient
        if activations + held > peak:
            peak = activations + held
            comm_at_peak = sum(n for b, n in alive.items() if buckets[b].owner != rank) + transient

    moment(profile.stretch_peaks[0])
    for k, p in enumerate(ready[: len(profile.ready_order)]):
        b = location[id(p)]
        if lazy_pages:
            alive[b] = alive.get(b, 0) + p.numel() * buckets[b].wire_dtype.itemsize
        else:
            alive.setdefault(b, buckets[b].buffer_nbytes)
        moment(profile.live_at_ready[k])
        waiting[b] -= 1
        while next_launch < len(buckets) and waiting[next_launch] == 0:
            bucket = buckets[next_launch]
            alive[next_launch] = bucket.buffer_nbytes  # sealed: every slot and flag written
            if wire is not None:
                moment(profile.live_at_ready[k], wire.encode_peak("grads", bucket.numel, bucket.wire_dtype))
                alive[next_launch] += _reduce_message_bytes(bucket, rank, wire)
            if bucket.owner != rank:
                sent.add(next_launch)
                for finished in sent.beyond(MAX_SENDS_IN_FLIGHT):
                    alive.pop(finished)
            next_launch += 1
        moment(profile.stretch_peaks[k + 1])
    if wire is not None:  # the owner's reduces are waited for at the end: decoded and summed one by one
        own = [b for b in buckets if b.owner == rank]
        moment(profile.stretch_peaks[-1], max((wire.decode_peak("grads", b.numel, b.wire_dtype, summed=True) for b in own), default=0))
    return peak, comm_at_peak


def _reduce_message_bytes(bucket: ReduceBucket, rank: int, wire: LowBitCost) -> int:
    """What a bucket's low-bit reduce holds on ``rank`` until it is waited for: this rank's
    message, and on the owner the ``W`` messages it gathers."""
    message = wire.message_bytes("grads", bucket.numel, bucket.wire_dtype) or 0
    return message * (1 + wire.world) if bucket.owner == rank else message


def _residual_bytes(buckets: Sequence[ReduceBucket], wire: Optional[LowBitCost]) -> int:
    """Error feedback's residuals on every rank: float32, the size of each bucket that travels
    low-bit, held from the first backward on (``_owners.lowbit_reduce``)."""
    if wire is None or not wire.feedback:
        return 0
    return sum(4 * b.numel for b in buckets if wire.codec("grads", b.numel, b.wire_dtype) is not None)


def _reduce_sent(buckets: Sequence[ReduceBucket], wire: LowBitCost) -> int:
    """This rank's share of a step's reduce bytes (each rank sends its message of every bucket
    another rank owns): a low-bit bucket's message and its exact flags, or its exact buffer."""
    total = 0
    for b in buckets:
        message = wire.message_bytes("grads", b.numel, b.wire_dtype)
        flags = len(b.params) * b.wire_dtype.itemsize
        total += b.buffer_nbytes if message is None else message + flags
    return total * (wire.world - 1) // wire.world


def _ddp_bucket_count(params: Sequence[torch.Tensor]) -> int:
    numel = DDP_BUCKET_BYTES // max(1, params[0].element_size())
    return len(plan_buckets(list(reversed(params)), numel))


def _packed_broadcast_bytes(partition: Partition) -> int:
    """What ``OSS(parameters_as_bucket_view=False)`` holds while its broadcasts are in flight: every
    bucket of several parameters travels as a packed copy (its owner's packing, the others'
    receive buffer), all started before the first is waited for; a parameter alone in its bucket
    is sent from its own storage."""
    buckets = _broadcast_buckets(partition)
    return sum(_nbytes(t) for b in buckets if len(b.tensors) > 1 for t in b.tensors)


def _broadcast_count(partition: Partition) -> int:
    """OSS's broadcasts per step (every rank takes part in each): the buckets its own planner makes
    of each owner's trainable parameters, one device and dtype per bucket. (A bucket that cannot
    be made resident, its tensors not contiguous or aliased, is sent tensor by tensor; that
    cannot be seen on the meta device and is not counted.)"""
    return len(_broadcast_buckets(partition))


def _reduce_window_bytes(buckets: Sequence[ReduceBucket], rank: int, wire: Optional[LowBitCost] = None) -> int:
    """Most bytes of other owners' reduce buckets a rank holds at once: one filling while up to
    ``MAX_SENDS_IN_FLIGHT`` sent ones are still in flight; with ``wire`` (low-bit gradients),
    their messages too, the messages this rank gathers for its own buckets, and the largest
    encode's temporaries."""
    if wire is None:
        others = sorted((b.buffer_nbytes for b in buckets if b.owner != rank), reverse=True)
        return sum(others[: MAX_SENDS_IN_FLIGHT + 1])
    others = sorted((b.buffer_nbytes + _reduce_message_bytes(b, rank, wire) for b in buckets if b.owner != rank), reverse=True)
    gathered = sum(_reduce_message_bytes(b, rank, wire) for b in buckets if b.owner == rank)
    encoding = max((wire.encode_peak("grads", b.numel, b.wire_dtype) for b in buckets), default=0)
    return sum(others[: MAX_SENDS_IN_FLIGHT + 1]) + gathered + encoding


def _broadcast_buckets(partition: Partition) -> tuple:
    """``OSS``'s broadcast buckets: its planner's, of each owner's trainable parameters."""
    by_owner = [
        [partition.params[i] for i in partition.owned_indices(rank, trainable_only=True)]
        for rank in range(partition.world_size)
    ]
    return plan_broadcasts(by_owner, DEFAULT_BUCKET_NUMEL)


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()
