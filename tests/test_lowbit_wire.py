"""The low-bit collectives at worlds 1-3: every rank receives exactly what decoding the messages
locally gives (the wire adds nothing but the codec's rounding), sums in rank order, byte counts,
fallbacks counted or raised, and shadow checks that measure the error they report."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from sharded._common.lowbit import LowBit, LowBitWire, codec_for
from tests._harness import run_on_ranks

N = 4096 * 3  # divisible by 1, 2, 3 and by the block size


def _data(rank: int, n: int = N, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(n, generator=g) * (rank + 1)


def _collectives(rank: int, world: int) -> None:
    checks = []
    wire = LowBitWire(LowBit(params="int8", grads="int4", block_size=128, check_every=2, on_check=checks.append), None)
    p, g = codec_for("int8"), codec_for("int4")
    block = 128

    # all-gather: every rank's piece decoded, own piece included
    shard = _data(rank, N // world)
    gathered = wire.all_gather(p, shard).wait()
    expect = torch.cat([p.decode(p.encode(_data(r, N // world), block), N // world, block) for r in range(world)])
    assert torch.equal(gathered, expect)

    # broadcast from the last rank: every rank (the source too) holds the decoded values
    x = _data(world - 1) if rank == world - 1 else torch.empty(N)
    got = wire.broadcast(p, x, world - 1).wait()
    assert torch.equal(got, p.decode(p.encode(_data(world - 1), block), N, block))

    # reduce-scatter: chunk `rank` of every rank's input, each decoded, summed in rank order
    flat = _data(rank, N, seed=1)
    mine = wire.reduce_scatter(g, "unit", flat).wait()
    n = N // world
    expect = torch.zeros(n)
    for r in range(world):
        expect += g.decode(g.encode(_data(r, N, seed=1)[rank * n:(rank + 1) * n], block), n, block)
    assert torch.equal(mine, expect)
    exact = sum(_data(r, N, seed=1)[rank * n:(rank + 1) * n] for r in range(world))
    bound = sum(g.error_bound(_data(r, N, seed=1)[rank * n:(rank + 1) * n], block) for r in range(world))
    assert bool(((mine - exact).abs() <= bound + 1e-5).all())

    # reduce to rank 0
    total = wire.reduce(g, "bucket0", _data(rank, N, seed=2), 0).wait()
    if rank == 0:
        expect = torch.zeros(N)
        for r in range(world):
            expect += g.decode(g.encode(_data(r, N, seed=2), block), N, block)
        assert torch.equal(total, expect)
    else:
        assert total is None

    step = wire.end_step()
    # bytes: int8 all-gather piece (W-1 copies), broadcast from the last rank, int4 all-to-all, reduce
    piece = p.message_numel(N // world, block)
    assert step.sent["all_gather"] == piece * (world - 1)
    assert step.exact["all_gather"] == (N // world) * 4 * (world - 1)
    assert step.sent.get("broadcast", 0) == (p.message_numel(N, block) * (world - 1) if rank == world - 1 else 0)
    assert step.sent["reduce_scatter"] == g.message_numel(n, block) * (world - 1)
    assert step.sent["reduce"] == (0 if rank == 0 else g.message_numel(N, block))
    assert step.sent_bytes < step.exact_bytes / 3 or world == 1

    # step 0 was a shadow step: one check per collective, errors as measured above
    by_name = {c.collective: c for c in checks}
    assert set(by_name) == {"all_gather", "broadcast", "reduce_scatter"} | ({"reduce"} if rank == 0 else set())
    rel = float((mine - exact).norm() / exact.norm())
    assert by_name["reduce_scatter"].relative_error == pytest.approx(rel, rel=1e-4)
    assert by_name["all_gather"].divergence == by_name["all_gather"].relative_error > 0
    assert 0 < by_name["broadcast"].relative_error < 0.01  # int8: scale/2 of a Gaussian block's max

    # step 1 is not a shadow step: nothing reported
    checks.clear()
    wire.all_gather(p, shard).wait()
    wire.end_step()
    assert checks == []
    dist.barrier()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_collectives_deliver_the_decoded_messages(world):
    run_on_ranks(_collectives, world)


def _fallbacks(rank: int, world: int, caplog_level: int) -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logging.getLogger("sharded.lowbit").addHandler(Keep())
    wire = LowBitWire(LowBit(grads="int8", min_numel=100), None)
    assert wire.codec("grads", "reduce", "bucket 0", torch.zeros(10)) is None
    assert wire.codec("grads", "reduce", "bucket 1", torch.zeros(10, dtype=torch.int64)) is None
    assert wire.codec("grads", "reduce", "bucket 2", torch.zeros(1000)) is not None
    assert wire.codec("params", "all_gather", "unit", torch.zeros(1000)) is None  # left exact: no fallback
    wire.end_step()
    assert len(records) == 1 and "2 of 3 messages" in records[0].getMessage() and "below 100 elements" in records[0].getMessage()
    wire.codec("grads", "reduce", "bucket 0", torch.zeros(10))
    wire.end_step()
    assert len(records) == 1, "reported once"

    strict = LowBitWire(LowBit(grads="int8", min_numel=100, fallback="raise"), None)
    with pytest.raises(ValueError, match=rf"rank {rank}: low-bit reduce cannot send bucket 0: below 100 elements"):
        strict.codec("grads", "reduce", "bucket 0", torch.zeros(10))


def test_fallbacks_are_counted_once_or_raised():
    run_on_ranks(_fallbacks, 2, logging.WARNING)
