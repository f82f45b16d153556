"""Layer 1 under DDP: each DDP bucket's owned parameters stepped as that bucket's all-reduce ends.

Without overlap, ZeRO-1 waits for the whole backward, then every rank steps its shard and the
owners broadcast. DDP already hands its gradients over bucket by bucket (a comm hook sees each
bucket when its all-reduce starts), and a parameter's update needs only its own averaged
gradient, so each owner can step the parameters of a bucket as soon as that bucket's all-reduce
has finished, and send them while the backward goes on. A :class:`BucketSteps` does that for
one ``OSS``:

* **when**: at the last bucket, every bucket in order (``hook_with_zero_step``: the backward's
  computation runs uninterrupted, the steps overlap the last all-reduces); or one bucket behind
  (``hook_with_zero_step_interleaved``: bucket ``i`` is stepped when bucket ``i + 1`` has been
  handed over, so its all-reduce has had ``i + 1``'s backward to finish). Both run on the thread
  that runs the hooks, so every rank issues the same collectives in the same order, on gloo as
  on NCCL (torch's version steps in the futures' callbacks, whose thread and order gloo does not
  fix, and so refuses gloo).
* **what**: the bucket's parameters this rank owns, with the averaged gradients the hook's
  future gives (a bucket's parameters are the same on every rank, so DDP's first-iteration
  buckets and its rebuilt ones both work, from the first step: nothing to learn first);
* **the broadcasts**: each bucket's parameters from their owners, waited for before the last
  hook returns, so the next forward reads updated values;
* **the record**: which parameters the last backward stepped, so ``OSS.step()`` steps only what
  it did not (parameters outside DDP's buckets) and never a parameter twice.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from .._common import comm
from .._common.broadcast import PendingBroadcasts, plan_broadcasts, start_broadcasts
from .._common.errors import on_rank
from .partition import Partition

__all__ = ["BucketSteps", "StepWith", "step_only", "PARTITION_CHANGED_UNDER_HOOK", "TORCH_HOOKS_REFUSED"]

logger = logging.getLogger(__name__)

PARTITION_CHANGED_UNDER_HOOK = (
    "requires_grad changed on some parameters: with overlap_with_ddp=True the partition cannot "
    "change under a DDP hook; build DDP and the optimizer afresh"
)
TORCH_HOOKS_REFUSED = (
    "torch's hook_with_zero_step / hook_with_zero_step_interleaved drive torch's "
    "ZeroRedundancyOptimizer through its private state (and refuse gloo); with sharded's optimizer "
    "use sharded.hook_with_zero_step / sharded.hook_with_zero_step_interleaved (same arguments), "
    "built with overlap_with_ddp=True"
)

# Steps exactly the given owned parameters with the given gradients (OSS._step_with).
StepWith = Callable[[dict[torch.Tensor, torch.Tensor]], None]


class BucketSteps:
    """The per-bucket steps of one ``OSS`` during DDP's backward, their broadcasts and record.

    Args:
        group: the process group the optimizer is sharded over.
        step_with: steps the owned parameters it is given with the gradients it is given.
        bucket_numel: the most elements one broadcast message packs.
        wire_dtype: the dtype parameters travel in (``None``: their own), read at each bucket.
    """

    def __init__(
        self,
        group: comm.ProcessGroup,
        step_with: StepWith,
        bucket_numel: Callable[[], int],
        wire_dtype: Callable[[], Optional[torch.dtype]],
    ) -> None:
        self.group = group
        self.hooked = False  # whether a hook drives this optimizer (see warn_if_unhooked_once)
        self._warned_unhooked = False
        self._step_with = step_with
        self._bucket_numel = bucket_numel
        self._wire_dtype = wire_dtype
        self._rank = comm.group_rank(group)
        self._partition = Partition.build([], comm.group_size(group))
        self._owner: dict[torch.Tensor, int] = {}
        self._waiting: list[tuple[dist.GradBucket, torch.futures.Future]] = []
        self._in_flight: list[PendingBroadcasts] = []
        self._seen: set[int] = set()  # ids of every parameter of the buckets handled this backward
        self._stepped_backward = False  # the last backward stepped its buckets; step() not yet called

    def plan(self, partition: Partition) -> None:
        """Use ``partition``'s owners from now on (every rank's partition is the same)."""
        self._partition = partition
        self._owner = partition.owner_of()

    # ---------------------------------------------------------------- during the backward

    def on_bucket(self, bucket: dist.GradBucket, reduced: torch.futures.Future, interleaved: bool) -> None:
        """Take ``bucket``, whose averaged gradients ``reduced`` will hold, and step what is due."""
        if bucket.index() == 0:
            self._begin_backward()
        self._waiting.append((bucket, reduced))
        due = len(self._waiting) - 1 if interleaved else 0
        if bucket.is_last():
            due = len(self._waiting)
        for waiting in self._waiting[:due]:
            self._step_bucket(*waiting)
        del self._waiting[:due]
        if bucket.is_last():
            self._finish_backward()

    def _begin_backward(self) -> None:
        if self._waiting or self._in_flight:
            raise RuntimeError(
                on_rank(
                    "a DDP backward started while the last one's buckets were still being stepped "
                    "(an error in it?); build the model, optimizer and hook afresh",
                    self._rank,
                )
            )
        self._seen.clear()
        self._stepped_backward = False

    def _step_bucket(self, bucket: dist.GradBucket, reduced: torch.futures.Future) -> None:
        """Step this rank's parameters of ``bucket`` with its averaged gradients, then send them."""
        with torch.profiler.record_function("sharded::step_bucket"):
            params = bucket.parameters()
            grads = _averaged_gradients(bucket, reduced.wait())
            owners = [self._owner_of(p) for p in params]
            self._step_with({p: g for p, g, owner in zip(params, grads, owners) if owner == self._rank})
            self._seen.update(id(p) for p in params)
            by_owner: list[list[torch.Tensor]] = [[] for _ in range(self._partition.world_size)]
            for p, owner in zip(params, owners):
                by_owner[owner].append(p)
            self._in_flight.append(
                start_broadcasts(plan_broadcasts(by_owner, self._bucket_numel()), self.group, self._wire_dtype())
            )

    def _finish_backward(self) -> None:
        """Complete the broadcasts, so the next forward reads every updated parameter."""
        with torch.profiler.record_function("sharded::wait_bucket_broadcasts"):
            in_flight, self._in_flight = self._in_flight, []
            for pending in in_flight:
                pending.wait()
        self._stepped_backward = True

    def _owner_of(self, param: torch.Tensor) -> int:
        owner = self._owner.get(param)
        if owner is None:
            raise ValueError(
                on_rank(
                    f"DDP's bucket holds a parameter (shape {tuple(param.shape)}) that the optimizer "
                    "does not: give the optimizer every parameter of the DDP model",
                    self._rank,
                )
            )
        return owner

    # ------------------------------------------------------------------- at OSS.step()

    def warn_if_unhooked_once(self) -> None:
        """Say once that no hook drives this optimizer, so its steps run after the backward."""
        if not self.hooked and not self._warned_unhooked:
            self._warned_unhooked = True
            logger.warning(
                "OSS(overlap_with_ddp=True) but no sharded.hook_with_zero_step(_interleaved) was "
                "built for it: each step runs after the backward, as without overlap"
            )

    def take_stepped_backward(self) -> bool:
        """Whether the last backward stepped its buckets and no ``step()`` has run since; the
        answer is given once (a second ``step()`` is an ordinary step, as for any optimizer)."""
        stepped, self._stepped_backward = self._stepped_backward, False
        return stepped

    @property
    def stepped_backward(self) -> bool:
        """Whether the last backward stepped its buckets and no ``step()`` has run since."""
        return self._stepped_backward

    def step_the_rest(self) -> None:
        """Step the parameters with a gradient that no bucket of the last backward held (DDP
        leaves out frozen and ignored parameters; a frozen one still holding a zeroed gradient is
        stepped by a plain optimizer, so here too), and send them. Collective when the optimizer
        has such parameters: only an owner knows whether it stepped one, so the ranks agree with
        one small all-reduce."""
        rest = [(i, p) for i, p in enumerate(self._partition.params) if id(p) not in self._seen]
        if not rest:
            return
        owners = self._partition.owners
        mine = {p: p.grad for i, p in rest if owners[i] == self._rank and p.grad is not None}
        self._step_with(mine)
        stepped = torch.tensor([p in mine for _, p in rest], dtype=torch.int32, device=comm.comm_device(self.group))
        comm.all_reduce(stepped, self.group, dist.ReduceOp.MAX)
        by_owner: list[list[torch.Tensor]] = [[] for _ in range(self._partition.world_size)]
        for (i, p), was_stepped in zip(rest, stepped.tolist()):
            if was_stepped:
                by_owner[owners[i]].append(p)
        start_broadcasts(plan_broadcasts(by_owner, self._bucket_numel()), self.group, self._wire_dtype()).wait()


