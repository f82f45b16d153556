"""The low-bit codecs keep their stated bounds, and error feedback keeps the sum of what was sent
within one step's rounding of the sum meant (no process group)."""

from __future__ import annotations

import pytest
import torch

from sharded._common.lowbit import FORMATS, ErrorFeedback, LowBit, codec_for


def _values(n: int) -> torch.Tensor:
    """Magnitudes over six decades, signs mixed, exact zeros and a block of tiny values."""
    torch.manual_seed(0)
    x = torch.randn(n) * torch.logspace(-3, 3, n)
    x[::17] = 0.0
    x[:64] = x[:64] * 1e-30
    return x


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_element_within_its_bound(name, dtype):
    codec = codec_for(name)
    for n, block in ((1, 2), (255, 64), (1000, 256), (4096, 128)):
        x = _values(n).clamp(-6e4, 6e4).to(dtype)
        message = codec.encode(x, block)
        assert message.dtype == torch.uint8 and message.numel() == codec.message_numel(n, block)
        out = torch.empty(n, dtype=torch.float32)
        decoded = codec.decode(message, n, block, out)
        error = (decoded - x.float()).abs()
        bound = codec.error_bound(x, block)
        assert bool((error <= bound).all()), f"{name} n={n}: worst {float((error - bound).max())} over"
        assert bool((decoded[x == 0] == 0).all()), "zero is exact"
        # the bound is tight: some element comes within a quarter of it (a bound ten times too loose fails)
        if n > 100:
            assert float((error / bound.clamp_min(1e-38)).max()) > 0.25


def test_bytes_per_element():
    assert codec_for("int8").message_numel(4096, 256) == 4096 + 16 * 4
    assert codec_for("int4").message_numel(4096, 256) == 2048 + 16 * 4
    assert codec_for("fp8_e4m3").message_numel(1000, 256) == 1024 + 4 * 4  # padded to whole blocks


def test_non_finite_block_arrives_as_nan_and_other_blocks_are_untouched():
    for name in FORMATS:
        codec = codec_for(name)
        x = torch.tensor([1.0, float("inf"), 2.0, 3.0, -1.0, float("nan"), 4.0, 4.0])
        decoded = codec.decode(codec.encode(x, 4), 8, 4)
        assert bool(decoded[:4].isnan().all()) and bool(decoded[4:].isnan().all())
        y = torch.tensor([1.0, float("inf"), 2.0, 3.0, -1.0, 0.5, 4.0, 4.0])
        decoded = codec.decode(codec.encode(y, 4), 8, 4)
        assert bool(decoded[:4].isnan().all()) and bool(decoded[4:].isfinite().all())


def test_int4_packs_two_values_per_byte_exactly_on_its_grid():
    codec = codec_for("int4")
    x = torch.arange(-7, 8, dtype=torch.float32).repeat(2)[:30]  # scale 1: every level exact
    x[0] = -7.0
    assert torch.equal(codec.decode(codec.encode(x, 30), 30, 30), x)


def test_error_feedback_keeps_the_running_sum_within_one_rounding():
    codec, block = codec_for("int4"), 64
    torch.manual_seed(1)
    steps = [torch.randn(256) * 0.01 + 0.5 * (torch.arange(256) == 0).float() for _ in range(50)]
    feedback = ErrorFeedback()
    sent_with = torch.zeros(256)
    sent_without = torch.zeros(256)
    for g in steps:
        last_meant = g + feedback.state_dict().get("bucket", torch.zeros(256))
        sent_with += codec.decode(feedback.encode("bucket", g, codec, block), 256, block)
        sent_without += codec.decode(codec.encode(g, block), 256, block)
    meant = torch.stack(steps).sum(0)
    one_rounding = codec.error_bound(last_meant, block)  # what the last message may round
    assert torch.allclose(meant - sent_with, feedback.state_dict()["bucket"], atol=1e-5)  # the residual telescopes
    assert bool(((meant - sent_with).abs() <= one_rounding + 1e-5).all())
    # without feedback the small values next to a large one round to zero every step: they are lost
    assert float((meant - sent_without).abs().max()) > 5 * float(one_rounding.max())


def test_error_feedback_state_round_trips_and_drops_a_misfit():
    codec = codec_for("int8")
    feedback = ErrorFeedback()
    feedback.encode("a", torch.randn(300), codec, 64)
    state = feedback.state_dict()
    other = ErrorFeedback()
    other.load_state_dict(state)
    assert torch.equal(other.state_dict()["a"], state["a"])
    x = torch.randn(300)
    assert torch.equal(other.encode("a", x, codec, 64), feedback.encode("a", x, codec, 64))
    other.encode("a", torch.randn(10), codec, 64)  # rebuilt with another size: residual dropped, not added
    assert other.state_dict()["a"].numel() == 10


def test_policy_validates_and_names_modes():
    assert LowBit.mode("int8") == LowBit(params="int8", grads="int8")
    assert LowBit.mode("int4-grads", check_every=10) == LowBit(grads="int4", check_every=10)
    for bad in (dict(params="int4"), dict(grads="int3"), dict(block_size=3), dict(fallback="ignore"),
                dict(check_every=0), dict(min_numel=-1)):
        with pytest.raises(ValueError, match="LowBit"):
            LowBit(**bad)
    with pytest.raises(ValueError, match="unknown low-bit mode"):
        LowBit.mode("int2")
