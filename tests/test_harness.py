"""The multi-rank harness itself: results, failures and hangs are reported, never swallowed."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._harness import (ABORT_AT_EXIT, AbortAtExitRetried, GlooThreadCrashRetried, RankFailure,
                            assert_same_on_all_ranks, run_job, run_on_ranks)


def _rank_and_sum(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, world, t.item()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_come_back_in_rank_order(world_size):
    total = sum(range(world_size))
    assert run_on_ranks(_rank_and_sum, world_size) == [(r, world_size, total) for r in range(world_size)]


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("the root cause")
    dist.barrier()  # rank 0 is left waiting for rank 1


def test_an_exception_names_its_rank_and_comes_first():
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_fail_on_rank_one, 2, timeout=30)
    message = str(failure.value)
    assert message.startswith("rank 1 error:")
    assert "ValueError: the root cause" in message


def _hang_on_rank_one(rank, world):
    if rank == 1:
        time.sleep(3600)
    dist.barrier()


def test_a_hang_fails_at_the_deadline_and_names_the_stuck_ranks():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[0, 1\] were still running after 5 s"):
        run_on_ranks(_hang_on_rank_one, 2, timeout=5)
    assert time.monotonic() - start < 30


def _differ_on_last_rank(rank, world):
    assert_same_on_all_ranks([torch.ones(3)], "same")
    with pytest.raises(AssertionError, match=rf"tensor 0 differs between rank 0 and ranks \[{world - 1}\]"):
        assert_same_on_all_ranks([torch.full((3,), float(rank == world - 1))], "different")


def test_assert_same_on_all_ranks_spots_the_odd_rank():
    run_on_ranks(_differ_on_last_rank, 3)


def test_back_to_back_launches_do_not_collide():
    for _ in range(3):
        assert len(run_on_ranks(_rank_and_sum, 2)) == 2


# ------------------------------------------------------------- gloo's abort at exit, and others


def _count_launch(log):
    """Rank 1 appends a line per launch; returns how many launches came before this one."""
    earlier = len(open(log).readlines()) if os.path.exists(log) else 0
    with open(log, "a") as f:
        f.write("launch\n")
    return earlier


def _teardown_dies_on_rank_one(rank, world, log, launches_that_die, how):
    """Rank 1's teardown (the harness's destroy_process_group, after the body returned) dies
    ``how`` in its first ``launches_that_die`` launches, as gloo's abort at exit does."""
    if rank == 1 and _count_launch(log) < launches_that_die:
        dist.destroy_process_group = how
    return rank


def _abort(*args, **kwargs):
    os.abort()


def _exit_seven(*args, **kwargs):
    os._exit(7)


def test_an_abort_after_the_body_returned_is_retried_once_and_said(tmp_path, capsys):
    log = str(tmp_path / "launches")
    with pytest.warns(AbortAtExitRetried, match=r"rank 1 reported success, then died of SIGABRT"):
        assert run_on_ranks(_teardown_dies_on_rank_one, 2, log, 1, _abort) == [0, 1]
    assert len(open(log).readlines()) == 2
    assert "retrying the launch once" in capsys.readouterr().err


def test_an_abort_after_the_body_in_every_launch_fails_after_one_retry(tmp_path):
    log = str(tmp_path / "launches")
    with pytest.warns(AbortAtExitRetried), pytest.raises(RankFailure, match=r"died of SIGABRT[\s\S]*retried once only"):
        run_on_ranks(_teardown_dies_on_rank_one, 2, log, 99, _abort)
    assert len(open(log).readlines()) == 2


def test_any_other_death_after_the_body_fails_without_retry(tmp_path):
    log = str(tmp_path / "launches")
    with pytest.raises(RankFailure, match=r"rank 1 reported success, then exited with code 7"):
        run_on_ranks(_teardown_dies_on_rank_one, 2, log, 99, _exit_seven)
    assert len(open(log).readlines()) == 1


def _abort_in_the_body_on_rank_one(rank, world, log):
    if rank == 1:
        _count_launch(log)
        os.abort()


def test_an_abort_inside_the_body_fails_without_retry(tmp_path):
    log = str(tmp_path / "launches")
    with pytest.raises(RankFailure, match=r"rank 1 died:\nexited with code -6 before reporting a result"):
        run_on_ranks(_abort_in_the_body_on_rank_one, 2, log, timeout=30)
    assert len(open(log).readlines()) == 1


