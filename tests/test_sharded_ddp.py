"""ShardedDataParallel (ZeRO-2) against torch DDP + the plain optimizer, on gloo process groups.

Tolerances. With SGD the update is linear in the gradient, so the only difference to DDP is the
order in which ranks' gradients are summed (a reduce vs an all-reduce: equal at world 1 and 2,
a few float32 ulps apart at 3): ``ATOL``/``RTOL`` cover that. Adam's update ``m / sqrt(v)`` is
scale-free, so ulp noise on a gradient that is ~0 can move that element by up to ``lr`` per
step, by an amount that depends on which roundings flip on the CPU at hand: Adam is compared bit
for bit, at world 3 on rank 0's batches (equal terms, each divided by 3 first as DDP and ZeRO-2
both do, add alike in any order: tests/_exact_sums.py); where rank 0's forward branches, rank 2's
loss counts 0 at world 3 instead.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, ShardedDataParallel
from tests._device import DEVICE_AGNOSTIC, on_test_device
from tests._exact_sums import batch_rank, loss_weight
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt, gpt_loss, token_batch
from tests.test_oss import _assert_close

pytestmark = DEVICE_AGNOSTIC

WORLD_SIZES = [1, 2, 3]
STEPS = 5
SGD = (torch.optim.SGD, dict(lr=0.05, momentum=0.9))
ADAM = (torch.optim.Adam, dict(lr=1e-2))


def _pair(make_model=gpt, optim=SGD, ddp_kwargs=None, **sdp_kwargs):
    """(reference DDP, its optimizer, ShardedDataParallel, its OSS) over identical models."""
    cls, kwargs = optim
    ref, ours = make_model(), make_model()
    ref_opt = cls(ref.parameters(), **kwargs)
    our_opt = OSS(ours.parameters(), cls, **kwargs)
    return DDP(ref, **(ddp_kwargs or {})), ref_opt, ShardedDataParallel(ours, our_opt, **sdp_kwargs), our_opt


def _step(model, optimizer, rank, step, set_to_none=True):
    optimizer.zero_grad(set_to_none=set_to_none)
    loss = gpt_loss(model, token_batch(rank, step))
    loss.backward()
    optimizer.step()
    return loss


def _train_both(ref, ref_opt, ours, our_opt, rank, steps=STEPS, first=0, set_to_none=True):
    for step in range(first, first + steps):
        _step(ref, ref_opt, rank, step, set_to_none)
        _step(ours, our_opt, rank, step, set_to_none)


def assert_adam_equal(ours, ref, what):
    """Adam-stepped parameters equal DDP's, bit for bit (a bound would depend on the CPU: see
    the module docstring)."""
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), f"{what}: {name} differs from DDP's by {(a - b).abs().max():.3g}"


def _check_matches_ddp(rank, world):
    for bucket in (2**23, 0, 300):
        for set_to_none in (True, False):
            what = f"SGD bucket={bucket} set_to_none={set_to_none}"
            ref, ref_opt, ours, our_opt = _pair(reduce_buffer_size=bucket)
            _train_both(ref, ref_opt, ours, our_opt, rank, set_to_none=set_to_none)
            _assert_close(ours.module, ref.module, what)
            assert_same_on_all_ranks(list(ours.parameters()), what)
    ref, ref_opt, ours, our_opt = _pair(optim=ADAM)
    _train_both(ref, ref_opt, ours, our_opt, batch_rank(rank, world))
    assert_adam_equal(ours.module, ref.module, "Adam")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_matches_ddp_with_buckets_on_and_off_and_either_zero_grad(world_size):
    run_on_ranks(_check_matches_ddp, world_size)


def _check_cast_mid_training(rank, world):
    ref, ref_opt, ours, our_opt = _pair()
    _train_both(ref, ref_opt, ours, our_opt, rank, steps=2)
    ours.to(dtype=torch.float64)  # new storage for every parameter: buckets must follow
    ref = DDP(ref.module.to(torch.float64))
    _train_both(ref, ref_opt, ours, our_opt, rank, steps=3, first=2)
    assert all(p.dtype == torch.float64 for p in ours.parameters())
    _assert_close(ours.module, ref.module, "after .to(float64)")
    assert_same_on_all_ranks(list(ours.parameters()), "replicas after .to(float64)")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_to_dtype_mid_training_keeps_matching_ddp(world_size):
    run_on_ranks(_check_cast_mid_training, world_size)


def _check_reduce_fp16(rank, world):
    ref, ref_opt, ours, our_opt = _pair(reduce_fp16=True, reduce_buffer_size=500)
    ref.register_comm_hook(None, default_hooks.fp16_compress_hook)
    _train_both(ref, ref_opt, ours, our_opt, rank)
    # Same fp16 wire format as DDP's fp16 compression hook; DDP casts before dividing by the
    # world size and we after, so each gradient element may differ by one fp16 ulp (2**-11
    # relative) per step, and SGD carries that linearly: a few 1e-4 at most.
    _assert_close(ours.module, ref.module, "reduce_fp16 vs DDP fp16 hook", atol=5e-4, rtol=1e-3)
    fp32_ref, fp32_opt, _, _ = _pair()
    for step in range(STEPS):
        _step(fp32_ref, fp32_opt, rank, step)
    _assert_close(ours.module, fp32_ref.module, "reduce_fp16 vs fp32 DDP", atol=2e-3, rtol=2e-3)


def _bf16_gpt():
    return gpt().to(torch.bfloat16)


def _check_bf16_model(rank, world):
    ref, ref_opt, ours, our_opt = _pair(_bf16_gpt, reduce_fp16=True, reduce_buffer_size=500)
    assert all(b.wire_dtype == torch.bfloat16 for b in ours._router.buckets), "bf16 gradients left bf16"
    _train_both(ref, ref_opt, ours, our_opt, rank)
    # both reduce in bf16; sums in another order differ by bf16 ulps (2**-8 relative) per step,
    # carried linearly by SGD over 5 steps of lr 0.05
    _assert_close(ours.module, ref.module, "bf16 model", atol=2e-2, rtol=2e-2)
    assert ours.head is ours.module.head, "attribute access is not forwarded to the module"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bf16_model_reduces_in_bf16_and_matches_ddp(world_size):
    run_on_ranks(_check_bf16_model, world_size)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_fp16_with_buckets_matches_ddp_fp16_compression(world_size):
    run_on_ranks(_check_reduce_fp16, world_size)


# ------------------------------------------------------------------------------- no_sync


class _CollectiveCounter:
    """Counts calls to torch.distributed collectives while active."""

    NAMES = ("reduce", "all_reduce", "broadcast", "all_gather", "reduce_scatter_tensor", "send", "recv")

    def __enter__(self):
        self.calls = 0
        self._saved = {name: getattr(dist, name) for name in self.NAMES}
        for name, fn in self._saved.items():
            setattr(dist, name, self._counting(fn))
        return self

    def _counting(self, fn):
        def wrapper(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)
        return wrapper

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _check_no_sync(rank, world):
    ref, ref_opt, ours, our_opt = _pair()
    for step in range(STEPS):
        for model, opt in ((ref, ref_opt), (ours, our_opt)):
            opt.zero_grad()
            with model.no_sync():
                with _CollectiveCounter() as counter:
                    for micro in range(2):
                        gpt_loss(model, token_batch(rank, 10 * step + micro)).backward()
                if model is ours:
                    assert counter.calls == 0, f"no_sync communicated {counter.calls} times"
            gpt_loss(model, token_batch(rank, 10 * step + 2)).backward()
            opt.step()
    _assert_close(ours.module, ref.module, "no_sync over 3 micro-steps")
    # as with DDP, the forward decides: backward called after the context closed still accumulates
    ref, ref_opt, ours, our_opt = _pair()
    for step in range(2):
        for model, opt in ((ref, ref_opt), (ours, our_opt)):
            opt.zero_grad()
            for micro in range(3):
                with model.no_sync() if micro < 2 else contextlib.nullcontext():
                    loss = gpt_loss(model, token_batch(rank, 10 * step + micro))
                with _CollectiveCounter() as counter:
                    loss.backward()
                if model is ours and micro < 2:
                    assert counter.calls == 0, "a backward of a no_sync forward communicated"
            opt.step()
    _assert_close(ours.module, ref.module, "no_sync forward, backward outside")
    # reduce(): all micro-steps inside no_sync, then one explicit reduction
    ref, ref_opt, ours, our_opt = _pair()
    for step in range(2):
        for model, opt in ((ref, ref_opt), (ours, our_opt)):
            opt.zero_grad()
            with model.no_sync():
                for micro in range(2 if model is ref else 3):
                    gpt_loss(model, token_batch(rank, 10 * step + micro)).backward()
            if model is ref:
                gpt_loss(model, token_batch(rank, 10 * step + 2)).backward()
            else:
                model.reduce()
            opt.step()
    _assert_close(ours.module, ref.module, "no_sync then reduce()")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_no_sync_accumulates_without_communication(world_size):
    run_on_ranks(_check_no_sync, world_size)


# ------------------------------------------------------------------------- trainability


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _check_freeze_unfreeze(rank, world):
    records = _Records()
    logging.getLogger("sharded").addHandler(records)
    ref, ref_opt, ours, our_opt = _pair()
    step = 0
    for phase, trainable in enumerate((True, False, True, False)):
        for model in (ref.module, ours.module):
            model.blocks[0].requires_grad_(trainable)
        ref = DDP(ref.module)  # DDP must be rebuilt when trainability changes; SDP notices alone
        _train_both(ref, ref_opt, ours, our_opt, rank, steps=3, first=step)
        step += 3
        assert_same_on_all_ranks(list(ours.parameters()), f"replicas after phase {phase}")
        _assert_close(ours.module, ref.module, f"phase {phase}")
    warnings = [m for m in records.messages if "requires_grad changed" in m]
    assert len(warnings) == 1, warnings


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_freeze_and_unfreeze_mid_training_keeps_replicas_identical(world_size):
    run_on_ranks(_check_freeze_unfreeze, world_size)


# ---------------------------------------------------------------- buffers, unused, two optims


class _BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 64)
        self.unused = nn.Linear(16, 16)  # never called: no gradient anywhere
        self.sometimes = nn.Linear(16, 16)  # called on rank 0 only

    def forward(self, tokens):
        x = self.norm(self.embed(tokens).mean(dim=1))
        if dist.get_rank() == 0:
            x = x + self.sometimes(x)
        return self.head(x).unsqueeze(1).expand(-1, tokens.shape[1], -1)


def _bn_net():
    torch.manual_seed(0)
    return on_test_device(_BatchNormNet())


def _check_buffers_and_unused(rank, world):
    ref, ref_opt, ours, our_opt = _pair(_bn_net, ADAM, ddp_kwargs=dict(find_unused_parameters=True))
    # rank 0's forward branches, so at world 3 rank 2's loss counts 0 (tests/_exact_sums.py)
    weight = loss_weight(rank, world)
    for step in range(STEPS):
        for model, opt in ((ref, ref_opt), (ours, our_opt)):
            opt.zero_grad()
            (weight * gpt_loss(model, token_batch(rank, step))).backward()
            opt.step()
    assert_adam_equal(ours.module, ref.module, "BatchNorm + unused")
    for name, buffer in ours.module.named_buffers():
        torch.testing.assert_close(buffer, dict(ref.module.named_buffers())[name], rtol=1e-5, atol=1e-6)
    assert ours.module.unused.weight.grad is None, "a globally unused parameter got a gradient"
    assert torch.equal(ours.module.unused.weight, _bn_net().unused.weight)
    # DDP broadcasts buffers before a forward when the forward before it was a synced training
    # one: the first micro-step of an accumulation window, and the first forward of an eval
    # loop, but not the next ones
    for step in range(2):
        for model, opt in ((ref, ref_opt), (ours, our_opt)):
            opt.zero_grad()
            for micro in range(3):
                with model.no_sync() if micro < 2 else contextlib.nullcontext():
                    loss = model(token_batch(rank, 10 * step + micro)).logsumexp(-1).mean()
                loss.backward()
            opt.step()
            with torch.no_grad():
                for batch in range(2):
                    model(token_batch(rank, 20 + batch))
    for name, buffer in ours.module.named_buffers():
        torch.testing.assert_close(buffer, dict(ref.module.named_buffers())[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: buffer {name} after no_sync and eval: {m}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_batchnorm_buffers_and_unused_parameters_match_ddp(world_size):
    run_on_ranks(_check_buffers_and_unused, world_size)


def _check_two_optimizers(rank, world):
    ref_model, our_model = gpt(), gpt()
    head = lambda m: [m.head.weight]
    body = lambda m: [p for n, p in m.named_parameters() if not n.startswith("head")]
    ref_opts = [torch.optim.SGD(body(ref_model), lr=0.05, momentum=0.9), torch.optim.Adam(head(ref_model), lr=1e-3)]
    our_opts = [OSS(body(our_model), torch.optim.SGD, lr=0.05, momentum=0.9), OSS(head(our_model), torch.optim.Adam, lr=1e-3)]
    ref, ours = DDP(ref_model), ShardedDataParallel(our_model, our_opts)
    for step in range(STEPS):
        for model, opts in ((ours, our_opts), (ref, ref_opts)):
            for opt in opts:
                opt.zero_grad()
            gpt_loss(model, token_batch(batch_rank(rank, world), step)).backward()
            if model is ours:
                norm = our_opts[0].clip_grad_norm(1.0)
            else:  # torch's norm to rounding, and the reference clipped by ours, so that the rest
                # compares bit for bit. The k parameters' squared norms are added in another
                # association: each is within (k - 1) ulps of the exact sum, so two within
                # 2 (k - 1), which the root halves; and one rounding of each root
                grads = [p.grad for p in body(ref_model)]
                ref_norm = torch.nn.utils.get_total_norm(grads)
                torch.testing.assert_close(norm, ref_norm, rtol=(len(grads) + 1) * 2**-24, atol=0, msg=f"step {step}: clip norm")
                torch.nn.utils.clip_grads_with_norm_(body(ref_model), 1.0, norm)
            for opt in opts:
                opt.step()
    assert_adam_equal(our_model, ref_model, "two OSS optimizers + clip_grad_norm")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_two_optimizers_and_clip_grad_norm_match_ddp(world_size):
    run_on_ranks(_check_two_optimizers, world_size)


# ----------------------------------------------------------------------- gradient memory


def _grad_bytes(params):
    storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                for p in params if p.grad is not None}
    return sum(storages.values())


def _check_gradient_memory(rank, world):
    bucket = 2000
    _, _, ours, our_opt = _pair(reduce_buffer_size=bucket)
    for step in range(2):
        our_opt.zero_grad()
        gpt_loss(ours, token_batch(rank, step)).backward()
        owned = sum(p.numel() * p.element_size() for p, r in our_opt.param_to_rank.items() if r == rank)
        held = _grad_bytes(ours.parameters())
        # + the per-parameter 'used' flags that travel at the end of each bucket
        flags = sum(p.element_size() for p, r in our_opt.param_to_rank.items() if r == rank)
        assert held <= owned + flags + bucket * 4, (held, owned)
        for p, r in our_opt.param_to_rank.items():
            assert (p.grad is None) == (r != rank), "a rank holds a gradient it does not own"
        our_opt.step()


@pytest.mark.parametrize("world_size", [2, 3])
def test_non_owned_gradients_are_released_after_backward(world_size):
    run_on_ranks(_check_gradient_memory, world_size)
