"""Each rank's sign of life in the rendezvous store: where it is (step, collectives into the step)
and whether it still runs, so that a rank whose collective timed out can tell which peer stopped.

A background thread rewrites this rank's :class:`Heartbeat` every ``beat_seconds``: a counter that
moves while the process runs, its step, and how many operations it has issued on the default
process group since the step began (the backend's own count, so DDP's reduces count too). A
frozen process (SIGSTOP, a debugger) stops beating; a live rank stuck in its own code keeps
beating but its count stops short of the collective the others wait in. When this rank fails or
leaves, the last record says so, so peers do not mistake a rank that exited after its own error
for a silent one.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import threading
from typing import Optional

import torch.distributed as dist

from .._common import peers
from .._common.errors import on_rank

__all__ = ["Heartbeat", "HeartbeatPublisher", "beat_seconds", "heartbeat_key"]

RUNNING, PEER_FAILED, RAISED, LEFT = "running", "peer failed", "raised", "left"


def heartbeat_key(rank: int) -> str:
    return f"sharded/heartbeat/{rank}"


def beat_seconds(timeout: Optional[datetime.timedelta]) -> float:
    """Seconds between beats: an eighth of the timeout, within [0.1, 1]. Telling a frozen peer
    from a live one takes a few beats, so the beat bounds what detection adds to the timeout."""
    if timeout is None:
        return 1.0
    return min(1.0, max(0.1, timeout.total_seconds() / 8))


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """One rank's record. ``beat`` moves while the process runs; ``collectives`` counts what it
    issued on the default group since ``step`` began (``None``: the backend keeps no count);
    ``state`` is running, peer failed, raised (an error of its own, in ``detail``) or left."""

    beat: int
    step: Optional[int]
    collectives: Optional[int]
    state: str = RUNNING
    detail: str = ""

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> "Heartbeat":
        """From :meth:`encode`'s text, or the bytes the store gives it back as."""
        return cls(**json.loads(raw))


class HeartbeatPublisher:
    """Writes this rank's :class:`Heartbeat` to the store every ``period`` seconds, on a daemon
    thread, until :meth:`finish`. The training loop moves it on with :meth:`begin_step`."""

    def __init__(self, store: dist.Store, rank: int, period: float) -> None:
        self._store, self._key, self._period = store, heartbeat_key(rank), period
        self._lock = threading.Lock()
        self._beat = 0
        self._step: Optional[int] = None
        self._step_base = peers.collectives_issued()
        self._stopped = threading.Event()
        self._publish()
        self._thread = threading.Thread(target=self._run, name="sharded-heartbeat", daemon=True)
        self._thread.start()

    def begin_step(self, step: int) -> None:
        """Step ``step`` begins: collectives are counted from here, and peers see it at once."""
        if self._stopped.is_set():
            raise RuntimeError(on_rank(f"begin_step({step}) after detect_peer_failure()'s block ended: call it "
                                       "inside the block"))
        with self._lock:
            self._step, self._step_base = step, peers.collectives_issued()
        self._publish()

    def current(self, state: str = RUNNING, detail: str = "") -> Heartbeat:
        """This rank's record now."""
        issued = peers.collectives_issued()
        with self._lock:
            into_step = None if issued is None or self._step_base is None else issued - self._step_base
            return Heartbeat(self._beat, self._step, into_step, state, detail)

    def finish(self, state: str, detail: str = "") -> Heartbeat:
        """Stop beating and leave ``state`` as the last word; returns that record. Best effort: a
        store already gone (the process group destroyed) does not hide the error being raised."""
        self._stopped.set()
        self._thread.join(timeout=self._period + 1.0)
        record = self.current(state, detail)
        try:
            self._store.set(self._key, record.encode())
        except (RuntimeError, OSError):
            pass
        return record

    def _run(self) -> None:
        while not self._stopped.wait(self._period):
            try:
                self._publish()
            except (RuntimeError, OSError):
                return  # the store is gone: the process group was destroyed or its host died

    def _publish(self) -> None:
        with self._lock:
            self._beat += 1
        self._store.set(self._key, self.current().encode())