def step_only(optimizer: Optimizer, grads: dict[torch.Tensor, torch.Tensor]) -> None:
    """Step ``optimizer`` over the parameters in ``grads`` only, each with the gradient given.

    The other parameters of its groups are left out of this step (not stepped, their state
    untouched), as if the groups held only these; every parameter's ``.grad`` is as it was
    afterwards. For an optimizer that steps each parameter on its own (all of torch's that
    ``OSS`` accepts), a bucket's step then a later one equal one step over both.
    """
    held = {p: p.grad for p in grads}
    group_params = [group["params"] for group in optimizer.param_groups]
    try:
        for p, grad in grads.items():
            p.grad = grad
        for group, params in zip(optimizer.param_groups, group_params):
            group["params"] = [p for p in params if p in held]
        optimizer.step()
    finally:
        for group, params in zip(optimizer.param_groups, group_params):
            group["params"] = params
        for p, old in held.items():
            p.grad = old


def _averaged_gradients(bucket: dist.GradBucket, result: object) -> Sequence[torch.Tensor]:
    """The bucket's per-parameter gradients, holding the comm hook's result.

    A hook's future gives the averaged bucket, which DDP itself copies into the parameters'
    gradients only when the backward ends; hooks that all-reduce in place give the bucket's own
    buffer, others (compression) a new tensor, copied here into the buffer that
    ``bucket.gradients()`` views (DDP reads the same values from the result later).
    """
    tensor = result[0] if isinstance(result, (list, tuple)) else result
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"a DDP comm hook's future must give a tensor, got {type(tensor).__name__}")
    buffer = bucket.buffer()
    if tensor.data_ptr() != buffer.data_ptr():
        buffer.copy_(tensor.view(buffer.shape))
    return bucket.gradients()
