"""A job that loses a rank restarts under ``torchrun --max-restarts`` and ends where it would have.

``examples/train_gpt.py`` runs twice at world 2 (ZeRO-2, a tiny model, a checkpoint every two
steps): once undisturbed, and once with ``--crash-at`` making rank 1 SIGKILL itself at the start
of a step chosen here, under ``torchrun --max-restarts 2``. torchrun must restart the job, the
job must resume from the last complete checkpoint (the one before the crash) and write the same
final checkpoint as the undisturbed run, bit for bit: model and optimizer state. At world 2 a
gradient sum has two terms and is exact whatever the order, and a step's batches depend only on
(step, rank), so nothing may differ. The second restart is spare: should gloo's known abort at
exit end the resumed attempt, torchrun starts a third, which resumes from the final checkpoint with
nothing left to do (the harness cannot retry such a job: the first attempt's traceback, the peer's
failure, is in its output by design). World 1 has no peer to lose; the same restart at world 3
adds only launch time (the resume itself is covered at world 3 by test_checkpoint_resume.py).

The same at stage 3 with a rank that freezes instead (``--freeze-at``: SIGSTOP, so only the process
group's timeout, a short one here, can tell): rank 0 must stop with the error naming rank 1, the
step and the timeout, and the restarted job must end as the undisturbed one, bit for bit (at world
2, layer 3's reduce-scatter sums two terms too). torchrun ends a failed attempt's workers with
SIGTERM and SIGKILLs those still there 30 s later; a stopped process acts on SIGTERM only once
continued, so the test continues the frozen rank once torchrun's SIGTERM is pending on it, which
spares those 30 s and nothing else (the frozen rank then dies of that SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import torch

from examples.gpt import GPT
from sharded import checkpoint
from tests._harness import run_job
from tests.test_checkpoint_resharding import assert_full_equal
from tests.test_examples import ROOT, TINY

STEPS, SAVE_EVERY, CRASH_AT = 6, 2, 3  # the crash loses step 2's work: resume from step-000002
DIMS = dict(vocab=256, dim=32, layers=1, heads=2, seq=32)  # the model TINY builds


FREEZE_TIMEOUT = 5  # seconds: --timeout for the frozen rank's job, short as a test wants it


def _torchrun(out: Path, *extra: str, stage: str = "2", timeout: int = 30) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "2", "--monitor-interval", "0.2", str(ROOT / "examples" / "train_gpt.py"),
               "--out", str(out), *TINY, "--stage", stage, "--steps", str(STEPS), "--save-every",
               str(SAVE_EVERY), "--resume", "--timeout", str(timeout), *extra]
    return run_job(command, cwd=ROOT, writes=out)


def _final_state(out: Path, stage: str = "2") -> dict:
    """The full (torch-format) state of the run's last checkpoint, read in this one process."""
    model = GPT(**DIMS)
    optimizer = torch.optim.AdamW(model.parameters())
    state = checkpoint.get_state_dict(model, optimizer)
    latest = checkpoint.latest_checkpoint(out / "checkpoints" / f"stage-{stage}")
    assert latest is not None and latest.name == f"step-{STEPS:06d}", latest
    checkpoint.load(state, latest)
    checkpoint.set_state_dict(model, optimizer, state)
    return checkpoint.get_state_dict(model, optimizer, full=True)


def test_torchrun_restarts_a_job_that_lost_a_rank_and_it_ends_as_if_it_never_crashed(tmp_path):
    _torchrun(tmp_path / "undisturbed")
    crashed = _torchrun(tmp_path / "crashed", "--crash-at", str(CRASH_AT))
    log = crashed.stdout + crashed.stderr
    assert "failed (exitcode: -9) local_rank: 1" in log, "torchrun saw no SIGKILLed rank 1: " + log[-3000:]
    assert f"resuming from {tmp_path / 'crashed' / 'checkpoints' / 'stage-2' / 'step-000002'}" in crashed.stdout, log[-3000:]
    assert_full_equal(_final_state(tmp_path / "crashed"), _final_state(tmp_path / "undisturbed"), "restarted run")


@contextlib.contextmanager
def _continuing_stopped_ranks_told_to_terminate(out: Path) -> Iterator[None]:
    """While inside: continue (SIGCONT) any stopped process of the job writing ``out`` on which a
    SIGTERM is pending, so that it acts on torchrun's SIGTERM at once instead of 30 s later."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            for process in Path("/proc").glob("[0-9]*"):
                with contextlib.suppress(OSError, ValueError):
                    if str(out) in (process / "cmdline").read_text() and _stopped_with_sigterm_pending(process):
                        os.kill(int(process.name), signal.SIGCONT)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _stopped_with_sigterm_pending(process: Path) -> bool:
    fields = dict(line.split(":", 1) for line in (process / "status").read_text().splitlines() if ":" in line)
    pending = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    return fields["State"].strip().startswith("T") and bool(pending & (1 << (signal.SIGTERM - 1)))


def test_torchrun_restarts_a_job_whose_rank_froze_after_an_error_naming_it_and_it_ends_as_if_it_never_froze(tmp_path):
    _torchrun(tmp_path / "undisturbed", stage="3")
    with _continuing_stopped_ranks_told_to_terminate(tmp_path / "frozen"):
        frozen = _torchrun(tmp_path / "frozen", "--freeze-at", str(CRASH_AT), stage="3", timeout=FREEZE_TIMEOUT)
    log = frozen.stdout + frozen.stderr
    assert f"rank 1 freezes (SIGSTOP) at step {CRASH_AT}" in frozen.stdout, log[-3000:]
    named = (f"PeerFailure: rank 0: rank 1 stopped answering: its heartbeat stopped (the process is frozen, by "
             f"SIGSTOP or a debugger, or died); last seen in step {CRASH_AT}. This rank waited in a collective in "
             f"step {CRASH_AT} when it failed: ")
    assert named in log and f"The process group's timeout of {FREEZE_TIMEOUT} s" in log, log[-3000:]
    assert f"resuming from {tmp_path / 'frozen' / 'checkpoints' / 'stage-3' / 'step-000002'}" in frozen.stdout, log[-3000:]
    assert_full_equal(_final_state(tmp_path / "frozen", "3"), _final_state(tmp_path / "undisturbed", "3"),
                      "restarted run")
