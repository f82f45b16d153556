"""Uneven inputs: what a rank that ran out of data runs so that the others never wait on it.

torch's ``Join`` context (``torch.distributed.algorithms.join``) lets ranks leave their loops at
different times. While some rank still trains, every rank that has left runs each joinable's
hook once per iteration of the others; the hook issues the collectives its object would have
issued in that iteration, with this rank's contribution zero. The first joinable tells the
context, at the start of each iteration, that its rank has not left (``notify_join_context``).

- :class:`ModelJoinHook`, for ``ShardedDataParallel``: the forward's collectives (the buffers'
  broadcast, from the last rank that still trains, as DDP's join does; a flag saying whether
  the others' backward reduces), then the backward's reduces with zeros
  (:meth:`~.grad_router.GradRouter.shadow_backward`), after which this rank holds the others'
  average of the gradients it owns, its share of ``clip_grad_norm_`` if its own last
  iteration clipped, and the steps of the model's optimizers with them. So the
  parameters are DDP's under ``model.join()``. When every rank has left, the buffers are
  broadcast from the last to leave, as DDP's final sync does (the parameters agree already).
- :class:`OptimizerJoinHook`, for ``OSS``: its step (its shard, then the owners' broadcasts),
  as torch's ``ZeroRedundancyOptimizer``'s hook does, unless a ``ShardedDataParallel``'s hook
  in a ``Join`` steps it. Beside torch's ``DistributedDataParallel`` it steps with the
  gradients this rank holds: DDP's hook shadows the all-reduces with zeros and keeps nothing,
  so those are left from this rank's last batch, as with torch's class (it says so, once).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Iterable, Optional, Protocol, Sequence, cast

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from .._common import comm
from .._common.errors import on_rank

__all__ = ["ModelJoinHook", "OptimizerJoinHook", "before_forward_under_join"]

logger = logging.getLogger(__name__)

# optimizer -> the ShardedDataParallel hook that steps it (its own hook then does nothing)
_stepped_by_model: weakref.WeakKeyDictionary[Any, weakref.ref[ModelJoinHook]] = weakref.WeakKeyDictionary()


class SteppedOptimizer(Protocol):
    """What the hooks need of an ``OSS``."""

    rank: int
    _join_config: Any

    def step(self) -> Any: ...


class JoiningModel(Protocol):
    """What the hooks need of a ``ShardedDataParallel``."""

    process_group: Any
    rank: int
    world_size: int
    broadcast_buffers: bool
    require_backward_grad_sync: bool
    _sync_buffers_at_next_forward: bool
    _join_config: Any
    _divide_by_initial_world_size: bool
    _clip_under_join: Optional[tuple[float, float, bool]]
    _router: Any

    @property
    def sharded_optimizers(self) -> Sequence[SteppedOptimizer]: ...

    def buffers(self) -> Iterable[torch.Tensor]: ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor: ...

    def _sync_buffers_from(self, src: int) -> None: ...


class OptimizerJoinHook(JoinHook):
    """``OSS``'s join hook: a joined rank steps its shard and sends the owners' broadcasts."""

    def __init__(self, optimizer: SteppedOptimizer) -> None:
        super().__init__()
        self.optimizer = optimizer
        self._warned = False

    def main_hook(self) -> None:
        """Step, unless a ``ShardedDataParallel``'s hook in a ``Join`` steps this optimizer."""
        if _driver_of(self.optimizer) is not None:
            return
        self._warn_once_that_gradients_are_not_averaged()
        _step_without_notifying(self.optimizer)

    def _warn_once_that_gradients_are_not_averaged(self) -> None:
        if self._warned:
            return
        self._warned = True
        logger.warning(
            "%s",
            on_rank(
                "out of data under Join: OSS steps the parameters this rank owns with the gradients "
                "it holds (none: they stay as they are), as torch's ZeroRedundancyOptimizer does. "
                "Beside DistributedDataParallel those are not the other ranks' average (DDP's join "
                "hook keeps none), so these parameters drift from DDP with a plain optimizer; "
                "ShardedDataParallel's join hook hands the average over",
                self.optimizer.rank,
            ),
        )


