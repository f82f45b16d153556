"""Bit-for-bit comparisons at three and four ranks: batches and DDP averaging that make every
order of the gradient sum give the same bits.

Why: with two ranks the average is the same in any order (``a + b == b + a``, and halving is
exact), so the tests compare with ``torch.equal``. With three or more different gradients, gloo
adds them in an order that depends on the collective and on where an element sits in the buffer,
so DDP's all-reduce and a reduce or reduce-scatter of the same gradients differ by float32 ulps.
An optimizer that amplifies ulps turns them into differences whose size depends on which
roundings flip, and so on the CPU's kernels: AdamW's ``m / sqrt(v)`` on a ~0 gradient moves
that element by up to ``lr``, and Muon's Newton–Schulz, in bfloat16, spreads one flipped
rounding of its input over the whole update and grows it each iteration (measured on an AMD
EPYC with avx512_bf16: 0.0076 after three steps of lr 0.02, where a one-ulp-per-element bound
gives 0.0007). No bound on that is both machine-independent and tight enough to catch a bug, so
these comparisons are made exact instead:

* world 3: every rank trains on rank 0's batch (:func:`batch_rank`). Three equal terms add to
  ``fl(3a)`` in any order, because ``a + a`` is exact. DDP divides each term by 3 before the
  sum, a reduction with ``AVG`` divides the sum: :func:`averaging_ddp` registers a comm hook
  that averages after the sum, so DDP divides where the sharded reductions (and torch's
  ``fully_shard`` on gloo) do. A rank that dropped or misplaced its contribution still changes
  the result (``2a / 3``, or ``(2a + b) / 3``); what world 3 no longer checks is the mixing of
  different ranks' data, which world 2 checks bit for bit.
* world 3, where the forward itself differs between ranks (a branch taken on rank 0 only), so
  equal batches still give rank 0 other gradients than the others: :func:`loss_weight` zeroes
  rank 2's loss, and ``a + b + 0`` adds alike in any order. Rank 2 still runs every collective,
  but its gradients are zeros, so this checks less than equal batches do; it is for those tests
  only.
* world 4 as a 2 x 2 hybrid mesh: each rank keeps its own batch; the sharded side sums each
  shard group's pair and then the two pairs' results, a tree whose every node adds two terms;
  :func:`pairwise_ddp`'s hook sums DDP's gradients in that tree.
"""

# No ``from __future__ import annotations``: DDP checks a comm hook's annotations as objects.
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["batch_rank", "loss_weight", "averaging_ddp", "average_after_the_sum", "pairwise_ddp"]


def batch_rank(rank: int, world: int) -> int:
    """The rank whose batch ``rank`` trains on: its own at world 1 and 2, rank 0's at world 3."""
    if world > 3:
        raise ValueError(f"equal batches sum exactly at world 3 at most, not {world}: use pairwise_ddp")
    return rank if world <= 2 else 0


def loss_weight(rank: int, world: int) -> float:
    """What ``rank`` multiplies its loss by where ranks compute differently: 0.0 for rank 2 at
    world 3 (its gradients exactly zero), 1.0 otherwise."""
    if world > 3:
        raise ValueError(f"a zero third term sums exactly at world 3 at most, not {world}: use pairwise_ddp")
    return 0.0 if world == 3 and rank == 2 else 1.0


def averaging_ddp(module: nn.Module) -> DDP:
    """``DDP(module)`` averaging each bucket after the sum (all-reduce with ``AVG``): at world
    1 and 2 the bits of DDP's default (dividing by 2 is exact), at world 3 those of a reduction
    with ``AVG``."""
    return average_after_the_sum(DDP(module))


def average_after_the_sum(ddp: DDP) -> DDP:
    """``ddp``, its buckets now averaged after the sum (see :func:`averaging_ddp`)."""
    ddp.register_comm_hook(None, _average_after_the_sum)
    return ddp


def _average_after_the_sum(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.AVG, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def pairwise_ddp(module: nn.Module, shard_groups: list[list[int]]) -> DDP:
    """``DDP(module)`` over four ranks summing the gradients as ``(g[a] + g[b]) + (g[c] + g[d])``
    for ``shard_groups == [[a, b], [c, d]]`` and dividing by 4 (exact): a 2 x 2 hybrid mesh's
    reduce in the shard group, then all-reduce across the two replicas, both averaging."""
    if sorted(r for group in shard_groups for r in group) != list(range(4)) or len(shard_groups) != 2:
        raise ValueError(f"two shard groups of two ranks each covering ranks 0-3, not {shard_groups}")

    def sum_by_pairs(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        mine = bucket.buffer()
        every = [torch.empty_like(mine) for _ in range(4)]
        dist.all_gather(every, mine)
        (a, b), (c, d) = shard_groups
        mine.copy_(((every[a] + every[b]) + (every[c] + every[d])) / 4)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(mine)
        return done

    ddp = DDP(module)
    ddp.register_comm_hook(None, sum_by_pairs)
    return ddp
