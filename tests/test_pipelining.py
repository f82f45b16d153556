"""torch's pipelining (``torch.distributed.pipelining``) over stages sharded by our ``fully_shard``,
against the same pipeline over torch's ``fully_shard``: the same losses and parameters, bit for bit.

Each stage (two linear layers, a unit each, and the stage's root) is sharded over the ``dp``
dimension of a ``(pp, dp)`` mesh and sent its activations over ``pp``: world 2 is two stages
(dp = 1) under GPipe, 1F1B, interleaved 1F1B and the two zero-bubble schedules (two stages per
rank), world 4 two stages by two data-parallel ranks, each ``dp`` rank on its own batches (two
terms sum alike in any order). The schedules drive the stages through what torch's FSDP offers
them: ``isinstance(stage, FSDPModule)``, ``set_requires_gradient_sync(False)`` and
``set_reshard_after_backward(False)`` before each micro-batch's backward, input gradients by
``torch.autograd.grad`` and (zero-bubble) weight gradients written to the gathered parameters,
``unshard`` / ``reshard``, and at the end (torch 2.13 and 2.14) private state reached through
torch's ``fully_shard.state(stage)``: each param group's ``post_backward()`` and the root's final
callback, which our units answer (sharded/fsdp/_state.py). torch 2.15's schedules call
``set_manual_backward_finalization`` and ``finalize_backward(async_op=True)`` instead: on a torch
that has them the tests run once our ``FSDPModule`` defines them too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from tests._fsdp_reference import full_tensors
from tests._harness import run_on_ranks

MICRO_BATCHES = 4
STEPS = 2
LOOPED = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")  # two stages per rank


def _finalization_missing() -> bool:
    """torch's schedules call FSDPModule.set_manual_backward_finalization (2.15), ours lacks it."""
    from sharded.fsdp import FSDPModule

    return hasattr(TorchFSDPModule, "set_manual_backward_finalization") and (
        "set_manual_backward_finalization" not in vars(FSDPModule)
    )


pytestmark = pytest.mark.skipif(
    _finalization_missing(),
    reason="this torch's pipelining calls FSDPModule.set_manual_backward_finalization / finalize_backward, "
    "which sharded's FSDPModule does not define yet",
)


def _stage_module(index: int) -> nn.Module:
    torch.manual_seed(index)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def _stage_indices(schedule: str, pp_rank: int, pp: int) -> list[int]:
    if schedule == "ZBVZeroBubble":  # the V: rank 0 holds the first and the last stage
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(2 if schedule in LOOPED else 1)]


def _train(fully_shard, schedule: str, mesh, step_offset: int) -> list[torch.Tensor]:
    """``STEPS`` SGD steps of the pipeline: this rank's losses (on the last stage), then its
    stages' full parameters."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules

    pp, pp_rank, dp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    indices = _stage_indices(schedule, pp_rank, pp)
    n_stages = pp * (2 if schedule in LOOPED else 1)
    modules, stages = [], []
    for index in indices:
        module = _stage_module(index)
        for layer in module:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
        modules.append(module)
        stages.append(PipelineStage(module, index, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    cls = getattr(schedules, f"Schedule{schedule}")
    pipeline = cls(stages if schedule in LOOPED else stages[0], MICRO_BATCHES, loss_fn=_mse)
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)
    losses: list[torch.Tensor] = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * (step_offset + step) + dp_rank)
        x, target = torch.randn(8, 8, generator=generator), torch.randn(8, 8, generator=generator)
        step_losses: list[torch.Tensor] = []
        inputs = (x,) if 0 in indices else ()
        targets = {"target": target, "losses": step_losses} if n_stages - 1 in indices else {}
        pipeline.step(*inputs, **targets)
        optimizer.step()
        optimizer.zero_grad()
        losses += [loss.detach() for loss in step_losses]
    return losses + full_tensors(p for m in modules for p in m.parameters())


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def _pipelines_match_torch(rank: int, world: int, schedule_names: list[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    for i, schedule in enumerate(schedule_names):
        ours = _train(fully_shard, schedule, mesh, 10 * i)
        theirs = _train(torch_fully_shard, schedule, mesh, 10 * i)
        assert len(ours) == len(theirs), schedule
        for j, (a, b) in enumerate(zip(ours, theirs)):
            assert torch.equal(a, b), f"{schedule}: tensor {j} differs from torch's fully_shard by {(a - b).abs().max():.3g}"


def test_two_stage_pipelines_over_our_shards_match_torchs_fully_shard():
    """World 2: every schedule family, one stage (or two, interleaved) per rank."""
    run_on_ranks(_pipelines_match_torch, 2, ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"],
                 timeout=180)


def test_two_stages_by_two_data_parallel_ranks_match_torchs_fully_shard():
    """World 4: a 2 x 2 (pp, dp) mesh, each stage sharded over its two dp ranks."""
    run_on_ranks(_pipelines_match_torch, 4, ["GPipe", "1F1B", "InterleavedZeroBubble"], timeout=240)
