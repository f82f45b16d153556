"""Resume is exact: k steps, save, stop, resume, n steps equals n uninterrupted steps, bit for bit.

One launch trains every case straight through n steps and, separately, k steps then saves; a
second launch (fresh processes: the job stopped) resumes from the checkpoint and trains to n.
Parameters, optimizer state and the loss scale must then be identical to the uninterrupted run's
at the same world size; the batches of a step depend only on (rank, step), so the data order is
the same. The AMP cases run fp16 with ``ShardedGradScaler`` and poison one row of the last rank's
head gradient before it is reduced, with an inf before the checkpoint and a NaN after it: after
the reduce only the rank holding that row sees it (with ZeRO-2, head's owner; with ZeRO-3, rank
0, whose shard starts at row 0), yet every rank must skip those steps and back the scale off
together, and the resumed scaler must carry on from the saved scale.

At world 3 the communication layouts are pinned. A sum of three ranks' gradients depends on the
order the collective adds them in, which gloo picks by an element's offset in its message; DDP
re-buckets after its first backward and ShardedDataParallel re-plans its buckets from the first
backward's ready order, so a resumed process's first step sums some elements in another order
than the uninterrupted run did at that step, and Adam turns that rounding into ~1e-4 by the end
(measured). DDP with ``find_unused_parameters=True`` never re-buckets and ``reduce_buffer_size=0``
reduces each gradient alone, in its own message, so every sum, and the resume, is exact.
ZeRO-3 reduce-scatters each unit's gradients in a layout fixed when it was sharded, so its
resume is exact with the default settings. At worlds 1 and 2 a sum has at most two terms and is
exact whatever the order: default layouts.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, ShardedDataParallel, ShardedGradScaler, checkpoint, fully_shard
from tests._device import DEVICE_AGNOSTIC, LAYER3_OVER_GLOO_ON_CUDA, collective_device, device_type_under_test, skip_gloo_on_cuda
from tests._fsdp_reference import full_tensors
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt, gpt_loss, token_batch
from tests.test_checkpoint_resharding import assert_full_equal
from tests.test_oss import _two_groups

pytestmark = DEVICE_AGNOSTIC

TOTAL_STEPS, SAVED_AT = 6, 3
POISONED_STEPS = {1: float("inf"), 4: float("nan")}  # a row of the last rank's head gradient: before and after the checkpoint
INITIAL_SCALE = 2.0**10
CASES = {  # name: (layer, mixed precision)
    "ddp": ("ddp", False),
    "zero1": ("zero1", False),
    "zero2": ("zero2", False),
    "zero2-fp16": ("zero2", True),
    "zero3": ("zero3", False),
    "zero3-fp16": ("zero3", True),
}
REPLICATED, SHARDED = [c for c, (layer, _) in CASES.items() if layer != "zero3"], [c for c, (layer, _) in CASES.items() if layer == "zero3"]


class Run:
    """One training job of a case: model, optimizer and scaler, built fresh."""

    def __init__(self, case, world, seed=0):
        layer, self.amp = CASES[case]
        self.model = gpt(seed)
        if layer == "zero3":
            for block in self.model.blocks:
                fully_shard(block)
            self.wrapped = fully_shard(self.model)
        groups = _two_groups(self.model)
        if layer in ("ddp", "zero3"):
            self.optimizer = torch.optim.AdamW(groups, lr=1e-2)
        else:
            self.optimizer = OSS(groups, torch.optim.AdamW, lr=1e-2)
        pinned = world >= 3  # fixed communication layouts: see the module docstring
        if layer == "zero2":
            self.wrapped = ShardedDataParallel(self.model, self.optimizer, reduce_buffer_size=0 if pinned else 2**23)
        elif layer != "zero3":
            self.wrapped = DDP(self.model, find_unused_parameters=pinned)
        self.device = device_type_under_test()
        self.scaler = ShardedGradScaler(init_scale=INITIAL_SCALE, growth_interval=2, device=self.device, enabled=self.amp)

    def train(self, rank, world, steps, first=0):
        for step in range(first, first + steps):
            self.optimizer.zero_grad()
            poisoned = self.amp and step in POISONED_STEPS and rank == world - 1
            with _poisoned_head_gradient(self.model, POISONED_STEPS[step]) if poisoned else contextlib.nullcontext():
                with torch.autocast(self.device, dtype=torch.float16) if self.amp else contextlib.nullcontext():
                    loss = gpt_loss(self.wrapped, token_batch(rank, step))
                self.scaler.scale(loss).backward()
            if self.amp and step in POISONED_STEPS:
                self._step_and_check_every_rank_skipped(world)
            else:
                self.scaler.step(self.optimizer)
            self.scaler.update()

    def _step_and_check_every_rank_skipped(self, world):
        """After a poisoned backward exactly one rank's gradient shard holds the inf/NaN (with a
        single rank, that one); the step must still leave every rank's parameters untouched."""
        local = [_local(p) for p in self.model.parameters()]
        seen = any(not torch.isfinite(_local(p.grad)).all() for p in self.model.parameters() if p.grad is not None)
        seeing = torch.tensor(int(seen), device=collective_device())
        torch.distributed.all_reduce(seeing)
        assert seeing.item() == 1, f"{seeing.item()} ranks see the poisoned gradient, 1 should"
        before = [t.clone() for t in local]
        self.scaler.step(self.optimizer)
        assert all(torch.equal(a, b) for a, b in zip(before, local)), "a rank stepped although a shard overflowed"

    def state(self, step):
        state = checkpoint.get_state_dict(self.wrapped, self.optimizer)
        state["scaler"] = self.scaler.state_dict()
        state["step"] = step
        return state


