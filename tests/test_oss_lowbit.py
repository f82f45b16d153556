"""ZeRO-1's low-bit parameter broadcast (``OSS(lowbit=LowBit(params=...))``) at worlds 1-3.

The contract checked: every rank computes with the same replica, and after every step each
owned parameter's replica is exactly ``old replica + decode(encode(master - old replica))``,
computed here from the owner's own values with the codec (so a wrong block layout, a lost
bucket or a replica that drifts from what was sent fails ``torch.equal``), hence within
``error_bound(master - old replica)`` of the owner's exact master plus one float32 rounding of
the sum. The masters follow the exact run (DDP + exact ``OSS``) closely and the error is > 0, so
the low-bit path really ran. Bytes are counted exactly against the codec's message sizes.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, LowBit, ZeroRedundancyOptimizer, checkpoint
from sharded._common.lowbit import codec_for
from sharded.invariant import MicroBatches
from tests._device import DEVICE_AGNOSTIC
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt, gpt_loss, token_batch

pytestmark = DEVICE_AGNOSTIC

WORLD_SIZES = [1, 2, 3]
STEPS = 4
BLOCK = 64
MASTER = "lowbit_master"
FP32_ULP = 2.0**-23  # the float32 sum replica + change rounds once: half an ulp of the result, taken whole


def _step(model, optimizer, rank, step, clip=None):
    """One training step; returns the loss and, with ``clip``, the gradient norm clipping saw."""
    optimizer.zero_grad()
    loss = gpt_loss(model, token_batch(rank, step))
    loss.backward()
    norm = optimizer.clip_grad_norm(clip) if clip is not None else None
    optimizer.step()
    return loss.detach(), norm


def _masters(optimizer):
    return {p: held[MASTER] for p, held in optimizer.held_states().items() if MASTER in held}


def _check_one_step(optimizer, codec, old):
    """After a step: each bucket this rank sent is predicted exactly from its masters and the old
    replicas, and within the codec's bound of the masters. Returns the largest error seen."""
    masters, worst = _masters(optimizer), 0.0
    for bucket in optimizer.broadcaster.buckets:
        if bucket.src != optimizer.rank:
            continue
        master = torch.cat([masters[p].reshape(-1) for p in bucket.tensors])
        before = torch.cat([old[p].reshape(-1) for p in bucket.tensors])
        replica = torch.cat([p.detach().reshape(-1) for p in bucket.tensors])
        change = master - before
        decoded = codec.decode(codec.encode(change, BLOCK), change.numel(), BLOCK)
        assert torch.equal(replica, before + decoded), "the replica is not old + decode(encode(master - old))"
        error = (replica - master).abs()
        bound = codec.error_bound(change, BLOCK) + FP32_ULP * master.abs()
        assert bool((error <= bound).all()), f"|replica - master| {float((error - bound).max()):.3g} over the bound"
        worst = max(worst, float(error.max()))
    return worst


def _bound_bytes_and_loss_against_exact(rank, world):
    for fmt, as_view in (("int8", True), ("int8", False), ("fp8_e4m3", True)):
        codec = codec_for(fmt)
        ref, ours = gpt(), gpt()
        exact = OSS(ref.parameters(), torch.optim.AdamW, lr=1e-2)
        low = OSS(ours.parameters(), torch.optim.AdamW, lr=1e-2, parameters_as_bucket_view=as_view,
                  lowbit=LowBit(params=fmt, block_size=BLOCK))
        ref_ddp, our_ddp = DDP(ref), DDP(ours)
        worst = 0.0
        for step in range(STEPS):
            ref_loss, ref_norm = _step(ref_ddp, exact, rank, step, clip=1.0)
            old = {p: p.detach().clone() for p in ours.parameters()}
            our_loss, our_norm = _step(our_ddp, low, rank, step, clip=1.0)
            assert step > 0 or torch.equal(our_norm, ref_norm)  # gradients are exact: clipping is unaffected
            worst = max(worst, _check_one_step(low, codec, old))
            assert_same_on_all_ranks(list(ours.parameters()), f"{fmt} replicas, step {step}")
            # the same first forward (identical start); afterwards close: one rounding per step of the change
            assert our_loss == ref_loss if step == 0 else abs(float(our_loss - ref_loss)) < 1e-3 * float(ref_loss)
            traffic = low.lowbit_traffic
            mine = [b.numel for b in low.broadcaster.buckets if b.src == rank]
            assert traffic.step == step
            assert traffic.sent["broadcast"] == sum(codec.message_numel(n, BLOCK) for n in mine) * (world - 1)
            assert traffic.exact["broadcast"] == sum(mine) * 4 * (world - 1)
            if world > 1 and mine:  # int8 and fp8: 1 byte per element plus a 4-byte scale per block
                assert 0.25 < traffic.sent_bytes / traffic.exact_bytes <= 0.25 * (1 + 4 / BLOCK) + 0.01
        assert worst > 0, "no rounding at all: the low-bit path did not run"
        # the masters follow the exact run: relative distance of all parameters (2-norms) after STEPS steps
        masters, exact_values = _all_masters(low, ours), [p.detach() for p in ref.parameters()]
        drift = (sum(float((m - e).pow(2).sum()) for m, e in zip(masters, exact_values))
                 / sum(float(e.pow(2).sum()) for e in exact_values)) ** 0.5
        assert 0 < drift < 1e-3, f"{fmt}: masters {drift:.3g} from the exact run"


