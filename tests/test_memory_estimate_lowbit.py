"""estimate_memory(lowbit=...): what each stage's low-bit policy holds beyond the exact stage
(the ZeRO-1 owners' masters, the ZeRO-2 and ZeRO-3 error-feedback residuals), the bytes it
sends, and the refusals, on meta-device models in one process; the estimate against measured
peaks is in test_memory_estimate_lowbit_measured.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharded import LowBit, estimate_memory

STEP = "optimizer step"


def _linears(*widths: int) -> nn.Module:
    """Square bias-free linears: each parameter's element count is ``width ** 2``."""
    with torch.device("meta"):
        return nn.Sequential(*[nn.Linear(w, w, bias=False) for w in widths])


def _estimate(model: nn.Module, stage: int, world: int, lowbit=None, **options):
    return estimate_memory(model, world_size=world, stage=stage, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                           wrap={nn.Linear}, runtime_bytes=0, lowbit=lowbit, **options)


def test_zero1_owner_holds_a_master_of_what_it_owns_and_sets_the_replicas_aside_in_the_step():
    model = _linears(512, 512, 256)  # world 2: one rank owns a 512x512 weight, the other the rest
    exact = _estimate(model, 1, 2)
    low = _estimate(model, 1, 2, LowBit(params="int8"))
    owned = 4 * (512 * 512 + 256 * 256)  # the busiest rank's bytes, its masters
    assert low.phases["backward"] - exact.phases["backward"] == owned
    assert low.phases[STEP] - exact.phases[STEP] == 2 * owned  # the masters and the replicas set aside
    # after the step the owner's changes travel as float32 and then int8 messages: more than nothing
    assert low.phases["broadcast"] > low.phases[STEP] - low.optimizer_step
    # one rank: the changes still go through the codec, so the masters are kept
    assert _estimate(model, 1, 1, LowBit(params="int8")).phases["backward"] - _estimate(model, 1, 1).phases["backward"] == 4 * (
        2 * 512 * 512 + 256 * 256)


def test_zero2_error_feedback_keeps_a_float32_residual_of_every_bucket_on_every_rank():
    model = _linears(512, 512, 256)
    n = 2 * 512 * 512 + 256 * 256
    exact = _estimate(model, 2, 2)
    with_feedback = _estimate(model, 2, 2, LowBit(grads="int8"))
    without = _estimate(model, 2, 2, LowBit(grads="int8", error_feedback=False))
    assert with_feedback.phases[STEP] - exact.phases[STEP] == 4 * n
    assert without.phases[STEP] == exact.phases[STEP]
    # in backward too, beside a larger encode (it adds the residual and keeps the new one)
    assert with_feedback.phases["backward"] - without.phases["backward"] >= 4 * n
    assert without.phases["backward"] > exact.phases["backward"]  # messages and their encoding
    # one rank reduces nothing, low-bit or not
    assert _estimate(model, 2, 1, LowBit(grads="int8")) == _estimate(model, 2, 1)
    # a bucket below min_numel travels exact and keeps no residual
    assert _estimate(model, 2, 2, LowBit(grads="int8", min_numel=10**7)).phases[STEP] == exact.phases[STEP]


def test_zero3_error_feedback_keeps_every_row_a_rank_sends_in_float32():
    model = _linears(512, 256)
    world, block = 2, 256
    low = _estimate(model, 3, world, LowBit(grads="int8", block_size=block))
    without = _estimate(model, 3, world, LowBit(grads="int8", block_size=block, error_feedback=False))
    # each unit's row: its shard (the rows divide evenly, a multiple of the block), then the
    # sentinel alone in the gap before the block of 'used' flags, then one flag; the root has none
    rows = [512 * 512 // world + 1 + 1, 256 * 256 // world + 1 + 1]
    assert low.phases[STEP] - without.phases[STEP] == sum(4 * world * r for r in rows)
    assert low.phases["backward"] - without.phases["backward"] >= sum(4 * world * r for r in rows)
    params_only = _estimate(model, 3, world, LowBit(params="int8"))
    assert params_only.phases[STEP] == _estimate(model, 3, world).phases[STEP]  # the gathers keep nothing


def test_bytes_sent_count_the_codecs_messages():
    model = _linears(512, 512)
    n, world = 512 * 512, 2
    int8 = n + 4 * n // 256  # one byte per element, a float32 scale per block of 256
    int4 = n // 2 + 4 * n // 256
    exact = _estimate(model, 2, world)
    assert exact.bytes_sent == 2 * (world - 1) * 2 * 4 * n // world
    # ZeRO-2, one bucket per weight (world 2: each rank owns one): each rank sends the other's,
    # its message and its one exact 'used' flag
    for fmt, message in (("int8", int8), ("int4", int4)):
        low = _estimate(model, 2, world, LowBit(grads=fmt))
        assert low.bytes_sent == 4 * n + (2 * (message + 4)) // world
    # ZeRO-1: the owners broadcast the weights' changes (one bucket each) as messages
    assert _estimate(model, 1, world, LowBit(params="int8")).bytes_sent == 4 * n + 2 * int8 // world
    # ZeRO-3 (units: each linear, and the root, which holds nothing): each weight gathered in
    # forward and backward, its shard's message once to the other rank, and its gradient row's
    shard = n // world
    row_blocks = -(-(shard + 2) // 256)  # the row: the shard, the sentinel, the flag, in whole blocks
    row_message = row_blocks * (256 + 4)
    shard_message = shard + 4 * shard // 256
    low3 = _estimate(model, 3, world, LowBit(params="int8", grads="int8"))
    assert low3.bytes_sent == 2 * (2 * shard_message + row_message)


@pytest.mark.parametrize("stage, policy, words", [
    (0, LowBit(params="int8"), "stage 0"),
    (1, LowBit(grads="int8"), "grads"),
    (1, LowBit(params="int8", grads="int8"), "grads"),
    (2, LowBit(params="int8"), "params"),
    (1, LowBit(params="int8", error_feedback=False), "error_feedback=False"),
    (3, LowBit(params="int8", error_feedback=False), "error_feedback=False"),
    (3, LowBit(), "sends nothing"),
])
def test_what_the_stage_refuses_is_refused_naming_the_option(stage, policy, words):
    with pytest.raises(ValueError, match="lowbit") as raised:
        _estimate(_linears(64), stage, 2, policy)
    assert words in str(raised.value)


def test_a_policy_that_is_not_a_lowbit_is_refused():
    with pytest.raises(TypeError, match="lowbit"):
        _estimate(_linears(64), 2, 2, "int8")
