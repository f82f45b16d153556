"""sharded.estimate_memory's accounting, sharded.plan's choices, the command, and OSS's
imbalance warning: pure or one launch, on meta-device models."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import sharded
from sharded import OSS, estimate_memory, plan
from sharded._common.in_flight import InFlight
from sharded._owners.partition import Partition
from sharded.oss import imbalance
from tests._harness import run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def _mlp(layers: int = 4, width: int = 256) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_optimizer_state_comes_from_the_optimizer():
    model = _mlp()
    n = _numel(model)
    sgd = estimate_memory(model, world_size=1, stage=0, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1, "momentum": 0.9})
    adam = estimate_memory(model, world_size=1, stage=0, optimizer=torch.optim.Adam)
    adamw = estimate_memory(model, world_size=1, stage=0, optimizer=torch.optim.AdamW,
                            optimizer_kwargs=dict(torch.optim.AdamW([nn.Parameter(torch.zeros(1))]).defaults))
    factored = estimate_memory(model, world_size=1, stage=0, optimizer=torch.optim.Adafactor)
    assert sgd.optimizer_state == 4 * n  # one momentum buffer
    assert adam.optimizer_state == adamw.optimizer_state == 8 * n + 4 * 8  # two moments, a step per parameter
    # Adafactor keeps a row and a column vector per matrix (it reads .item(): probed on real tensors)
    assert factored.optimizer_state == 4 * (4 * (256 + 256) + 4 * 256) + 4 * 8
    assert all(e.parameters == 4 * n for e in (sgd, adam, factored))


def test_stages_follow_the_zero_accounting():
    model = _mlp(layers=8)
    n = _numel(model)
    e = {s: estimate_memory(model, world_size=4, stage=s, wrap={nn.Linear}, runtime_bytes=0) for s in range(4)}
    assert e[0].gradients == e[1].gradients == 4 * n and e[0].optimizer_state == 8 * n + 4 * 16
    assert e[1].optimizer_state == e[2].optimizer_state <= 8 * n / 4 + 8 * 256 * 4 + 64  # whole parameters, sorted greedy
    assert e[2].gradients <= 4 * n / 4 + 4 * 256 * 256
    assert e[3].parameters == sum(4 * -(-p.shape[0] // 4) * (p.numel() // p.shape[0]) for p in model.parameters())
    assert [e[s].peak_bytes for s in range(4)] == sorted((e[s].peak_bytes for s in range(4)), reverse=True)
    assert e[3].bytes_sent > e[2].bytes_sent == e[1].bytes_sent == e[0].bytes_sent


def test_plan_picks_the_least_sharded_stage_that_fits():
    model = _mlp(layers=8)
    peaks = {s: estimate_memory(model, world_size=4, stage=s, wrap={nn.Linear}).peak_bytes for s in range(4)}
    choose = lambda budget: [e.stage for e in plan(model, world_size=4, budget_bytes=budget, wrap={nn.Linear})]  # noqa: E731
    assert choose(10**12) == [0, 1, 2, 3]  # equal bytes sent: the least sharded first; ZeRO-3 sends more
    between = (peaks[1] + peaks[2]) // 2  # ZeRO-1 and DDP are over it
    assert choose(between) == [2, 3]
    assert choose(peaks[3]) == [3]
    assert choose(peaks[3] - 1) == []
    with pytest.raises(ValueError, match="stage"):
        estimate_memory(model, world_size=4, stage=4)


def test_plan_is_a_function_also_after_the_command_module_is_imported():
    import sharded.plan as command  # noqa: F401

    assert callable(sharded.plan) and sharded.plan is plan
    # A program whose first import is the command's module: the package attribute is the module,
    # which must plan as the function does.
    first = ("import sharded.plan, sharded, torch; from torch import nn; "
             "print([e.stage for e in sharded.plan(nn.Linear(4, 4), world_size=2, budget_bytes=10**9)])")
    done = subprocess.run([sys.executable, "-c", first], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str([e.stage for e in plan(nn.Linear(4, 4), world_size=2, budget_bytes=10**9)])


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "sharded.plan", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_command_prints_the_fit_table_and_the_account():
    peaks = [estimate_memory(_mlp(), world_size=4, stage=s, wrap={nn.Linear}).peak_bytes for s in range(4)]
    budget = (peaks[1] + peaks[2]) // 2
    table = _cli("tests.test_memory_plan:_mlp", "--world-size", "4", "--budget", f"{budget}B", "--wrap", "torch.nn:Linear",
                 "--stage", "0,1,2,3")  # the older spelling of --stages
    assert [line.split()[-1] for line in table.splitlines() if line.startswith(("DDP", "ZeRO"))] == ["no", "no", "yes", "yes"]
    assert "choose: ZeRO-2" in table
    account = _cli("tests.test_memory_plan:_mlp", "--world-sizes", "2,8", "--stages", "1,3")
    rows = [line.split() for line in account.splitlines() if line.startswith(("ZeRO"))]
    assert [(r[0], r[1]) for r in rows] == [("ZeRO-1", "2"), ("ZeRO-1", "8"), ("ZeRO-3", "2"), ("ZeRO-3", "8")]
    assert 1.9 < float(rows[1][-1]) < 2.1  # 4 weights over 8 ranks: the busiest holds about twice 1/8


def _mixed_dtypes(device: str = "meta") -> nn.Module:
    """Float32 and bfloat16 layers: OSS broadcasts each owner's parameters in a bucket per dtype."""
    with torch.device(device):
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    model[1].to(torch.bfloat16)
    model[3].to(torch.bfloat16)
    return model


