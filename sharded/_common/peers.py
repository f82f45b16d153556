"""What the backend tells a rank about its peers: which errors mean a peer failed, how long a
collective waits for one, how far this rank has got, and where ranks can leave word for each other.

Backend quirks live here only. gloo words a peer that hung past the process group's timeout as
"Timed out waiting 20000ms for recv operation to complete" and a dead one as "Connection reset by
peer"; neither says which rank. The rest of sharded asks the questions below and never parses a
backend's message itself.
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

__all__ = [
    "collectives_issued",
    "is_timeout",
    "peer_failure_in",
    "process_group_timeout",
    "rendezvous_store",
]

# Backend errors that mean a peer is gone or unresponsive, not a bug on this rank.
_PEER_FAILURE_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Connection refused",
    "Broken pipe",
)
_TIMEOUT_MARKERS = (
    "Application timeout",  # gloo: a peer did not answer within the process group's timeout
    "Timed out waiting",  # the same, in older gloo
    "Socket Timeout",  # the rendezvous store
)


def peer_failure_in(error: BaseException, stop_at: type = type(None)) -> Optional[BaseException]:
    """The error in ``error``'s chain (causes and contexts) that reports a failed or silent peer,
    if any. The walk stops at an instance of ``stop_at`` (an error already explained)."""
    seen: Optional[BaseException] = error
    while seen is not None:
        if isinstance(seen, stop_at):
            return None
        distributed_error = getattr(dist, "DistError", None)
        backend_failure = distributed_error is not None and isinstance(seen, distributed_error)
        if backend_failure or any(marker in str(seen) for marker in _PEER_FAILURE_MARKERS + _TIMEOUT_MARKERS):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` says a peer did not answer in time (rather than that it went away)."""
    return any(marker in str(error) for marker in _TIMEOUT_MARKERS)


def collectives_issued(group: Optional[dist.ProcessGroup] = None) -> Optional[int]:
    """How many operations this rank has issued on ``group`` (default: the world), counted by the
    backend itself, so collectives torch's DDP issues from C++ count too. ``None`` where the
    backend keeps no count or the group is gone. Point-to-point sends and receives count on the two
    ranks involved only."""
    if group is None and not dist.is_initialized():
        return None
    process_group = group or dist.distributed_c10d._get_default_group()
    count = getattr(process_group, "_get_sequence_number_for_group", None)  # private, as torch's own users call it
    try:
        return None if count is None else int(count())
    except RuntimeError:
        return None


def process_group_timeout(group: Optional[dist.ProcessGroup] = None) -> Optional[datetime.timedelta]:
    """How long a collective on ``group`` waits for a peer before failing (``init_process_group``'s
    ``timeout``), or ``None`` where the backend does not say."""
    process_group = group or dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            backend = process_group._get_backend(torch.device(device))
        except RuntimeError:
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


def rendezvous_store() -> dist.Store:
    """The key-value store the default process group was made with (torchrun's, or the one passed
    to ``init_process_group``), reachable from every rank without a collective."""
    return dist.distributed_c10d._get_default_store()
