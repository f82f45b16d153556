"""ZeRO-2 with fp16 loss scaling and accumulation: a step the scaler skips, then ``zero_grad()``
and a ``no_sync()`` micro-batch, must train on as DDP does (it used to raise "backward ran again
after the gradients were reduced": the no_sync pass refilled the gradients before the check
that zero_grad() had cleared them).

Tolerance: SGD on the same fp16 gradients; only the order of float32 additions differs from
DDP's, so test_oss's ``ATOL``/``RTOL``.
"""

from __future__ import annotations

import contextlib

import torch

from sharded import ShardedGradScaler
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt_loss, token_batch
from tests.test_oss import _assert_close
from tests.test_sharded_ddp import _pair

INIT_SCALE = 2.0**24  # overflows fp16 gradients: the first steps are skipped
STEPS = 5


def _check_accumulation_across_skipped_steps(rank, world, **sdp_kwargs):
    ref, ref_opt, ours, our_opt = _pair(**sdp_kwargs)
    scalers = {id(ref): torch.amp.GradScaler("cpu", init_scale=INIT_SCALE),
               id(ours): ShardedGradScaler(init_scale=INIT_SCALE, device="cpu")}
    for step in range(STEPS):
        for model, opt in ((ref, ref_opt), (ours, our_opt)):
            scaler = scalers[id(model)]
            opt.zero_grad()
            for micro in range(2):
                with model.no_sync() if micro == 0 else contextlib.nullcontext():
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = gpt_loss(model, token_batch(rank, 2 * step + micro)) / 2
                    scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    skipped = scalers[id(ref)].get_scale() < INIT_SCALE
    assert skipped and scalers[id(ours)].get_scale() == scalers[id(ref)].get_scale()
    assert_same_on_all_ranks(list(ours.parameters()), "replicas after skipped steps")
    _assert_close(ours.module, ref.module, "accumulation across skipped fp16 steps")


def test_no_sync_accumulation_after_a_skipped_step_matches_ddp():
    run_on_ranks(_check_accumulation_across_skipped_steps, 2)  # one rank has no reduce to consume
