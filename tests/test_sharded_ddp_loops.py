"""Training loops written for DDP, run on ShardedDataParallel unchanged: activation
checkpointing, DDP's accumulation switch, clipping, ``torch.compile``, and a reduce order that
follows the real backward even when some parameters get no gradient, and a small first bucket
that leaves early in backward, as DDP's does.

Tolerances. These use SGD, whose update is linear in the gradient, so the only difference to
DDP is the order of float32 additions: DDP all-reduces a gradient autograd already summed,
while a gradient produced in several backward passes (reentrant checkpointing) is summed here
pass by pass, and a reduce adds ranks in another order than an all-reduce. That is a few ulps
of each gradient, carried linearly over a few steps: ``ATOL``/``RTOL`` of test_oss cover it
with a wide margin, and a dropped or overwritten contribution (the bug these tests guard
against) moves parameters by 1e-2 or more.
"""

from __future__ import annotations

import contextlib
import unittest.mock

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import sharded._common.in_flight
from sharded._owners.reduce_plan import FIRST_BUCKET_BYTES
from sharded import OSS, ShardedDataParallel
from tests._exact_sums import batch_rank
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt, gpt_loss, token_batch
from tests.test_oss import _assert_close

WORLD_SIZES = [1, 2, 3]
SGD = dict(lr=0.1, momentum=0.9)


# --------------------------------------------------------------- activation checkpointing


