"""Resume is exact: k steps, save, stop, resume, n steps equals n uninterrupted steps, bit for bit.

One launch trains every case straight through n steps and, separately, k steps then saves; a
second launch (fresh processes: the job stopped) resumes from the checkpoint and trains to n.
Parameters, optimizer state and the loss scale must then be identical to the uninterrupted run's
at the same world size; the batches of a step depend only on (rank, step), so the data order is
the same. The AMP case runs fp16 with ``ShardedGradScaler`` and makes one rank's gradient
overflow once before the checkpoint and once after: every rank must skip those steps and back
the scale off together, and the resumed scaler must carry on from the saved scale.

At world 3 the communication layouts are pinned. A sum of three ranks' gradients depends on the
order the collective adds them in, which gloo picks by an element's offset in its message; DDP
re-buckets after its first backward and ShardedDataParallel re-plans its buckets from the first
backward's ready order, so a resumed process's first step sums some elements in another order
than the uninterrupted run did at that step, and Adam turns that rounding into ~1e-4 by the end
(measured). DDP with ``find_unused_parameters=True`` never re-buckets and ``reduce_buffer_size=0``
reduces each gradient alone, in its own message, so every sum, and the resume, is exact. At
worlds 1 and 2 a sum has at most two terms and is exact whatever the order: default layouts.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, ShardedDataParallel, ShardedGradScaler, checkpoint
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt, gpt_loss, token_batch
from tests.test_checkpoint_resharding import assert_full_equal
from tests.test_oss import _two_groups

TOTAL_STEPS, SAVED_AT = 6, 3
OVERFLOW_STEPS = (1, 4)  # the last rank's head gradient is inf: before and after the checkpoint
INITIAL_SCALE = 2.0**10
CASES = {  # name: (layer, mixed precision)
    "ddp": ("ddp", False),
    "zero1": ("zero1", False),
    "zero2": ("zero2", False),
    "zero2-fp16": ("zero2", True),
}


class Run:
    """One training job of a case: model, optimizer and scaler, built fresh."""

    def __init__(self, case, world, seed=0):
        layer, self.amp = CASES[case]
        self.model = gpt(seed)
        groups = _two_groups(self.model)
        if layer == "ddp":
            self.optimizer = torch.optim.AdamW(groups, lr=1e-2)
        else:
            self.optimizer = OSS(groups, torch.optim.AdamW, lr=1e-2)
        pinned = world >= 3  # fixed communication layouts: see the module docstring
        if layer == "zero2":
            self.wrapped = ShardedDataParallel(self.model, self.optimizer, reduce_buffer_size=0 if pinned else 2**23)
        else:
            self.wrapped = DDP(self.model, find_unused_parameters=pinned)
        self.scaler = ShardedGradScaler(init_scale=INITIAL_SCALE, growth_interval=2, device="cpu", enabled=self.amp)

    def train(self, rank, world, steps, first=0):
        for step in range(first, first + steps):
            self.optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16) if self.amp else contextlib.nullcontext():
                loss = gpt_loss(self.wrapped, token_batch(rank, step))
            overflow = self.amp and step in OVERFLOW_STEPS and rank == world - 1
            hook = self.model.head.weight.register_hook(lambda g: torch.full_like(g, float("inf"))) if overflow else None
            self.scaler.scale(loss).backward()
            if hook is not None:
                hook.remove()
            self.scaler.step(self.optimizer)
            self.scaler.update()

    def state(self, step):
        state = checkpoint.get_state_dict(self.wrapped, self.optimizer)
        state["scaler"] = self.scaler.state_dict()
        state["step"] = step
        return state


def _train_straight_and_save_midway(rank, world, root):
    for case in CASES:
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


def _resume_and_finish(rank, world, root):
    for case in CASES:
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
        assert_same_on_all_ranks(list(resumed.model.parameters()), what)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, world_size):
    run_on_ranks(_train_straight_and_save_midway, world_size, tmp_path, timeout=180)
    run_on_ranks(_resume_and_finish, world_size, tmp_path, timeout=180)
