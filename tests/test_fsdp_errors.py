"""Bad input to fully_shard / FullyShardedDataParallel raises a clear error on every rank,
naming the parameter or module and the rank: never a hang, never silent wrong numbers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from examples.gpt import Block
from sharded import FullyShardedDataParallel, fully_shard
from sharded.fsdp.wrap import ModuleWrapPolicy
from tests._fsdp_reference import TiedGPT, shard_gpt
from tests._harness import run_on_ranks
from tests._models import gpt, gpt_loss, token_batch


def _raises(error, *words):
    """Context asserting ``error`` whose message contains every word (and this rank)."""
    return pytest.raises(error, match="(?s)" + "".join(f"(?=.*{w})" for w in (f"rank {dist.get_rank()}", *words)))


def _check_errors(rank, world):
    model = gpt()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    early_block = torch.optim.SGD(model.blocks[1].parameters(), lr=0.1)
    shard_gpt(model)
    gpt_loss(model, token_batch(rank, 0)).backward()
    with _raises(RuntimeError, "SGD", "parameter tok.weight", r"fully_shard\(GPT\)", "after fully_shard"):
        early.step()  # built before sharding: it would silently train nothing
    with _raises(RuntimeError, "parameter blocks.1.ln1.weight", r"taken by fully_shard\(blocks\.1\)"):
        early_block.step()  # a unit is named by its module path, as torch names it by its FQN

    with _raises(ValueError, "already applied", "GPT"):
        fully_shard(model)
    with _raises(ValueError, "fully_shard.Block.", "ln1.weight", "bottom-up"):
        top_down = gpt()
        fully_shard(top_down)
        fully_shard(top_down.blocks[0])

    with _raises(TypeError, "counts", "int64"):
        counter = nn.Linear(2, 2)
        counter.counts = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
        fully_shard(counter)
    with _raises(TypeError, "one dtype", "float64", "float32"):
        mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
        fully_shard(mixed)
    with _raises(ValueError, "tok.weight", "shared", "common ancestor"):
        tied = TiedGPT()
        fully_shard(tied.head)
        fully_shard(tied)
    with _raises(ValueError, "ignored_params"):
        fully_shard(nn.Linear(2, 2), ignored_params=[nn.Parameter(torch.zeros(1))])
    with _raises(TypeError, "reshard_after_forward"):
        fully_shard(nn.Linear(2, 2), reshard_after_forward="yes")
    with _raises(ValueError, "reshard_after_forward=7", "divide"):
        fully_shard(nn.Linear(2, 2), reshard_after_forward=7)

    with torch.device("meta"):
        on_meta = shard_gpt(gpt())
    with _raises(RuntimeError, "meta device", "to_empty"):
        on_meta(token_batch(rank, 0)[:, :-1])

    with _raises(ValueError, "fsdp_auto_wrap_policy"):
        FullyShardedDataParallel(gpt(), auto_wrap_policy={Block}, fsdp_auto_wrap_policy=ModuleWrapPolicy({Block}))
    with _raises(TypeError, "auto_wrap_policy"):
        FullyShardedDataParallel(gpt(), auto_wrap_policy={"Block"})
    wrapped = FullyShardedDataParallel(gpt(), auto_wrap_policy={Block})
    with _raises(ValueError, "rank0_only", "writeback"):
        with FullyShardedDataParallel.summon_full_params(wrapped, writeback=True, rank0_only=True):
            pass

    # still usable after all that: nothing was left half-done or out of step between ranks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad()
    gpt_loss(model, token_batch(rank, 1)).backward()
    optimizer.step()


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_input_raises_clear_errors_naming_the_culprit_and_rank(world_size):
    run_on_ranks(_check_errors, world_size)


def _check_different_models(rank, world):
    model = shard_gpt(gpt(vocab=64 if rank == 0 else 65))
    with _raises(ValueError, "differ across ranks", "tok.weight", "65"):
        model(token_batch(rank, 0)[:, :-1])


def test_ranks_with_different_models_fail_before_any_collective_can_hang():
    run_on_ranks(_check_different_models, 2)


def _check_refusals_match_torch(rank, world):
    """Where torch's fully_shard refuses, ours refuses with the exception type torch raises (so
    code catching torch's type catches ours) and torch's wording inside our own."""
    import copy

    from tests._fsdp_reference import TiedGPT

    for container in (nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleDict({"a": nn.Linear(2, 2)})):
        with _raises(ValueError, "does not support containers that do not implement forward", type(container).__name__):
            fully_shard(container)
        with _raises(ValueError, "does not support containers"):
            fully_shard([nn.Linear(2, 2), container])

    class Stack(nn.ModuleList):  # a container that does define forward is fine
        def forward(self, x):
            for layer in self:
                x = layer(x)
            return x

    fully_shard(Stack([nn.Linear(2, 2)]))

    once = fully_shard(nn.Linear(2, 2))
    for error in (AssertionError, ValueError):  # torch's type, and ours before it
        with _raises(error, r"Each distinct composable distributed API can only be applied to a module once\.", "already applied", "Linear"):
            fully_shard(once)
    with _raises(AssertionError, "does not support deepcopy", "state_dict"):
        copy.deepcopy(once)

    tied = TiedGPT()
    fully_shard(tied.head)
    with _raises(ValueError, "tok.weight", "already managed by another", "common ancestor"):
        fully_shard(tied)


@pytest.mark.parametrize("world_size", [1, 3])
def test_refusals_raise_torchs_exception_types(world_size):
    run_on_ranks(_check_refusals_match_torch, world_size)
