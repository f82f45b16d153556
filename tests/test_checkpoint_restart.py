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
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from examples.gpt import GPT
from sharded import checkpoint
from tests._harness import run_job
from tests.test_checkpoint_resharding import assert_full_equal
from tests.test_examples import ROOT, TINY

STEPS, SAVE_EVERY, CRASH_AT = 6, 2, 3  # the crash loses step 2's work: resume from step-000002
DIMS = dict(vocab=256, dim=32, layers=1, heads=2, seq=32)  # the model TINY builds


def _torchrun(out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "2", "--monitor-interval", "0.2", str(ROOT / "examples" / "train_gpt.py"),
               "--out", str(out), *TINY, "--stage", "2", "--steps", str(STEPS), "--save-every",
               str(SAVE_EVERY), "--resume", "--timeout", "30", *extra]
    return run_job(command, cwd=ROOT, writes=out)


def _final_state(out: Path) -> dict:
    """The full (torch-format) state of the run's last checkpoint, read in this one process."""
    model = GPT(**DIMS)
    optimizer = torch.optim.AdamW(model.parameters())
    state = checkpoint.get_state_dict(model, optimizer)
    latest = checkpoint.latest_checkpoint(out / "checkpoints" / "stage-2")
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