class _Stack(nn.Module):
    """Input layer, four layers (one block reused four times, or four blocks), output layer.

    ``checkpointing`` is ``"none"``, ``"layer"`` (each layer its own segment) or ``"whole"``
    (the four layers in one segment). ``gate`` is used inside every segment and again outside,
    so its gradient comes from several backward passes even without shared blocks.
    """

    def __init__(self, shared: bool, checkpointing: str = "none", reentrant: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.gate = nn.Parameter(torch.full((16,), 0.5))
        block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.layers = nn.ModuleList([block] * 4 if shared else [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
        self.checkpointing, self.reentrant = checkpointing, reentrant

    def _layer(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return h + self.gate * layer(h)

    def _layers(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.checkpointing == "layer":
                h = checkpoint(self._layer, layer, h, use_reentrant=self.reentrant)
            else:
                h = self._layer(layer, h)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.checkpointing == "whole":
            h = checkpoint(self._layers, h, use_reentrant=self.reentrant)
        else:
            h = self._layers(h)
        return self.out(h * self.gate)


def _stack_batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 8, generator=g)


def _train_stack(model, optimizer, rank, steps, micro_steps, forward=None):
    """``micro_steps`` forwards per step, all but the last inside ``no_sync``."""
    forward = forward or model
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(micro_steps):
            last = micro == micro_steps - 1
            with contextlib.nullcontext() if last else model.no_sync():
                forward(_stack_batch(rank, 10 * step + micro)).pow(2).mean().backward()
        optimizer.step()


def _check_checkpointing(rank, world):
    steps = 3
    for micro_steps in (1, 3):
        references = {}
        for shared in (True, False):
            ref = _Stack(shared)
            _train_stack(DDP(ref), torch.optim.SGD(ref.parameters(), **SGD), rank, steps, micro_steps)
            references[shared] = ref
        for shared in (True, False):
            for checkpointing in ("layer", "whole"):
                for reentrant in (True, False):
                    what = f"shared={shared} checkpointing={checkpointing} reentrant={reentrant} micro={micro_steps}"
                    model = _Stack(shared, checkpointing, reentrant)
                    optimizer = OSS(model.parameters(), torch.optim.SGD, **SGD)
                    wrapped = ShardedDataParallel(model, optimizer, reduce_buffer_size=200)
                    _train_stack(wrapped, optimizer, rank, steps, micro_steps)
                    _assert_close(model, references[shared], what)
                    assert_same_on_all_ranks(list(model.parameters()), what)
                    if world > 1:
                        # after the first backward each gradient's count of passes is known
                        assert wrapped.backward_stats.late_reduces == 0, (what, wrapped.backward_stats)
        # the wrapper itself inside a reentrant checkpoint: every gradient comes from a nested backward
        model = _Stack(True)
        optimizer = OSS(model.parameters(), torch.optim.SGD, **SGD)
        wrapped = ShardedDataParallel(model, optimizer, reduce_buffer_size=200)
        around = lambda x: checkpoint(wrapped, x.requires_grad_(), use_reentrant=True)
        _train_stack(wrapped, optimizer, rank, steps, micro_steps, forward=around)
        _assert_close(model, references[True], f"wrapper inside a reentrant checkpoint, micro={micro_steps}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_activation_checkpointing_reentrant_or_not_matches_ddp_without_it(world_size):
    run_on_ranks(_check_checkpointing, world_size, timeout=180)


# ------------------------------------------------------- DDP's accumulation switch, clipping


def _two_groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _ddp_style_loop(model, optimizer, clip, rank, steps=4, accumulation=2):
    """A GPT training loop as written for DDP: accumulation by toggling
    ``require_backward_grad_sync``, clipping, AdamW with two groups. Returns the losses."""
    losses = []
    for step in range(steps):
        for micro in range(accumulation):
            model.require_backward_grad_sync = micro == accumulation - 1
            loss = gpt_loss(model, token_batch(rank, step * accumulation + micro)) / accumulation
            loss.backward()
        losses.append(clip(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return torch.stack(losses)


def _check_ddp_loop_with_three_line_swap(rank, world):
    hyper = dict(lr=3e-3, betas=(0.9, 0.95))
    data_rank = batch_rank(rank, world)  # rank 0's batches at world 3: exact sums, tests/_exact_sums.py
    ref_model, our_model = gpt(), gpt()
    our_opt = OSS(_two_groups(our_model), torch.optim.AdamW, **hyper)  # 1: the optimizer
    ours = ShardedDataParallel(our_model, our_opt)  # 2: the wrapper
    our_norms = _ddp_style_loop(ours, our_opt, lambda m: m.clip_grad_norm_(0.25), data_rank)  # 3: the clip call
    # DDP's loop clips by the norm ours took, so that the parameters compare bit for bit, and
    # reports torch's own norm: the k parameters' squares added in another association, each
    # within (k - 1) ulps of the exact sum, two within 2 (k - 1), halved by the root, and one
    # rounding of each root
    ref_opt = torch.optim.AdamW(_two_groups(ref_model), **hyper)
    ref = DDP(ref_model)
    ref_norms = _ddp_style_loop(ref, ref_opt, _clipping_by(iter(our_norms)), data_rank)
    k = len(list(ref_model.parameters()))
    torch.testing.assert_close(our_norms, ref_norms, rtol=(k + 1) * 2**-24, atol=0)
    assert bool((ref_norms > 0.25).all()), f"clipping must be active for this test to mean anything: {ref_norms}"
    for (name, a), b in zip(our_model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), f"{name} differs from DDP's by {(a - b).abs().max():.3g}"
    ref_losses = [gpt_loss(ref, token_batch(rank, 100 + i)).item() for i in range(2)]
    our_losses = [gpt_loss(ours, token_batch(rank, 100 + i)).item() for i in range(2)]
    assert our_losses == ref_losses, (our_losses, ref_losses)
    # the switch is the state no_sync() toggles, readable both ways
    ours.require_backward_grad_sync = True
    with ours.no_sync():
        assert ours.require_backward_grad_sync is False
    assert ours.require_backward_grad_sync is True


def _clipping_by(norms):
    """DDP's clip for :func:`_ddp_style_loop`: torch's norm of the gradients, returned, and a
    clip by the next of ``norms`` (ours)."""

    def clip(model):
        torch_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.25, next(norms))
        return torch_norm

    return clip


def _check_clip_grad_norm_types(rank, world):
    for norm_type in (2.0, 1.0, float("inf")):
        ref_model, our_model = gpt(), gpt()
        ref_opt = torch.optim.SGD(ref_model.parameters(), **SGD)
        our_opt = OSS(our_model.parameters(), torch.optim.SGD, **SGD)
        ref, ours = DDP(ref_model), ShardedDataParallel(our_model, our_opt)
        for step in range(3):
            for model, opt in ((ref, ref_opt), (ours, our_opt)):
                opt.zero_grad()
                gpt_loss(model, token_batch(rank, step)).backward()
                if model is ref:
                    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.1, norm_type)
                else:
                    our_norm = ours.clip_grad_norm_(0.1, norm_type)
                opt.step()
            torch.testing.assert_close(our_norm, ref_norm, rtol=1e-5, atol=1e-7)
        _assert_close(our_model, ref_model, f"clip_grad_norm_ norm_type={norm_type}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ddp_loop_with_require_backward_grad_sync_and_clipping_gives_ddp_losses(world_size):
    run_on_ranks(_check_ddp_loop_with_three_line_swap, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_clip_grad_norm_returns_the_global_norm_for_every_norm_type(world_size):
    run_on_ranks(_check_clip_grad_norm_types, world_size)


# --------------------------------------------------------------------------- torch.compile


def _check_compile(rank, world):
    ref_model = gpt()
    ref_opt = torch.optim.SGD(ref_model.parameters(), **SGD)
    ref = DDP(ref_model)
    models = {}
    for order in ("compile, then wrap", "wrap, then compile"):
        torch._dynamo.reset()
        model = gpt()
        optimizer = OSS(model.parameters(), torch.optim.SGD, **SGD)
        if order == "compile, then wrap":
            wrapped = ShardedDataParallel(torch.compile(model, backend="aot_eager"), optimizer)
        else:
            wrapped = torch.compile(ShardedDataParallel(model, optimizer), backend="aot_eager")
        models[order] = (model, wrapped, optimizer)
    for step in range(3):
        for model, optimizer in [(ref, ref_opt)] + [(w, o) for _, w, o in models.values()]:
            optimizer.zero_grad()
            gpt_loss(model, token_batch(rank, step)).backward()
            optimizer.step()
    for order, (model, _, _) in models.items():
        _assert_close(model, ref_model, order)
        assert_same_on_all_ranks(list(model.parameters()), order)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_compiled_model_matches_ddp_in_either_wrapping_order(world_size):
    run_on_ranks(_check_compile, world_size, timeout=240)


# ---------------------------------------------------- reduce order, unused parameters


class _Reversed(nn.Module):
    """Six layers run in the reverse of the order they are defined in, so gradients arrive in
    definition order, against the usual guess. ``unused`` adds a layer defined last (the first
    the usual guess expects a gradient from) that never runs; ``sometimes`` one that runs first,
    when the forward is asked to, so that its gradient arrives last."""

    def __init__(self, unused: bool = False, sometimes: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.sometimes = nn.Linear(16, 16) if sometimes else None
        self.unused = nn.Linear(16, 16) if unused else None

    def forward(self, x: torch.Tensor, use_sometimes: bool = False) -> torch.Tensor:
        if use_sometimes:
            x = x + self.sometimes(x)
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def _reversed_batch(rank, step):
    g = torch.Generator().manual_seed(500 * step + rank)
    return torch.randn(4, 16, generator=g)


def _train_reversed(model, optimizer, rank, steps, sometimes_on=lambda step: False):
    stats = []
    for step in range(steps):
        optimizer.zero_grad()
        model(_reversed_batch(rank, step), use_sometimes=sometimes_on(step)).pow(2).mean().backward()
        optimizer.step()
        stats.append(getattr(model, "backward_stats", None))
    return stats


def _check_reduce_order_and_unused(rank, world):
    bucket = 600  # about two layers per window: several buckets per owner
    runs = {}
    for unused in (False, True):
        ref = _Reversed(unused)
        _train_reversed(DDP(ref, find_unused_parameters=unused), torch.optim.SGD(ref.parameters(), **SGD), rank, 4)
        model = _Reversed(unused)
        optimizer = OSS(model.parameters(), torch.optim.SGD, **SGD)
        wrapped = ShardedDataParallel(model, optimizer, reduce_buffer_size=bucket)
        stats = _train_reversed(wrapped, optimizer, rank, 4)
        _assert_close(model, ref, f"reversed execution order, unused={unused}")
        runs[unused] = stats
    first, later = runs[False][0], runs[False][-1]
    # After one backward the plan follows the real order: every bucket but those of the last
    # window (one per owner at most) leaves while gradients are still arriving.
    assert later.launched_during_backward >= later.buckets - world, later
    assert first.launched_during_backward < later.launched_during_backward, (first, later)
    # An unused parameter early in the first guess changes neither overlap nor memory by more than a bucket.
    with_unused = runs[True][-1]
    one_bucket_bytes = (bucket + 16) * 4
    assert abs(with_unused.launched_during_backward - later.launched_during_backward) <= 1, (with_unused, later)
    assert abs(with_unused.peak_bucket_bytes - later.peak_bucket_bytes) <= one_bucket_bytes, (with_unused, later)
    assert with_unused.late_reduces == 0


class _LaggingWork:
    """A reduce's Work that reports itself unfinished until waited for: a link slower than the
    backward, every time."""

    def __init__(self, work) -> None:
        self._work = work
        self.waited = False

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None) -> bool:
        self.waited = True
        return self._work.wait()


def _check_reduce_buffers_are_bounded_when_the_link_lags(rank, world):
    ref = _Reversed()
    _train_reversed(DDP(ref), torch.optim.SGD(ref.parameters(), **SGD), rank, 3)
    model = _Reversed()
    optimizer = OSS(model.parameters(), torch.optim.SGD, **SGD)
    wrapped = ShardedDataParallel(model, optimizer, reduce_buffer_size=300)  # a bucket per tensor
    real_reduce = torch.distributed.reduce
    sent: list[_LaggingWork] = []  # reduces to other owners: their buffers live until waited for
    most_unwaited = 0

    def lagging_reduce(tensor, dst, *args, **kwargs):
        nonlocal most_unwaited
        work = _LaggingWork(real_reduce(tensor, dst, *args, **kwargs))
        if dst != rank:
            sent.append(work)
            most_unwaited = max(most_unwaited, sum(1 for w in sent if not w.waited))
        return work

    with unittest.mock.patch.object(torch.distributed, "reduce", lagging_reduce):
        _train_reversed(wrapped, optimizer, rank, 3)
    _assert_close(model, ref, "reduces that lag behind the backward")
    per_backward = len(sent) // 3
    # No send ever confirmed itself, yet when a bucket left at most MAX_SENDS_IN_FLIGHT earlier
    # ones were still held beside it (without the bound: every one of the backward's).
    bound = sharded._common.in_flight.MAX_SENDS_IN_FLIGHT + 1
    assert world == 1 or most_unwaited <= bound < per_backward, (most_unwaited, per_backward)


def _check_parameter_used_only_sometimes(rank, world):
    # used on rank 0 at steps 1 and 2 only: at step 1 its gradient arrives after its bucket
    # left (it was unused at step 0, so nothing waited for it); at step 2 it is expected
    sometimes_on = lambda step: rank == 0 and step in (1, 2)
    ref = _Reversed(sometimes=True)
    _train_reversed(DDP(ref, find_unused_parameters=True), torch.optim.SGD(ref.parameters(), **SGD), rank, 5, sometimes_on)
    model = _Reversed(sometimes=True)
    optimizer = OSS(model.parameters(), torch.optim.SGD, **SGD)
    wrapped = ShardedDataParallel(model, optimizer, reduce_buffer_size=600)
    stats = _train_reversed(wrapped, optimizer, rank, 5, sometimes_on)
    _assert_close(model, ref, "a parameter used on some steps and some ranks only")
    assert_same_on_all_ranks(list(model.parameters()), "replicas")
    if world > 1:
        assert stats[1].late_reduces >= 1, "the first use after an unused step is reduced late"
        assert stats[2].late_reduces == 0, "then it is expected"


@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_order_follows_the_real_backward_and_unused_parameters_do_not_stall_it(world_size):
    run_on_ranks(_check_reduce_order_and_unused, world_size)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parameter_used_on_some_steps_and_ranks_only_matches_ddp(world_size):
    run_on_ranks(_check_sometimes_used_and_lagging_link, world_size)


def _check_sometimes_used_and_lagging_link(rank, world):
    _check_parameter_used_only_sometimes(rank, world)
    _check_reduce_buffers_are_bounded_when_the_link_lags(rank, world)


# ------------------------------------------------------------- DDP's small first bucket


class _SendLog:
    """While entered: the gradients made ready on this rank (a hook on every parameter, run after
    the wrapper's), and per ``dist.reduce`` call how many were ready and how many elements it sent."""

    def __init__(self, params) -> None:
        self.ready = 0
        self.last: torch.Tensor | None = None  # the parameter whose gradient was ready last
        self.sends: list[tuple[int, int]] = []
        self._params = list(params)

    def __enter__(self) -> _SendLog:
        self._handles = [p.register_post_accumulate_grad_hook(self._on_ready) for p in self._params]
        self._reduce = torch.distributed.reduce

        def logging_reduce(tensor, *args, **kwargs):
            self.sends.append((self.ready, tensor.numel()))
            return self._reduce(tensor, *args, **kwargs)

        torch.distributed.reduce = logging_reduce
        return self

    def __exit__(self, *exc) -> None:
        torch.distributed.reduce = self._reduce
        for handle in self._handles:
            handle.remove()

    def _on_ready(self, param) -> None:
        self.ready += 1
        self.last = param


def _wide_stack() -> nn.Module:
    """16 layers of 256 KiB of parameters: one default bucket (2**23 elements) holds them all."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(16)))


def _wide_batch(rank, step):
    return torch.randn(4, 256, generator=torch.Generator().manual_seed(700 * step + rank))


def _check_first_bucket_is_small_and_leaves_early(rank, world):
    """With the default bucket size, the first reduce carries at most DDP's first bucket (1 MiB)
    and leaves while most gradients are still to come, eagerly and compiled (Dynamo's first
    piece is as small); the results stay DDP's (bit for bit at world 2: SGD, two summands)."""
    ref = _wide_stack()
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
    ddp = DDP(ref)
    runs = {}
    for how in ("eager", "compiled"):
        torch._dynamo.reset()
        model = _wide_stack()
        optimizer = OSS(model.parameters(), torch.optim.SGD, **SGD)
        wrapped = ShardedDataParallel(model if how == "eager" else torch.compile(model, backend="aot_eager"), optimizer)
        runs[how] = (model, wrapped, optimizer, [])
    for step in range(3):
        ref_opt.zero_grad()
        ddp(_wide_batch(rank, step)).pow(2).mean().backward()
        ref_opt.step()
        for model, wrapped, optimizer, logs in runs.values():
            optimizer.zero_grad()
            loss = wrapped(_wide_batch(rank, step)).pow(2).mean()
            with _SendLog(model.parameters()) as log:
                loss.backward()
            optimizer.step()
            logs.append(log)
    first_bucket_numel = FIRST_BUCKET_BYTES // 4 + 4  # + one 'used' flag per parameter in it
    for how, (model, _, _, logs) in runs.items():
        if world == 2:
            for a, b in zip(model.parameters(), ref.parameters()):
                assert torch.equal(a, b), f"{how}: not bit-identical to DDP"
        _assert_close(model, ref, how)
        assert_same_on_all_ranks(list(model.parameters()), how)
        for step, log in enumerate(logs):
            (ready_at_first, first_numel), total = log.sends[0], log.ready
            what = f"rank {rank}, {how}, step {step}: first reduce after {ready_at_first} of {total} gradients"
            assert first_numel <= first_bucket_numel, f"{what}, {first_numel} elements"
            # eager: within the last 4 of 16 layers' gradients; compiled: when the first piece (the
            # last 4 layers, whose hooks all fire as it ends) is done. Without the small first
            # bucket, with the last gradient of its owner's half of the model.
            assert total - ready_at_first >= total // 2, what


@pytest.mark.parametrize("world_size", [2, 3])
def test_first_bucket_is_small_and_leaves_early_in_backward_eager_and_compiled(world_size):
    run_on_ranks(_check_first_bucket_is_small_and_leaves_early, world_size, timeout=240)


def _check_overlap_bytes_follow_the_plan(rank, world):
    """``backward_stats.overlap_bytes`` is exactly the plan's gradient bytes, each weighted by
    the share of gradients still to come when its bucket's reduce was called, over all bytes:
    with the default bucket a small first bucket leaves early but the rest of the model leaves
    late, so the figure stays low whatever the time-based ``overlap`` says; with each gradient
    alone it is near 1/2. Eager and compiled (the last piece's hooks fire together)."""
    cases = {"default bucket, eager": (2**23, False), "default bucket, compiled": (2**23, True),
             "each gradient alone, eager": (0, False)}
    for what, (bucket, compiled) in cases.items():
        torch._dynamo.reset()
        model = _wide_stack()
        optimizer = OSS(model.parameters(), torch.optim.SGD, **SGD)
        module = torch.compile(model, backend="aot_eager") if compiled else model
        wrapped = ShardedDataParallel(module, optimizer, reduce_buffer_size=bucket)
        for step in range(2):  # the first backward teaches the plan the real order
            optimizer.zero_grad()
            loss = wrapped(_wide_batch(rank, step)).pow(2).mean()
            with _SendLog(model.parameters()) as log:
                loss.backward()
            optimizer.step()
        stats, buckets = wrapped.backward_stats, wrapped._router.buckets
        n, total = log.ready, sum(p.numel() * p.element_size() for p in model.parameters())
        assert len(log.sends) == len(buckets), what  # one reduce per bucket, in plan order
        # the log's hook runs after the wrapper's: a send from the k-th gradient's hook sees k - 1
        hidden = sum(b.numel * 4 * max(0, n - ready - 1) for b, (ready, _) in zip(buckets, log.sends))
        expected = hidden / (total * n)
        what = f"rank {rank}, {what}: {stats}, expected overlap_bytes {expected}"
        assert stats.overlap_bytes == pytest.approx(expected, rel=1e-12, abs=0), what
        if bucket:  # most bytes leave late: the figure says so where overlap does not
            assert buckets[0].numel * 4 <= FIRST_BUCKET_BYTES and stats.overlap_bytes < 0.5, what
        else:
            assert 0.4 < stats.overlap_bytes < 0.6, what


@pytest.mark.parametrize("world_size", [2, 3])
def test_overlap_bytes_weights_each_buckets_bytes_by_the_backward_left_to_hide_them(world_size):
    run_on_ranks(_check_overlap_bytes_follow_the_plan, world_size, timeout=240)