def _all_masters(optimizer, model):
    """Every parameter's master (its replica where its owner keeps none), on every rank."""
    masters = _masters(optimizer)
    out = []
    for p, owner in zip(optimizer.partition.params, optimizer.partition.owners):
        value = masters.get(p, p.detach()).clone()
        if dist.get_world_size() > 1:
            dist.broadcast(value, owner)
        out.append(value)
    position = {id(p): i for i, p in enumerate(optimizer.partition.params)}
    return [out[position[id(p)]] for p in model.parameters()]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_replicas_within_one_rounding_of_the_masters_and_bytes_a_quarter(world_size):
    run_on_ranks(_bound_bytes_and_loss_against_exact, world_size)


def _shadow_fallbacks_and_zero_redundancy_optimizer(rank, world):
    checks = []
    model = gpt()
    low = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                                  lowbit=LowBit(params="int8", block_size=BLOCK, check_every=2, on_check=checks.append))
    assert "lowbit" not in low.defaults and low.lowbit.params == "int8"
    ddp = DDP(model)
    for step in range(3):
        _step(ddp, low, rank, step)
        if step in (0, 2):  # a shadow step: relative error of the change, and the replicas' divergence
            masters = _all_masters(low, model)
            replicas = [p.detach() for p in model.parameters()]
            divergence = (sum(float((r - m).pow(2).sum()) for r, m in zip(replicas, masters))
                          / sum(float(m.pow(2).sum()) for m in masters)) ** 0.5
            check = checks[-1]
            assert (check.step, check.collective) == (step, "broadcast")
            assert check.elements == sum(p.numel() for p in model.parameters())
            assert 0 < check.relative_error < 0.02
            assert check.divergence == pytest.approx(divergence, rel=1e-3)
    assert [c.step for c in checks] == [0, 2]

    # a bucket below min_numel travels exact, with a warning after the first step only; "raise" refuses it
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("sharded.lowbit").addHandler(handler)
    ref, ours = gpt(), gpt()
    exact = OSS(ref.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    fallback = OSS(ours.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, lowbit=LowBit(params="int8", min_numel=10**9))
    ref_ddp, our_ddp = DDP(ref), DDP(ours)
    for step in range(2):
        _step(ref_ddp, exact, rank, step)
        _step(our_ddp, fallback, rank, step)
        assert fallback.lowbit_traffic.sent == fallback.lowbit_traffic.exact
    logging.getLogger("sharded.lowbit").removeHandler(handler)
    warned = [r.getMessage() for r in records if "sent exact" in r.getMessage()]
    assert len(warned) == 1 and "below 1000000000 elements" in warned[0] and f"rank {rank}" in warned[0]
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))
    strict = OSS(gpt().parameters(), torch.optim.SGD, lr=0.1, lowbit=LowBit(params="int8", min_numel=10**9, fallback="raise"))
    for p in strict.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match=rf"rank {rank}.*below 1000000000 elements"):
        strict.step()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shadow_checks_fallbacks_and_torch_named_class(world_size):
    run_on_ranks(_shadow_fallbacks_and_zero_redundancy_optimizer, world_size)


