"""Low-bit error-feedback residuals in a checkpoint: each rank's own, under its world size.

A residual is what a rank's last low-bit message rounded away, kept to be added to its next one
(:mod:`sharded._common.lowbit.feedback`). It belongs to that rank at that world size: it is saved
under ``lowbit.world{W}_rank{r}`` and loaded back by rank ``r`` of a run at the same world size
only, so a resumed run sends the bits the uninterrupted one would have. At another world size the
gradients split otherwise and no rank's residual fits: they are dropped with a log line saying
how many, and every message starts without one (the rounding of one step is lost, no more).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

from torch import nn

from .._common.errors import on_rank
from .._common.lowbit import ErrorFeedback
from ..sharded_ddp import ShardedDataParallel
from ._paths import LoadIfSaved

__all__ = ["lowbit_entry", "set_lowbit_entry"]

log = logging.getLogger("sharded.lowbit")


def _residual_store(model: nn.Module) -> Optional[tuple[ErrorFeedback, int, int]]:
    """The wrapper's residuals, its world size and its rank; ``None`` where it keeps none."""
    if isinstance(model, ShardedDataParallel) and model.lowbit is not None and model.lowbit.error_feedback:
        return model.lowbit_residuals, model.world_size, model.rank
    return None


def lowbit_entry(model: nn.Module) -> Optional[dict[str, Any]]:
    """The ``"lowbit"`` entry of the sharded state dict: how many residuals each rank keeps, by
    world size, and this rank's residuals by message name (live tensors); ``None`` without any.
    Both parts load only where saved, so a checkpoint without them loads too."""
    store = _residual_store(model)
    if store is None:
        return None
    feedback, world, rank = store
    return {
        "counts": LoadIfSaved({f"world{world}": len(feedback)}),
        f"world{world}_rank{rank}": LoadIfSaved(feedback.state_dict()),
    }


def set_lowbit_entry(model: nn.Module, entry: Optional[Mapping[str, Any]]) -> None:
    """Give the wrapper this rank's saved residuals (those of its world size; none saved: it
    starts without), and log the residuals saved at another world size that are dropped."""
    store = _residual_store(model)
    if store is None or entry is None:
        return
    feedback, world, rank = store
    feedback.load_state_dict(dict(entry.get(f"world{world}_rank{rank}", {})))
    elsewhere = {key: int(count) for key, count in entry.get("counts", {}).items() if key != f"world{world}" and int(count)}
    for key, count in elsewhere.items():
        saved_world = int(key.removeprefix("world"))
        log.warning(on_rank(
            f"low-bit: the checkpoint's error-feedback residuals were saved at world size {saved_world} "
            f"({count} per rank, {count * saved_world} in all); at world size {world} they do not apply and "
            "are dropped: every message starts without one", rank))
