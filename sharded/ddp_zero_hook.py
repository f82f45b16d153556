"""DDP comm hooks that run ``OSS(overlap_with_ddp=True)``'s step during the backward.

The same names and arguments as torch's ``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook``:
wrap any comm hook (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``, one's
own) so that, as each bucket's reduction finishes, the owners step that bucket's parameters and
send them (:mod:`sharded._owners.ddp_overlap` holds the mechanism). Unlike torch's, they work on
gloo as on NCCL, step from the first iteration on (torch's skips the updates of the first two or
three while it learns DDP's buckets), and give the numbers of DDP with the same hook and the
plain optimizer. torch's functions refuse ``sharded``'s optimizer with a message naming these.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from ._common.errors import on_rank
from ._owners.ddp_overlap import BucketSteps
from .oss import OSS

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]

CommHook = Callable[[Any, Any], torch.futures.Future]


def hook_with_zero_step(
    hook: CommHook, ddp: DistributedDataParallel, zero: OSS, shard_buckets: bool = True
) -> CommHook:
    """``hook``, followed by ``zero``'s step of every bucket once the last bucket is handed over.

    The backward's computation runs uninterrupted; at its last bucket each owner steps its
    parameters of every bucket, in order, as each bucket's reduction finishes (overlapping the
    last reductions and the owners' broadcasts). Prefer it where communication is slow next to
    computation. Register the result: ``ddp.register_comm_hook(state, hook_with_zero_step(hook,
    ddp, zero))``.

    Args:
        hook: the comm hook that reduces each bucket (its future gives the averaged bucket).
        ddp: the ``DistributedDataParallel`` model the hook is registered on.
        zero: an ``OSS`` (or ``sharded.ZeroRedundancyOptimizer``) over every parameter of
            ``ddp``, built with ``overlap_with_ddp=True``.
        shard_buckets: ``True``: each bucket's parameters are stepped by the ranks that own them
            (the balanced partition spreads a bucket over ranks). ``False`` (torch's whole
            bucket per rank) raises: the partition is by parameter and is not redrawn by bucket.
    """
    return _driving(hook, ddp, zero, shard_buckets, interleaved=False)


def hook_with_zero_step_interleaved(
    hook: CommHook, ddp: DistributedDataParallel, zero: OSS, shard_buckets: bool = True
) -> CommHook:
    """``hook``, followed by ``zero``'s step of each bucket one bucket later.

    When bucket ``i + 1`` is handed over, bucket ``i``'s reduction has had ``i + 1``'s backward
    to finish: its owners step its parameters and send them then, so the steps and broadcasts
    interleave with the backward's computation and reductions. Prefer it where communication is
    fast next to computation. Arguments as for :func:`hook_with_zero_step`.
    """
    return _driving(hook, ddp, zero, shard_buckets, interleaved=True)


def _driving(hook: CommHook, ddp: DistributedDataParallel, zero: OSS, shard_buckets: bool, interleaved: bool) -> CommHook:
    steps = _bucket_steps_of(zero)
    _check_ddp(ddp, zero, shard_buckets)
    steps.hooked = True

    # No annotations: DDP checks a comm hook's as objects, and this module's are strings.
    def hook_with_zero(state, bucket):  # type: ignore[no-untyped-def]
        reduced = hook(state, bucket)
        steps.on_bucket(bucket, reduced, interleaved)
        return reduced

    return hook_with_zero


def _bucket_steps_of(zero: Any) -> BucketSteps:
    if not isinstance(zero, OSS):
        raise TypeError(
            f"zero must be sharded's OSS or ZeroRedundancyOptimizer, got {type(zero).__name__}; "
            "for torch's ZeroRedundancyOptimizer use torch's ddp_zero_hook functions"
        )
    if zero._bucket_steps is None:
        raise ValueError(on_rank("build the optimizer with overlap_with_ddp=True to step it in a DDP hook", zero.rank))
    return zero._bucket_steps


def _check_ddp(ddp: DistributedDataParallel, zero: OSS, shard_buckets: bool) -> None:
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"ddp must be a torch DistributedDataParallel, got {type(ddp).__name__}")
    if not shard_buckets:
        raise ValueError(
            on_rank(
                "shard_buckets=False (each DDP bucket stepped whole by one rank) is not offered: the "
                "optimizer's partition balances parameters, not buckets; pass shard_buckets=True",
                zero.rank,
            )
        )
    if ddp.find_unused_parameters:
        raise ValueError(
            on_rank(
                "DDP(find_unused_parameters=True): whether a parameter was used on any rank, and "
                "so whether it is stepped, is known only when the backward ends, after its "
                "bucket's step; overlap_with_ddp needs find_unused_parameters=False",
                zero.rank,
            )
        )
    held = set(zero.partition.params)
    reduced = [(name, p) for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ddp.parameters_to_ignore]
    missing = [name for name, p in reduced if p not in held]
    if missing:
        raise ValueError(
            on_rank(
                f"parameter {missing[0]!r} of the DDP model is not in the optimizer"
                + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
                + ": give it every parameter DDP reduces",
                zero.rank,
            )
        )
