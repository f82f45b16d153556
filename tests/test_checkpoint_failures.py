"""A rank that dies: the others stop within the process group's timeout with a clear error, and
no partial checkpoint ever becomes visible.

Each launch trains ZeRO-2 for a step and saves a checkpoint, in a process group whose ``timeout``
is a few seconds (as a user passes it to ``init_process_group``). In the next step the last rank
fails: SIGKILL during backward, SIGSTOP during backward (a hung peer: only
the timeout can tell), or SIGKILL inside a save, after writing its data but before the index.
Every other rank must raise :class:`PeerFailure` naming itself, the failed rank (its heartbeat
stopped; tests/test_silent_rank.py covers the other ways a rank stops answering) and the step;
the harness fails any rank still running a few seconds later, so a hang fails the test. Then the latest checkpoint must be the
last complete one, and it must load (in this one process, which resharding allows, to spare a
launch) and hold what was saved. There is no world-1 case: a peer is needed.
"""

from __future__ import annotations

import datetime
import os
import re
import signal

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from sharded import checkpoint
from tests._harness import RankFailure, run_on_ranks
from tests.test_checkpoint_resharding import assert_full_equal, build, load_into, save_with_reference, train

# Long enough for a loaded 2-core machine's slowest collective, short enough for a test. DCP is
# imported with this module, before the short-timeout group exists, so its import cannot time out.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=4)
# How long after the first rank's error the others may take to raise theirs. A rank whose pending
# collective waits on a live peer rather than on the dead one learns of the death only at its own
# timeout: the first to notice (its pair with the dead rank closed) may report 4 s earlier. The
# harness's default 3 s then failed a rank that was about to raise correctly (about one launch in
# fifteen at world 3, killed in backward); a rank still running 4 s past the timeout is a hang.
GRACE = PROCESS_GROUP_TIMEOUT.total_seconds() + 4.0


def _regroup(rank, world, store_path):
    """Replace the harness's process group by one with a short timeout, as a user would make it.

    The barrier first: creating a gloo group does not wait for every peer to finish connecting,
    and a rank that destroyed its group at once made a slower peer's init fail with "Connection
    closed by peer" (seen about once in fifteen launches)."""
    dist.barrier()
    dist.destroy_process_group()
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)


def _fail_during_backward(model, how):
    """Make this rank die (SIGKILL) or hang (SIGSTOP) when its head gradient is computed."""
    return model.head.weight.register_hook(lambda grad: os.kill(os.getpid(), how))


def _fail_inside_the_next_save():
    """SIGKILL this rank inside DCP's save, once its data file is written but no index is."""
    write = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        write(self, plan, planner).wait()
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.write_data = write_then_die


def _train_until_a_rank_fails(rank, world, store_path, root, scenario):
    """Step 1 and its checkpoint complete; the last rank fails in step 2 or in its checkpoint."""
    _regroup(rank, world, store_path)
    model, wrapped, optimizer = build("zero2")
    with checkpoint.detect_peer_failure() as peers:
        peers.begin_step(0)
        train(wrapped, optimizer, rank, 1)
        save_with_reference(wrapped, optimizer, root / "step-1", rank)
        if rank == world - 1 and scenario == "killed-while-saving":
            _fail_inside_the_next_save()
        elif rank == world - 1:
            _fail_during_backward(model, signal.SIGKILL if scenario == "killed-in-backward" else signal.SIGSTOP)
        peers.begin_step(1)
        train(wrapped, optimizer, rank, 1, first=1)
        checkpoint.save(checkpoint.get_state_dict(wrapped, optimizer), root / "step-2")
        train(wrapped, optimizer, rank, 1, first=2)
    raise AssertionError(f"rank {rank} finished although rank {world - 1} failed")


def _assert_resumes_from(latest):
    model, _, optimizer = build("plain", seed=1)
    load_into(model, optimizer, latest)
    reference = torch.load(f"{latest}.pt", weights_only=True)
    assert_full_equal(checkpoint.get_state_dict(model, optimizer, full=True), reference, f"resumed from {latest}")


SCENARIOS = {  # scenario: how the harness reports the failing rank
    "killed-in-backward": "died",
    "hung-in-backward": "were still running",
    "killed-while-saving": "died",
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_dead_or_hung_rank_stops_the_others_and_leaves_the_last_checkpoint(tmp_path, world_size, scenario):
    root = tmp_path / "checkpoints"
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_train_until_a_rank_fails, world_size, str(tmp_path / "store"), root, scenario, timeout=60, grace=GRACE)
    report = str(failure.value)
    assert SCENARIOS[scenario] in report, report
    for rank in range(world_size - 1):
        named = rf"PeerFailure: rank {rank}: rank {world_size - 1} stopped answering: [^\n]*last seen in step 1\. "
        assert re.search(rf"rank {rank} error:[\s\S]*{named}This rank [^\n]* in step 1 ", report), report
    assert checkpoint.latest_checkpoint(root) == root / "step-1"
    assert (root / ".step-2.partial").is_dir() == (scenario == "killed-while-saving")
    _assert_resumes_from(root / "step-1")