def _heap_crash_on_rank_one(rank, world, log, launches_that_crash):
    """Rank 1 dies as torch's gloo-thread crash does (glibc's message, then SIGABRT) in its first
    ``launches_that_crash`` launches; rank 0 then fails only because its peer went away."""
    if rank == 1 and _count_launch(log) < launches_that_crash:
        os.write(2, b"malloc(): unaligned tcache chunk detected\n")
        os.abort()
    dist.barrier()
    return rank


def test_torchs_gloo_thread_crash_is_retried_once_and_said(tmp_path, capfd):
    log = str(tmp_path / "launches")
    with pytest.warns(GlooThreadCrashRetried, match=r"rank 1 exited with code -6 before reporting a result, on a gloo worker thread"):
        assert run_on_ranks(_heap_crash_on_rank_one, 2, log, 1, timeout=30) == [0, 1]
    assert len(open(log).readlines()) == 2
    err = capfd.readouterr().err
    assert "retrying the launch once" in err
    assert "unaligned tcache chunk" in err, "the rank's own stderr is echoed"


def test_torchs_gloo_thread_crash_in_every_launch_fails_after_one_retry(tmp_path):
    log = str(tmp_path / "launches")
    with pytest.warns(GlooThreadCrashRetried), pytest.raises(RankFailure, match=r"exited with code -6[\s\S]*retried once only"):
        run_on_ranks(_heap_crash_on_rank_one, 2, log, 99, timeout=30)
    assert len(open(log).readlines()) == 2


def _segfault_on_the_main_thread(rank, world, log):
    if rank == 1:
        _count_launch(log)
        os.kill(os.getpid(), signal.SIGSEGV)


def test_a_segfault_on_a_python_thread_fails_without_retry(tmp_path):
    """The fault handler names the main thread as the faulting one: not gloo's crash, no retry."""
    log = str(tmp_path / "launches")
    with pytest.raises(RankFailure, match=r"rank 1 died:\nexited with code -11 before reporting a result"):
        run_on_ranks(_segfault_on_the_main_thread, 2, log, timeout=30)
    assert len(open(log).readlines()) == 1


# ------------------------------------------- the same abort in a job started as a subprocess


_JOB = """
import os, sys
log = os.path.join(os.path.dirname(__file__), "runs")
earlier = len(open(log).readlines()) if os.path.exists(log) else 0
open(log, "a").write("run\\n")
out = os.path.join(os.path.dirname(__file__), "out")
os.makedirs(out, exist_ok=True)
assert not os.path.exists(os.path.join(out, "written")), "the folder the job writes was not put back"
open(os.path.join(out, "written"), "w").write("a checkpoint")
if earlier < int(sys.argv[1]):
    if sys.argv[2] == "raise":
        raise ValueError("a bug in the job")
    print({abort!r}, file=sys.stderr, flush=True)
    os.abort()
print("done")
"""


def _job(tmp_path, failing_runs: int, how: str) -> tuple[list[str], Path, Path]:
    """A one-process job under ``tmp_path/examples`` whose first ``failing_runs`` runs fail ``how``
    after writing into a folder it requires empty: its command, its log of runs, that folder."""
    script = tmp_path / "examples" / "job.py"
    script.parent.mkdir()
    script.write_text(_JOB.format(abort=ABORT_AT_EXIT))
    return [sys.executable, str(script), str(failing_runs), how], script.parent / "runs", script.parent / "out"


def test_a_job_that_only_aborted_at_exit_runs_once_more_and_says_so(tmp_path):
    command, runs, out = _job(tmp_path, 1, "abort")
    with pytest.warns(AbortAtExitRetried, match="job.py: .*running the job once more"):
        assert run_job(command, cwd=tmp_path, writes=out).stdout == "done\n"
    assert len(runs.read_text().splitlines()) == 2


def test_a_job_that_aborts_at_exit_twice_fails(tmp_path):
    command, runs, out = _job(tmp_path, 99, "abort")
    with pytest.warns(AbortAtExitRetried), pytest.raises(AssertionError, match=ABORT_AT_EXIT):
        run_job(command, cwd=tmp_path, writes=out)
    assert len(runs.read_text().splitlines()) == 2


def test_a_job_whose_own_code_raised_fails_without_a_second_run(tmp_path):
    command, runs, out = _job(tmp_path, 1, "raise")
    with pytest.raises(AssertionError, match="a bug in the job"):
        run_job(command, cwd=tmp_path, writes=out)
    assert len(runs.read_text().splitlines()) == 1
