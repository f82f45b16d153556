"""A rank that stops answering: the others stop within the timeout and a few seconds, naming it.

Each launch (world 3, a process group whose ``timeout`` is a few seconds) trains a step inside
``checkpoint.detect_peer_failure()``; in the next step, after its forward and before the backward's
first collective, the last rank either freezes (SIGSTOP: its process, heartbeat included, stops)
or gets stuck alive (a long sleep: its heartbeat goes on, its collectives do not). Layers 1-2
(ZeRO-1: torch DDP's reduces, issued from C++; ZeRO-2: ShardedDataParallel's) and layer 3
(``fully_shard``'s reduce-scatters) are covered. Every other rank must raise
:class:`~sharded.checkpoint.PeerFailure` naming that rank (``silent_ranks`` and the message), the
step and the timeout, within the timeout plus :data:`DETECTION_BOUND` seconds of the stop; the
harness fails any rank still running a few seconds after the first error, so a hang fails the
test. The time each survivor took is written beside the test's files (``rank-R.json``).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import time

import pytest

from sharded import checkpoint
from tests._harness import RankFailure, run_on_ranks
from tests._models import gpt_loss, token_batch
from tests.test_checkpoint_failures import PROCESS_GROUP_TIMEOUT, _regroup
from tests.test_checkpoint_resharding import build

WORLD = 3
# What telling the silent rank may add to the timeout: three heartbeats (half a second each at a
# 4 s timeout) and the store's answers; generous, for a loaded 2-core machine. A bound on hanging.
DETECTION_BOUND = 6.0
SCENARIOS = {  # (layer, how the last rank stops): the words the survivors must use for it
    ("zero1", "stuck"): f"rank {WORLD - 1} is alive but has not reached the collective the others wait in",
    ("zero2", "frozen"): f"rank {WORLD - 1} stopped answering: its heartbeat stopped",
    ("zero3", "frozen"): f"rank {WORLD - 1} stopped answering: its heartbeat stopped",
    ("zero3", "stuck"): f"rank {WORLD - 1} is alive but has not reached the collective the others wait in",
}


def _stop(how, out):
    """Freeze this process (SIGSTOP) or hang in it (a sleep the harness ends), noting when."""
    (out / "stopped").write_text(repr(time.time()))
    if how == "frozen":
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(10 * PROCESS_GROUP_TIMEOUT.total_seconds())


def _train_until_a_rank_stops(rank, world, store_path, out, layer, how):
    """Step 0 completes on every rank; the last rank stops in step 1, between forward and backward."""
    importlib.import_module("torch._dynamo")  # DDP's first build imports it: not under the short timeout
    _regroup(rank, world, store_path)
    _, wrapped, optimizer = build(layer)
    try:
        with checkpoint.detect_peer_failure() as peers:
            for step in range(2):
                peers.begin_step(step)
                optimizer.zero_grad()
                loss = gpt_loss(wrapped, token_batch(rank, step))
                if step == 1 and rank == world - 1:
                    _stop(how, out)
                loss.backward()
                optimizer.step()
    except checkpoint.PeerFailure as failure:
        elapsed = time.time() - float((out / "stopped").read_text())
        (out / f"rank-{rank}.json").write_text(json.dumps(dict(
            elapsed=elapsed, silent_ranks=failure.silent_ranks, step=failure.step,
            timeout=failure.timeout.total_seconds() if failure.timeout else None, message=str(failure))))
        raise
    raise AssertionError(f"rank {rank} finished although rank {world - 1} stopped")


@pytest.mark.parametrize(("layer", "how"), SCENARIOS)
def test_a_frozen_or_stuck_rank_is_named_by_the_others_within_the_timeout(tmp_path, layer, how):
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_train_until_a_rank_stops, WORLD, str(tmp_path / "store"), tmp_path, layer, how, timeout=60)
    assert "were still running" in str(failure.value), str(failure.value)
    timeout = PROCESS_GROUP_TIMEOUT.total_seconds()
    for rank in range(WORLD - 1):
        assert (tmp_path / f"rank-{rank}.json").exists(), str(failure.value)
        seen = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert seen["silent_ranks"] == [WORLD - 1], seen
        assert seen["step"] == 1 and seen["timeout"] == timeout, seen
        message = seen["message"]
        assert message.startswith(f"rank {rank}: {SCENARIOS[layer, how]}"), message
        assert "in step 1" in message and f"timeout of {timeout:g} s" in message, message
        assert seen["elapsed"] < timeout + DETECTION_BOUND, seen