def _local(tensor):
    """This rank's part of ``tensor``: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@contextlib.contextmanager
def _poisoned_head_gradient(model, value):
    """Inside, row 0 of the gradient of the head weight that the forward uses (the gathered one
    under ZeRO-3) is set to ``value`` on this rank, before any reduce sees it."""
    hooks = []

    def poison(grad):
        grad = grad.clone()
        grad[0] = value
        return grad

    pre_hook = model.head.register_forward_pre_hook(lambda module, args: hooks.append(module.weight.register_hook(poison)))
    try:
        yield
    finally:
        pre_hook.remove()
        for hook in hooks:
            hook.remove()


def _train_straight_and_save_midway(rank, world, root, cases):
    for case in cases:
        straight = Run(case, world)
        straight.train(rank, world, TOTAL_STEPS)
        full = checkpoint.get_state_dict(straight.wrapped, straight.optimizer, full=True)
        if rank == 0:
            torch.save({**full, "scale": straight.scaler.get_scale()}, root / f"{case}-straight.pt")
        interrupted = Run(case, world)
        interrupted.train(rank, world, SAVED_AT)
        if interrupted.amp:
            assert interrupted.scaler.get_scale() == INITIAL_SCALE / 2, "every rank backs off at the overflow"
        checkpoint.save(interrupted.state(SAVED_AT), root / case / f"step-{SAVED_AT}")


def _resume_and_finish(rank, world, root, cases):
    for case in cases:
        resumed = Run(case, world, seed=1)  # other weights: loading must replace them
        state = resumed.state(step=0)
        checkpoint.load(state, checkpoint.latest_checkpoint(root / case))
        checkpoint.set_state_dict(resumed.wrapped, resumed.optimizer, state)
        resumed.scaler.load_state_dict(state["scaler"])
        assert state["step"] == SAVED_AT
        resumed.train(rank, world, TOTAL_STEPS - SAVED_AT, first=SAVED_AT)
        straight = torch.load(root / f"{case}-straight.pt", weights_only=True) if rank == 0 else {}
        full = checkpoint.get_state_dict(resumed.wrapped, resumed.optimizer, full=True)
        what = f"{case} resumed at world {world}"
        assert_full_equal(full, {k: v for k, v in straight.items() if k != "scale"}, what)
        scale = torch.tensor([resumed.scaler.get_scale() if resumed.amp else 1.0])
        assert_same_on_all_ranks([scale], f"{what}: loss scale")
        if rank == 0 and resumed.amp:
            assert scale.item() == straight["scale"], f"{what}: scale {scale.item()} != {straight['scale']}"
        assert_same_on_all_ranks(full_tensors(resumed.model.parameters()), what)


@pytest.mark.parametrize("world_size, cases", [
    pytest.param(world, cases, id=f"{world}-{name}", marks=skip_gloo_on_cuda(world, LAYER3_OVER_GLOO_ON_CUDA) if cases is SHARDED else ())
    for world in (1, 2, 3) for name, cases in (("replicated", REPLICATED), ("zero3", SHARDED))
])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, world_size, cases):
    run_on_ranks(_train_straight_and_save_midway, world_size, tmp_path, cases, timeout=180)
    run_on_ranks(_resume_and_finish, world_size, tmp_path, cases, timeout=180)
