"""What each rank holds with fully_shard, in bytes: at rest about 1/N of parameters, gradients
and optimizer state; between forward and backward and during backward only the units that the
prefetch allows."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPT
from sharded._common import comm
from sharded._common.in_flight import MAX_REDUCTIONS_IN_FLIGHT
from sharded.fsdp._state import state_of
from sharded.fsdp._unit import ShardState, TrainingState, units_under
from tests._device import cpu_only
from tests._fsdp_reference import local_bytes, shard_gpt
from tests._harness import run_on_ranks
from tests._models import gpt_loss, token_batch

pytestmark = cpu_only("measures host memory and gloo's CPU buffers (VmHWM, malloc)")


def _storage(unit):
    """The flat buffers of a unit with plain parameters only (every unit of these models)."""
    (storage,) = unit.gathers
    return storage


def _watch_gathered(units):
    """Record, after every unit's all-gather completes, how many units hold gathered memory and
    how many bytes of gathered parameters exist."""
    seen = []
    for unit in units:
        finish = unit.wait_for_unshard

        def recorded(finish=finish):
            finish()
            held = sum(u.shard_state is not ShardState.SHARDED for u in units)
            seen.append((held, sum(_storage(u).unsharded_bytes() for u in units)))

        unit.wait_for_unshard = recorded
    return seen


def _watch_backward_gathers(units):
    """Record, as each all-gather starts during backward, the unit, whether it is a prefetch
    (the unit's own backward has not begun) and which other units still have a gather in
    flight."""
    started = []
    for unit in units:
        start = unit._start_gather

        def recorded(unit=unit, start=start):
            if unit.context.in_backward:
                in_flight = [u for u in units if u is not unit and u.shard_state is ShardState.GATHERING]
                started.append((unit, unit.training_state is not TrainingState.PRE_BACKWARD, in_flight))
            start()

        unit._start_gather = recorded
    return started


def _watch_reductions(units):
    """Check, as each unit starts its reduction, that it already freed its gathered parameters
    and that the reductions in flight leave room for it; once started, that its full gradients
    are gone and no reduction in flight keeps a send buffer gloo has already copied."""
    started = []
    for unit in units:
        start = unit.reducer.start

        def checked(params, grads, *args, unit=unit, start=start):
            in_flight = state_of(unit.module).root._reductions
            assert len(in_flight) < MAX_REDUCTIONS_IN_FLIGHT, f"{len(in_flight)} reductions in flight as {unit} packs"
            assert _storage(unit).unsharded_bytes() == 0, f"{unit} still gathered as it packs its gradients"
            reduction = start(params, grads, *args)
            assert grads == [], f"{unit} kept its full gradients past packing"
            scatters = [part._scatter for r in [*in_flight, reduction] for part in r.parts]
            assert all(s.sent is None for s in scatters), "a send buffer outlived its copy"
            started.append(unit)
            return reduction

        unit.reducer.start = checked
    return started


def _check_memory(rank, world):
    torch.manual_seed(0)
    model = shard_gpt(GPT(vocab=128, dim=64, layers=4, heads=4, seq=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    units = units_under(model)
    root = units[0]
    during = _watch_gathered(units)
    reduced = _watch_reductions(units)
    backward_gathers = _watch_backward_gathers(units)
    for step in range(2):
        optimizer.zero_grad()
        loss = gpt_loss(model, token_batch(rank, step, vocab=128))
        gathered = [u for u in units if u.shard_state is not ShardState.SHARDED]
        assert gathered == [root], f"between forward and backward {len(gathered)} units are gathered"
        assert sum(_storage(u).unsharded_bytes() for u in units) == _storage(root).unsharded_bytes() > 0
        during.clear()
        backward_gathers.clear()
        loss.backward()
        # each block is gathered once, ahead of its backward (the last block's during the
        # root's), and only once the gather before it has landed and been copied out: two
        # gathers in flight beside a copy-out would hold one more unit's bytes at the moment
        # backward holds the most activations
        assert [u for u, _, _ in backward_gathers] == units[:0:-1], [u for u, _, _ in backward_gathers]
        assert all(prefetch for _, prefetch, _ in backward_gathers), "a block gathered in its own backward, not ahead"
        overlapping = [(u, others) for u, _, others in backward_gathers if others]
        assert not overlapping, f"all-gathers started while others were in flight: {overlapping}"
        # the unit computing, the one prefetched for it, and the root (needed last)
        assert max(held for held, _ in during) <= 3, f"{max(during)} units were gathered at once during backward"
        block_bytes = max(_storage(u).world * _storage(u).shard_numel * 4 for u in units[1:])
        largest = max(gathered_bytes for _, gathered_bytes in during)
        assert largest <= _storage(root).unsharded_bytes() + 2 * block_bytes, f"{largest} bytes gathered at once"
        optimizer.step()
    assert len(reduced) == 2 * len(units), f"{len(reduced)} reductions seen"
    assert all(u.shard_state is ShardState.SHARDED for u in units), "a unit stayed gathered at rest"
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    held = local_bytes(params) + local_bytes([p.grad for p in params]) + local_bytes(state)
    full = 16 * sum(p.numel() for p in params)  # fp32 AdamW: parameter, gradient, two moments
    steps = 4 * len(params)  # AdamW's step counters, replicated on every rank
    # padding: every rank's slot of a parameter holds ceil(rows / N) rows, more than numel / N;
    # the first ranks fill those rows with parameter, gradient and moments (16 bytes each), the
    # last ones with padding in the parameter and gradient buffers; gradient buffers also carry
    # one "used" flag per parameter
    padding = sum(16 * (sp.geometry.slot_numel - sp.geometry.numel / world) for u in units for sp in u.params)
    flags = 4 * len(params)
    assert held <= 1.05 * full / world + padding + flags + steps, f"rank {rank} holds {held} bytes, full/N is {full / world:.0f}"


def _check_gloo_copies_reduce_scatter_input(rank, world):
    base = torch.arange(world * 4, dtype=torch.float32)
    sent = base * (rank + 1)
    expected = base.view(world, 4)[rank] * (world + 1) / 2  # the average of rank + 1 over the ranks
    received = torch.empty(4)
    work = comm.reduce_scatter_tensor(received, sent, dist.group.WORLD, dist.ReduceOp.AVG)
    assert comm.reduce_scatter_copies_input(dist.group.WORLD)
    sent.fill_(float("nan"))  # what fully_shard may do once the call returned: free it
    work.wait()
    assert torch.equal(received, expected), (received, expected)


def _map_large_blocks_and_release_free_memory() -> None:
    """Make any buffer a collective allocates raise the resident peak, whatever this process did
    before: glibc serves large blocks from mappings of their own from now on (the setting the
    memory runs start their ranks with; it also stops glibc from raising the threshold after a
    large free), and gives back the pages of every free block it keeps, so that a buffer served
    from freed heap faults its pages in again instead of hiding in memory already counted."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):  # glibc (Linux, as /proc is)
        m_mmap_threshold = -3
        libc.mallopt(m_mmap_threshold, 64 << 10)
        libc.malloc_trim(0)


def _check_gloo_gathers_into_its_output(rank, world):
    from examples.peak_memory import DataPeak

    n = 4 << 20  # 16 MiB a rank: blocks this large are mapped and given back on free by glibc
    sent = torch.arange(n, dtype=torch.float32) * (rank + 1) + 0.1 * rank
    expected = torch.cat([torch.arange(n, dtype=torch.float32) * (r + 1) + 0.1 * r for r in range(world)])
    for async_op in (True, False):
        output = torch.zeros(world * n)
        _map_large_blocks_and_release_free_memory()
        peak = DataPeak()
        work = comm.all_gather_into_tensor(output, sent, dist.group.WORLD, async_op=async_op)
        if work is not None:
            work.wait()
        rise = peak.rise()
        assert torch.equal(output, expected), f"rank {rank}: the gather is not a copy (async_op={async_op})"
        # gloo's own all-gather stages the whole output in a buffer of its own (rise ~ output)
        assert rise < output.numel() * 4 / 2, f"rank {rank}: gathering held {rise / 2**20:.1f} MiB beside the output"
    empty = torch.empty(0)
    comm.all_gather_into_tensor(empty, empty, dist.group.WORLD, async_op=False)


def _check_gloo_collectives(rank, world):
    _check_gloo_copies_reduce_scatter_input(rank, world)
    _check_gloo_gathers_into_its_output(rank, world)


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_collectives_hold_no_buffer_beyond_their_output(world_size):
    """fully_shard frees a reduction's send buffer as soon as the collective returns, on gloo,
    and a gather in flight holds its output only (a prefetch overlapping compute would otherwise
    hold two units' worth)."""
    run_on_ranks(_check_gloo_collectives, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_full_shard_holds_about_one_nth_at_rest_and_few_units_gathered_at_once(world_size):
    run_on_ranks(_check_memory, world_size)