def _refusals(rank, world):
    params = list(gpt().parameters())
    cases = [
        (dict(lowbit=LowBit(grads="int8")), ValueError, r"ShardedDataParallel\(lowbit=\)"),
        (dict(lowbit=LowBit.mode("int8")), ValueError, r"grads='int8'"),
        (dict(lowbit=LowBit()), ValueError, r"params=None"),
        (dict(lowbit=LowBit(params="int8", error_feedback=False)), ValueError, r"error_feedback=False"),
        (dict(lowbit=LowBit(params="int8"), broadcast_fp16=True), ValueError, r"broadcast_fp16"),
        (dict(lowbit=LowBit(params="int8"), overlap_with_ddp=True), ValueError, r"overlap_with_ddp"),
        (dict(lowbit="int8"), TypeError, r"sharded.LowBit"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=rf"rank {rank}.*{message}"):
            OSS(params, torch.optim.SGD, lr=0.1, **kwargs)
    low = OSS(params, torch.optim.SGD, lr=0.1, lowbit=LowBit(params="int8"))
    with pytest.raises(ValueError, match=rf"rank {rank}.*broadcast_fp16"):
        low.broadcast_fp16 = True
    assert not low.broadcast_fp16 and OSS(params, torch.optim.SGD, lr=0.1).lowbit_traffic is None
    if world in (1, 2):  # MicroBatches needs a power-of-two world
        model = gpt()
        optimizer = OSS(model.parameters(), torch.optim.SGD, lr=0.1, lowbit=LowBit(params="int8"))
        ddp = DDP(model)
        micro_batches = MicroBatches(ddp, 2)  # kept: the refusal looks at live loops
        for index in micro_batches:
            gpt_loss(ddp, token_batch(index, 0)).backward()
        with pytest.raises(NotImplementedError, match=rf"rank {rank}.*lowbit.*MicroBatches"):
            optimizer.step()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_refusals_name_the_field_and_the_rank(world_size):
    run_on_ranks(_refusals, world_size)


def _build():
    """A lowbit OSS beside DDP; ``find_unused_parameters=True`` keeps DDP from re-bucketing after
    its first backward, so a resumed process sums three ranks' gradients in the order the
    uninterrupted one did (tests/test_checkpoint_resume.py measured why that matters at world 3)."""
    model = gpt()
    optimizer = OSS(model.parameters(), torch.optim.AdamW, lr=1e-2, lowbit=LowBit(params="int8", block_size=BLOCK))
    return model, optimizer, DDP(model, find_unused_parameters=True)


def _resume_bit_for_bit(rank, world, root):
    model, optimizer, ddp = _build()
    for step in range(2):
        _step(ddp, optimizer, rank, step, clip=0.05)
    checkpoint.save(checkpoint.get_state_dict(model, optimizer), f"{root}/step-2")
    optimizer.consolidate_state_dict(recipient_rank=-1)
    torch_format = optimizer.state_dict()
    replicas = {k: v.clone() for k, v in model.state_dict().items()}
    masters = _all_masters(optimizer, model)
    full = checkpoint.get_state_dict(model, optimizer, full=True)
    if rank == 0:  # the export holds the masters, and a plain torch optimizer state without them
        assert all(torch.equal(full["model"][name], m) for (name, _), m in zip(model.named_parameters(), masters))
        assert all(MASTER not in held for held in full["optim"]["state"].values())
    for step in range(2, 4):
        _step(ddp, optimizer, rank, step, clip=0.05)
    continued = [p.detach().clone() for p in model.parameters()]

    for route in ("sharded checkpoint", "torch state dicts"):
        model, optimizer, ddp = _build()
        if route == "sharded checkpoint":
            state = checkpoint.get_state_dict(model, optimizer)
            checkpoint.load(state, f"{root}/step-2")
            checkpoint.set_state_dict(model, optimizer, state)
        else:
            model.load_state_dict(replicas)
            optimizer.load_state_dict(torch_format)
        for step in range(2, 4):
            _step(ddp, optimizer, rank, step, clip=0.05)
        for a, b in zip(model.parameters(), continued):
            assert torch.equal(a, b), f"{route}: resumed parameters differ from the continued run"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_checkpoint_resumes_replicas_and_masters_bit_for_bit(world_size, tmp_path):
    run_on_ranks(_resume_bit_for_bit, world_size, str(tmp_path))
