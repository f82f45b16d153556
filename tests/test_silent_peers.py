"""Telling which peer a failed collective waited for, from heartbeats: the logic on its own.

:func:`explain` gets this rank's record and what it saw of each peer's record at the start and the
end of its observation window; every way a peer can stand out (frozen, alive but behind in its
step or in an earlier step, raised an error of its own, left its loop) must be named, fellow
victims must not, and where nothing stands out, or the store does not answer, the account must say
that the rank cannot be known. One world-1 launch checks what ``detect_peer_failure`` publishes
(a step's record at once, collectives counted from the step, an own error's record and a normal
exit's) and what it refuses. The multi-rank behaviour is in tests/test_silent_rank.py.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from sharded import checkpoint
from sharded._common import peers
from sharded.checkpoint import _silent_peers
from sharded.checkpoint._heartbeat import LEFT, PEER_FAILED, RAISED, Heartbeat, beat_seconds, heartbeat_key
from sharded.checkpoint._silent_peers import Sighting, StoreSilent, explain, observe
from tests._harness import run_on_ranks

ME = Heartbeat(beat=9, step=4, collectives=12, state=PEER_FAILED, detail="Timed out waiting 4000ms")


def _seen(first_beat, **fields):
    """A peer whose beat moved from ``first_beat`` to 7 (still) or did not (``first_beat`` 7)."""
    last = Heartbeat(**{**dict(beat=7, step=4, collectives=12), **fields})
    return Sighting(Heartbeat(**{**last.__dict__, "beat": first_beat}), last)


FROZEN, BEATING = 7, 6


@pytest.mark.parametrize(("peer", "words"), [
    (_seen(FROZEN), "rank 1 stopped answering: its heartbeat stopped (the process is frozen, by SIGSTOP or a "
                    "debugger, or died); last seen in step 4"),
    (_seen(BEATING, collectives=9), "rank 1 is alive but has not reached the collective the others wait in: it "
                                    "is in step 4, 9 operations into it, the furthest rank in step 4, 12"),
    (_seen(BEATING, step=3, collectives=40), "rank 1 is alive but has not reached the collective the others wait "
                                             "in: it is in step 3"),
    (_seen(FROZEN, state=RAISED, detail="ValueError: bad batch"), "rank 1 raised an error of its own first "
                                                                  "(ValueError: bad batch)"),
    (_seen(FROZEN, state=LEFT, step=5), "rank 1 had left its training loop (detect_peer_failure's block) in "
                                        "step 5 while this rank still waited"),
])
def test_the_peer_that_stands_out_is_named_and_fellow_victims_are_not(peer, words):
    victims = {2: _seen(BEATING), 3: _seen(FROZEN, state=PEER_FAILED)}  # one still waits, one failed already
    finding = explain(ME, 0, {1: peer, **victims})
    assert finding.silent_ranks == (1,)
    assert finding.account.startswith(words), finding.account


def test_every_silent_peer_is_named():
    finding = explain(ME, 0, {1: _seen(FROZEN), 2: _seen(BEATING), 3: _seen(BEATING, collectives=3)})
    assert finding.silent_ranks == (1, 3)
    assert "rank 1 stopped answering" in finding.account and "; rank 3 is alive but" in finding.account


def test_a_rank_whose_peers_gave_up_on_it_names_itself_when_it_comes_back():
    me = Heartbeat(beat=9, step=4, collectives=3, state=PEER_FAILED)  # slept past the timeout in step 4
    gave_up = {1: _seen(FROZEN, state=PEER_FAILED), 2: _seen(FROZEN, state=PEER_FAILED, step=4, collectives=5)}
    finding = explain(me, 0, gave_up)
    assert finding.silent_ranks == (0,)
    assert finding.account.startswith("this rank is the one its peers waited for: rank(s) [1, 2] gave up on it "
                                      "further on than where it is (in step 4, 3 operations into it)"), finding.account
    assert explain(ME, 0, gave_up).silent_ranks == ()  # as far as they are: not the one


def test_a_peer_counts_as_behind_against_the_furthest_waiting_rank_not_only_this_one():
    me = Heartbeat(beat=9, step=4, collectives=5, state=PEER_FAILED)  # failed at once: the others got further
    finding = explain(me, 0, {1: _seen(BEATING, collectives=12), 2: _seen(BEATING, collectives=8)})
    assert finding.silent_ranks == (2,) and "the furthest rank in step 4, 12 operations" in finding.account


@pytest.mark.parametrize(("sightings", "words"), [
    ({1: _seen(BEATING), 2: _seen(FROZEN, state=PEER_FAILED)},
     "which rank did not answer cannot be known: every peer is alive and as far as this rank"),
    ({1: _seen(BEATING), 2: Sighting(None, None)},
     "which rank did not answer cannot be known: rank(s) [2] published no heartbeat"),
    ({1: _seen(BEATING, collectives=None)},  # a backend without a count: a live peer cannot be placed
     "which rank did not answer cannot be known: every peer is alive"),
])
def test_it_says_when_the_rank_cannot_be_known(sightings, words):
    finding = explain(ME, 0, sightings)
    assert finding.silent_ranks == () and finding.account.startswith(words), finding.account


def test_a_store_that_does_not_answer_or_fails_is_given_up_and_said_so(monkeypatch):
    released = threading.Event()

    class FrozenStore:  # as a TCPStore served from a frozen rank's process behaves: check never returns
        def check(self, keys):
            released.wait()
            return False

    class GoneStore:
        def check(self, keys):
            raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(_silent_peers, "STORE_GRACE_SECONDS", 0.2)
    with pytest.raises(StoreSilent, match=r"^did not answer within 0\.3 s either$") as silent:
        observe(FrozenStore(), [1], window=0.1)
    released.set()
    finding = explain(ME, 0, None, str(silent.value))
    assert finding.silent_ranks == () and finding.account.startswith(
        "which rank did not answer cannot be known: the rendezvous store did not answer within 0.3 s either"), finding
    with pytest.raises(StoreSilent, match=r"^failed: RuntimeError: Connection reset by peer$"):
        observe(GoneStore(), [1], window=0.1)


def test_a_heartbeat_survives_the_store_and_its_beat_stays_within_the_bounds():
    record = Heartbeat(beat=3, step=None, collectives=None, state=RAISED, detail="KeyError: 'x'")
    assert Heartbeat.decode(record.encode()) == record
    assert [beat_seconds(t) for t in (None, _seconds(0.5), _seconds(4), _seconds(20))] == [1.0, 0.1, 0.5, 1.0]


def _seconds(value):
    return datetime.timedelta(seconds=value)


def test_backend_errors_are_told_apart():
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation")
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection reset by peer")
    wrapped = ValueError("while stepping")
    wrapped.__cause__ = timeout
    assert peers.peer_failure_in(wrapped) is timeout and peers.is_timeout(timeout)
    assert peers.peer_failure_in(reset) is reset and not peers.is_timeout(reset)
    assert peers.peer_failure_in(ValueError("a bug on this rank")) is None


def _record(rank):
    store = peers.rendezvous_store()
    return Heartbeat.decode(store.get(heartbeat_key(rank)))


def _check_what_is_published_and_refused(rank, world):
    with checkpoint.detect_peer_failure() as watch:
        with pytest.raises(RuntimeError, match=r"rank 0: detect_peer_failure\(\) is already active"):
            with checkpoint.detect_peer_failure():
                pass
        dist.all_reduce(torch.ones(1))
        watch.begin_step(7)
        assert (_record(0).step, _record(0).collectives) == (7, 0)
        dist.all_reduce(torch.ones(1))
        dist.broadcast(torch.ones(1), 0)
        assert watch._publisher.current().collectives == 2
    assert _record(0).state == LEFT and _record(0).step == 7
    with pytest.raises(RuntimeError, match=r"rank 0: begin_step\(8\) after detect_peer_failure\(\)'s block ended"):
        watch.begin_step(8)
    with pytest.raises(KeyError, match="a bug"):  # passes through unchanged, and peers are told
        with checkpoint.detect_peer_failure():
            raise KeyError("a bug")
    assert _record(0).state == RAISED and _record(0).detail == "KeyError: 'a bug'"


def test_detect_peer_failure_publishes_steps_and_endings_and_refuses_nesting():
    with pytest.raises(RuntimeError, match=r"rank 0: detect_peer_failure\(\) needs the process group"):
        with checkpoint.detect_peer_failure():
            pass
    run_on_ranks(_check_what_is_published_and_refused, 1)
