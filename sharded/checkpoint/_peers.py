"""When a peer rank dies: fail fast, say so, and let the job restart from a checkpoint.

A collective cannot finish without every rank. If one is killed, the others notice in their next
collective: at once when the backend sees the dead rank's connections close (gloo: "Connection
reset by peer"), or when the process group's ``timeout`` expires if the peer hangs instead. Both
surface as backend errors that do not say what happened in training terms; the context manager
here re-raises them as :class:`PeerFailure`, which does. The process must then exit: a process
group that saw a failed collective is unusable (a later collective can hang), so no checkpoint
can be saved from it; the last complete one is where the restarted job resumes.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch.distributed as dist

from .._common.errors import on_rank

__all__ = ["PeerFailure", "detect_peer_failure"]

# Backend errors that mean a peer is gone or unresponsive, not a bug on this rank.
_PEER_FAILURE_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Connection refused",
    "Broken pipe",
    "Application timeout",  # gloo: a peer did not answer within the process group's timeout
    "Timed out waiting",  # the same, in older gloo
    "Socket Timeout",  # the rendezvous store
)


class PeerFailure(RuntimeError):
    """A collective failed because another rank died, hung past the process group's timeout, or
    became unreachable. Exit this process; do not run further collectives in it."""


@contextlib.contextmanager
def detect_peer_failure() -> Iterator[None]:
    """Re-raise, inside the block, an error caused by a failed peer as :class:`PeerFailure`.

    Wrap the training loop in it. Set the detection time with ``init_process_group(timeout=...)``
    (gloo's default is 30 minutes). Other errors pass through unchanged.
    """
    try:
        yield
    except Exception as error:
        cause = _peer_failure_in(error)
        if cause is None:
            raise
        raise PeerFailure(on_rank(
            f"a peer rank failed (it died, hung past the process group's timeout, or "
            f"became unreachable): {_first_line(cause)}. This rank stops too; restart the job "
            "(torchrun --max-restarts does) to resume from the last complete checkpoint"
        )) from error


def _peer_failure_in(error: BaseException) -> Optional[BaseException]:
    """The error in ``error``'s chain that reports a failed peer, if any."""
    seen: Optional[BaseException] = error
    while seen is not None:
        if isinstance(seen, PeerFailure):
            return None
        distributed_error = getattr(dist, "DistError", None)
        backend_failure = distributed_error is not None and isinstance(seen, distributed_error)
        if backend_failure or any(marker in str(seen) for marker in _PEER_FAILURE_MARKERS):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
