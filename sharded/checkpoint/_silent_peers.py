"""Which peer a failed collective waited for, read from the peers' heartbeats.

A rank whose collective failed reads every peer's :class:`~._heartbeat.Heartbeat` twice, a few
beats apart. A peer whose beat did not move is frozen or dead; one that beats but has issued
fewer operations in its step (or is in an earlier step) is alive and stuck before the collective
the others wait in; one that raised an error of its own, or left its training loop, says so in its
last record. Peers that failed in the same collective as this rank are fellow victims, not named.
When none stands out, or the store does not answer, the account says that the rank cannot be known.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Optional

import torch.distributed as dist

from ._heartbeat import LEFT, PEER_FAILED, RAISED, RUNNING, Heartbeat, heartbeat_key

__all__ = ["Finding", "Sighting", "StoreSilent", "explain", "observe"]

STORE_GRACE_SECONDS = 2.0  # beyond the window, for the store's answers


@dataclasses.dataclass(frozen=True)
class Sighting:
    """A peer's heartbeat at the start and at the end of the observation window (``None``: no record)."""

    first: Optional[Heartbeat]
    last: Optional[Heartbeat]

    @property
    def beating(self) -> bool:
        return self.first is not None and self.last is not None and self.first.beat != self.last.beat


@dataclasses.dataclass(frozen=True)
class Finding:
    """The peers to blame (none where it cannot be known) and the sentence that says why."""

    silent_ranks: tuple[int, ...]
    account: str


class StoreSilent(Exception):
    """The rendezvous store did not answer in time, or failed; the message says which."""


def observe(store: dist.Store, ranks: list[int], window: float) -> dict[int, Sighting]:
    """Each of ``ranks``' heartbeat now and ``window`` seconds later. Raises :class:`StoreSilent`
    when the store fails or does not answer within ``window`` + a grace (a store served by a frozen
    rank's process never does, whatever its timeout: the reader is left behind, a daemon thread)."""
    result: dict[int, Sighting] = {}
    failure: list[BaseException] = []

    def read_twice() -> None:
        try:
            first = _read(store, ranks)
            time.sleep(window)
            last = _read(store, ranks)
        except Exception as error:  # whatever the store's client raises: reported, not hidden
            failure.append(error)
            return
        result.update({r: Sighting(first[r], last[r]) for r in ranks})

    reader = threading.Thread(target=read_twice, name="sharded-heartbeat-reader", daemon=True)
    reader.start()
    reader.join(window + STORE_GRACE_SECONDS)
    if failure:
        raise StoreSilent(f"failed: {type(failure[0]).__name__}: {str(failure[0]).strip()[:200]}")
    if len(result) < len(ranks):
        raise StoreSilent(f"did not answer within {window + STORE_GRACE_SECONDS:.1f} s either")
    return result


def _read(store: dist.Store, ranks: list[int]) -> dict[int, Optional[Heartbeat]]:
    return {r: Heartbeat.decode(store.get(heartbeat_key(r))) if store.check([heartbeat_key(r)]) else None
            for r in ranks}


def explain(me: Heartbeat, my_rank: int, sightings: Optional[dict[int, Sighting]], store_trouble: str = ""
            ) -> Finding:
    """Who this rank's failed collective waited for, given its own record and its peers'
    (``None``: the store could not be read, for the reason ``store_trouble``). That may be this
    rank itself: stuck long enough for its peers to give up on it, it fails when it comes back."""
    if sightings is None:
        return Finding((), (
            f"which rank did not answer cannot be known: the rendezvous store {store_trouble} (where a rank's "
            "process serves the store, as init_process_group's env:// does on rank 0, that rank is the likely one)"))
    waiting = [s.last for s in sightings.values() if s.last is not None and _waits_with_me(s)]
    furthest = max([me, *waiting], key=_position)
    blamed = {rank: _blame(rank, s, furthest) for rank, s in sorted(sightings.items())}
    named = {rank: why for rank, why in blamed.items() if why}
    if named:
        return Finding(tuple(named), "; ".join(named.values()))
    gave_up = [rank for rank, s in sorted(sightings.items()) if s.last and s.last.state == PEER_FAILED
               and _behind(me, s.last)]
    if gave_up:
        return Finding((my_rank,), (
            f"this rank is the one its peers waited for: rank(s) {gave_up} gave up on it further on than where it "
            f"is ({_in_step(me)}, {me.collectives} operations into it): it was busy elsewhere longer than the timeout"))
    unheard = [rank for rank, s in sightings.items() if s.last is None]
    if unheard:
        return Finding((), (
            f"which rank did not answer cannot be known: rank(s) {unheard} published no heartbeat "
            "(they had not entered detect_peer_failure())"))
    return Finding((), (
        "which rank did not answer cannot be known: every peer is alive and as far as this rank "
        "(the network or the backend may have lost a message)"))


def _waits_with_me(sighting: Sighting) -> bool:
    """A peer that failed in a collective as this rank did, or that still waits in one."""
    last = sighting.last
    return last is not None and (last.state == PEER_FAILED or (last.state == RUNNING and sighting.beating))


def _position(record: Heartbeat) -> tuple[int, int]:
    return (-1 if record.step is None else record.step, -1 if record.collectives is None else record.collectives)


def _blame(rank: int, sighting: Sighting, furthest: Heartbeat) -> str:
    """Why ``rank`` is the one the others waited for, or ``""`` if it is not."""
    last = sighting.last
    if last is None or last.state == PEER_FAILED:
        return ""
    if last.state == RAISED:
        return f"rank {rank} raised an error of its own first ({last.detail}); see its log"
    if last.state == LEFT:
        return (f"rank {rank} had left its training loop (detect_peer_failure's block) {_in_step(last)} while "
                "this rank still waited in a collective: the ranks did not run the same collectives")
    if not sighting.beating:
        return (f"rank {rank} stopped answering: its heartbeat stopped (the process is frozen, by SIGSTOP or "
                f"a debugger, or died); last seen {_in_step(last)}")
    if _behind(last, furthest):
        return (f"rank {rank} is alive but has not reached the collective the others wait in: it is "
                f"{_in_step(last)}, {last.collectives} operations into it, the furthest rank {_in_step(furthest)}, "
                f"{furthest.collectives} operations into it (a long computation, a deadlock, or code that "
                "skips a collective on that rank)")
    return ""


def _behind(record: Heartbeat, furthest: Heartbeat) -> bool:
    if record.step is not None and furthest.step is not None and record.step != furthest.step:
        return record.step < furthest.step
    if record.collectives is None or furthest.collectives is None:
        return False  # the backend keeps no count: a live rank in the same step cannot be placed
    return record.collectives < furthest.collectives


def _in_step(record: Heartbeat) -> str:
    return "in an unknown step" if record.step is None else f"in step {record.step}"