class ModelJoinHook(JoinHook):
    """``ShardedDataParallel``'s join hook: shadow one iteration of the ranks that still train.

    Args:
        model: the ``ShardedDataParallel``.
        divide_by_initial_world_size: as DDP's: divide the gradients by the world size (the
            joined ranks' zeros count), or, if False, by the number of ranks still training.
    """

    def __init__(self, model: JoiningModel, divide_by_initial_world_size: bool = True) -> None:
        super().__init__()
        self.model = model
        model._divide_by_initial_world_size = bool(divide_by_initial_world_size)
        for optimizer in model.sharded_optimizers:
            _stepped_by_model[optimizer] = weakref.ref(self)

    def main_hook(self) -> None:
        """The forward's collectives, then, if the others reduce, the backward's and the steps."""
        model = self.model
        _check_first_joinable(model)
        _sync_buffers_under_join(model, still_training=False)
        will_reduce = _others_will_reduce(False, model.process_group)
        model._sync_buffers_at_next_forward = will_reduce
        if not will_reduce:
            return  # the others accumulate inside no_sync(): no reduce, no step
        model._router.shadow_backward()
        if model._clip_under_join is not None:  # as this rank's last iteration did
            model.clip_grad_norm_(*model._clip_under_join)
        for optimizer in model.sharded_optimizers:
            _step_without_notifying(optimizer)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has left: take the buffers of the last to leave (DDP's final sync)."""
        model = self.model
        if model.broadcast_buffers and _has_buffers(model):
            model._sync_buffers_from(_agreed_source(is_last_joiner, model.rank, model.process_group))


def before_forward_under_join(model: JoiningModel) -> None:
    """On a rank that still trains, inside an enabled ``Join``: tell the context so, set the
    gradients' divisor, sync the buffers from the last rank still training, and tell the joined
    ranks whether this forward's backward reduces. Collective: the joined ranks' hooks match it."""
    _check_first_joinable(model)
    model._clip_under_join = None  # until this iteration clips
    work = Join.notify_join_context(cast(Joinable, model))
    divisor = model.world_size
    if work is not None and not model._divide_by_initial_world_size:
        work.wait()
        divisor = int(work.get_future().value()[0].item())  # how many ranks still train
    model._router.set_divisor(divisor)
    _sync_buffers_under_join(model, still_training=True)
    _others_will_reduce(model.require_backward_grad_sync and torch.is_grad_enabled(), model.process_group)


def _step_without_notifying(optimizer: SteppedOptimizer) -> None:
    """``optimizer.step()`` on a joined rank: its call to ``Join.notify_join_context`` (which
    tells the context that a rank still trains) must stay silent there, even when the optimizer
    is the first joinable."""
    config = optimizer._join_config
    optimizer._join_config = config._replace(is_first_joinable=False)
    try:
        optimizer.step()
    finally:
        optimizer._join_config = config


def _check_first_joinable(model: JoiningModel) -> None:
    """The model must come first in ``Join``: it tells the context, before its forward's
    collectives, that its rank still trains; an optimizer first would tell it after the
    backward, and the joined ranks would shadow the iteration's collectives out of order."""
    if not model._join_config.is_first_joinable:
        raise ValueError(
            on_rank(
                "ShardedDataParallel must be the first joinable in Join (Join([model, optimizer]), "
                "or model.join()): the joined ranks shadow each iteration from its forward on",
                model.rank,
            )
        )


def _sync_buffers_under_join(model: JoiningModel, still_training: bool) -> None:
    """The forward's buffer broadcast, from the highest rank still training (rank 0 may have
    left, its buffers stale), as DDP's join does."""
    if model.broadcast_buffers and model._sync_buffers_at_next_forward and _has_buffers(model):
        model._sync_buffers_from(_agreed_source(still_training, model.rank, model.process_group))


def _has_buffers(model: JoiningModel) -> bool:
    return next(iter(model.buffers()), None) is not None


def _agreed_source(is_candidate: bool, rank: int, group: Any) -> int:
    """The highest rank among the candidates (every rank must call it; one must be a candidate)."""
    rank_or_none = torch.tensor([rank if is_candidate else -1], device=comm.comm_device(group))
    comm.all_reduce(rank_or_none, group, dist.ReduceOp.MAX)
    source = int(rank_or_none.item())
    if source < 0:
        raise RuntimeError(on_rank("no rank is a candidate to send the buffers from", rank))
    return source


def _others_will_reduce(will_reduce: bool, group: Any) -> bool:
    """Whether any rank's backward in this iteration reduces (every rank must call it)."""
    flag = torch.tensor([1 if will_reduce else 0], dtype=torch.int32, device=comm.comm_device(group))
    comm.all_reduce(flag, group, dist.ReduceOp.MAX)
    return bool(flag.item())


def _driver_of(optimizer: Any) -> Optional[ModelJoinHook]:
    """The ``ShardedDataParallel`` hook that steps ``optimizer`` under ``Join``, if any."""
    driver = _stepped_by_model.get(optimizer)
    return None if driver is None else driver()