def _count_oss_broadcasts(rank, world):
    from sharded._common import comm

    model = _mixed_dtypes("cpu")
    optimizer = OSS(model.parameters(), torch.optim.SGD, lr=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    issued = []
    broadcast = comm.broadcast
    comm.broadcast = lambda *args, **kwargs: issued.append(args) or broadcast(*args, **kwargs)
    try:
        optimizer.step()
    finally:
        comm.broadcast = broadcast
    return len(issued)


def test_estimated_collectives_count_the_broadcasts_oss_issues_for_mixed_dtypes():
    model = _mixed_dtypes()
    ddp, zero1 = (estimate_memory(model, world_size=2, stage=s).collectives for s in (0, 1))
    issued = run_on_ranks(_count_oss_broadcasts, 2)
    assert issued[0] == issued[1] == zero1 - ddp == 4  # two owners, two dtypes each


def test_in_flight_work_past_the_limit_is_finished_oldest_first():
    sends = InFlight[str]()
    for name in "abc":
        sends.add(name)
    assert sends.beyond(1) == ["a", "b"] and list(sends) == ["c"]
    assert sends.beyond(1) == [] and sends.beyond(0) == ["c"] and len(sends) == 0


def test_imbalance_counts_whole_parameters():
    big, small = nn.Parameter(torch.zeros(100)), nn.Parameter(torch.zeros(10))
    assert imbalance(Partition.build([[big, small]], 2)) == pytest.approx(200 / 110)
    assert imbalance(Partition.build([[small, small.clone()]], 2)) == 1.0


def _build_imbalanced_oss(rank, world, caplog_level):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("sharded.oss").addHandler(handler)
    OSS([nn.Parameter(torch.zeros(1000)), nn.Parameter(torch.zeros(10))], torch.optim.SGD, lr=0.1)
    OSS([nn.Parameter(torch.zeros(100)), nn.Parameter(torch.zeros(100))], torch.optim.SGD, lr=0.1)
    return [r.getMessage() for r in records]


def test_oss_warns_once_when_a_rank_holds_much_more_than_an_even_share():
    messages = run_on_ranks(_build_imbalanced_oss, 2, logging.WARNING)[0]
    assert len(messages) == 1 and "1.98x" in messages[0] and "SHARD_GRAD_OP" in messages[0]


def test_parameters_in_their_own_storage_cost_a_packed_copy_of_shared_buckets_after_the_step():
    """``parameters_as_bucket_view=False``: every broadcast bucket of several parameters travels as
    a packed copy (the owner's message, the others' receive buffer), all in flight at once after
    the step; a parameter alone in its bucket (here the 4096 x 4096 weight, more than a bucket's
    2**23 elements) is sent from its own storage; nothing is broadcast at world 1."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096, bias=False), *[nn.Linear(256, 256) for _ in range(6)])
    small = sum(p.numel() * 4 for p in model[1:].parameters())
    for stage in (1, 2):
        views = estimate_memory(model, world_size=2, stage=stage, optimizer=torch.optim.SGD)
        own = estimate_memory(model, world_size=2, stage=stage, optimizer=torch.optim.SGD, parameters_as_bucket_view=False)
        assert "broadcast" not in views.phases
        assert own.phases["broadcast"] == own.phases["optimizer step"] - own.optimizer_step + small
        assert own.peak_bytes == max(own.phases.values()) >= views.peak_bytes
        if stage == 1:  # plain SGD's step holds nothing of its own: the packed copy sets ZeRO-1's peak
            assert own.peak_bytes == own.phases["broadcast"] == views.peak_bytes - views.optimizer_step + small
        alone = estimate_memory(model, world_size=1, stage=stage, parameters_as_bucket_view=False)
        assert alone == estimate_memory(model, world_size=1, stage=stage)
    for stage in (0, 3):
        with pytest.raises(ValueError, match="parameters_as_bucket_view is OSS's option"):
            estimate_memory(model, world_size=2, stage=stage, parameters_as_bucket_view=False)
