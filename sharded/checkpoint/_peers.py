"""When a peer rank dies or stops answering: fail fast, say which rank, and let the job restart
from a checkpoint.

A collective cannot finish without every rank. If one is killed, the others notice in their next
collective: at once when the backend sees the dead rank's connections close, or when the process
group's ``timeout`` expires if the peer is frozen or stuck instead. Either way the backend's error
names no rank (gloo: "Timed out waiting 20000ms for recv operation to complete"). Inside
:func:`detect_peer_failure` every rank publishes a heartbeat in the rendezvous store
(:mod:`._heartbeat`); on such an error this rank reads its peers' (:mod:`._silent_peers`) and raises
:class:`PeerFailure` naming the rank it waited for (or saying that it cannot be known), the step,
and the timeout to raise. The process must then exit: a process group that saw a failed
collective is unusable (a later collective can hang), so no checkpoint can be saved from it; the
last complete one is where the restarted job resumes.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Iterator, Optional

import torch.distributed as dist

from .._common import peers
from .._common.errors import on_rank
from ._heartbeat import LEFT, PEER_FAILED, RAISED, HeartbeatPublisher, beat_seconds
from ._silent_peers import StoreSilent, explain, observe

__all__ = ["PeerFailure", "PeerWatch", "detect_peer_failure"]

BEATS_OBSERVED = 3  # a live peer beats at least once in this many periods, even on a loaded machine


class PeerFailure(RuntimeError):
    """A collective failed because another rank died, stopped answering within the process
    group's timeout, or became unreachable. Exit this process; do not run further collectives in it.

    ``silent_ranks``: the global ranks it waited for (empty when that cannot be known);
    ``step``: this rank's step (``None`` if the loop never called :meth:`PeerWatch.begin_step`);
    ``timeout``: the process group's timeout (``None`` where the backend does not say)."""

    def __init__(self, message: str, silent_ranks: tuple[int, ...] = (), step: Optional[int] = None,
                 timeout: Optional[datetime.timedelta] = None) -> None:
        super().__init__(message)
        self.silent_ranks, self.step, self.timeout = silent_ranks, step, timeout


class PeerWatch:
    """What :func:`detect_peer_failure` yields: tell it where the training loop is."""

    def __init__(self, publisher: HeartbeatPublisher) -> None:
        self._publisher = publisher

    def begin_step(self, step: int) -> None:
        """Step ``step`` begins. A :class:`PeerFailure` names it, and peers compare how far each
        rank got from here (call it at the top of every step, on every rank)."""
        self._publisher.begin_step(step)


_active: Optional[PeerWatch] = None


@contextlib.contextmanager
def detect_peer_failure() -> Iterator[PeerWatch]:
    """Re-raise, inside the block, an error caused by a failed or silent peer as :class:`PeerFailure`.

    Wrap the training loop in it, after ``init_process_group``, and call ``begin_step(step)`` on
    what it yields at the top of each step. Set the detection time with
    ``init_process_group(timeout=...)`` (gloo's default is 30 minutes); telling which peer stopped
    takes a few seconds more (three heartbeats: an eighth of the timeout each, at most 1 s). Other
    errors pass through unchanged, and peers are told this rank raised them.
    """
    global _active
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(on_rank("detect_peer_failure() needs the process group: call init_process_group first"))
    if _active is not None:
        raise RuntimeError(on_rank("detect_peer_failure() is already active in this process: wrap the training "
                                   "loop in it once"))
    timeout = peers.process_group_timeout()
    publisher = HeartbeatPublisher(peers.rendezvous_store(), dist.get_rank(), beat_seconds(timeout))
    _active = watch = PeerWatch(publisher)
    try:
        yield watch
    except BaseException as error:  # KeyboardInterrupt and SystemExit too: peers are told this rank raised
        cause = peers.peer_failure_in(error, stop_at=PeerFailure)
        if cause is None:
            publisher.finish(RAISED, f"{type(error).__name__}: {_first_line(error)}"[:300])
            raise
        raise _explained(publisher, cause, timeout) from error
    else:
        publisher.finish(LEFT)
    finally:
        _active = None


def _explained(publisher: HeartbeatPublisher, cause: BaseException, timeout: Optional[datetime.timedelta]
               ) -> PeerFailure:
    """The :class:`PeerFailure` for ``cause``: whom this rank waited for, at which step, and what to do."""
    me = publisher.finish(PEER_FAILED, _first_line(cause)[:300])
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        sightings = observe(peers.rendezvous_store(), [r for r in range(world) if r != rank],
                            BEATS_OBSERVED * beat_seconds(timeout))
        finding = explain(me, rank, sightings)
    except StoreSilent as trouble:
        finding = explain(me, rank, None, str(trouble))
    seconds = "" if timeout is None else f" of {timeout.total_seconds():g} s"
    waited = "waited" if peers.is_timeout(cause) else "was"
    step = ("in an unknown step (call begin_step(step) on what detect_peer_failure() yields to have it named)"
            if me.step is None else f"in step {me.step}")
    ranks = finding.silent_ranks
    culprit = "a peer" if not ranks else ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
    message = (
        f"{finding.account}. This rank {waited} in a collective {step} when it failed: {_first_line(cause)}. "
        f"The process group's timeout{seconds} (init_process_group(timeout=...)) bounds "
        f"how long {culprit} may go without joining a collective: raise it if that can legitimately take longer "
        "(a long save, a first compile). This rank stops too; restart the job (torchrun --max-restarts does) "
        "to resume from the last complete checkpoint")
    return PeerFailure(on_rank(message), finding.silent_ranks, me.step, timeout)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
