"""``examples/train_gpt.py --invariant`` keeps its bits when the number of ranks changes under it.

The reference is one run at 4 ranks: ZeRO-2, then ZeRO-3, bf16 autocast, a global batch of 4
micro-batches of one sequence, 10 steps. ``sharded.invariant.MicroBatches`` makes every step's gradients,
clipping norm and loss the same bits at any world size dividing 4, so a run whose world size
changes between checkpoints must end with the reference's model and optimizer state, bit for bit:

- resized by hand: stopped and resumed at 4 -> 2 -> 4 ranks (both directions, one launch each);
- elastic: two torchrun agents of 2 ranks each under ``--nnodes 1:2``; one agent and its workers
  are SIGKILLed (a lost node) once the first checkpoint exists. The survivor's workers fail at
  their next collective (``checkpoint.PeerFailure``), torchrun restarts them, the rendezvous
  completes with the one node left (once the dead agent's keep-alive has expired and the last
  call is over), and they resume at 2 ranks from the latest complete checkpoint.

torchrun starts each worker in a session of its own, so killing an agent's process group would
leave its workers training (the survivor would then finish at 4 ranks and wait 300 s in torchrun's
exit barrier for the dead agent): a lost node is the agent's group and each worker's.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from examples.gpt import GPT
from sharded import checkpoint
from tests._harness import run_job
from tests.test_checkpoint_resharding import assert_full_equal
from tests.test_checkpoint_restart import DIMS
from tests.test_examples import ROOT, TINY

STEPS = 10
INVARIANT = [*TINY, "--invariant", "--micro-batches", "4", "--amp", "bf16", "--timeout", "30"]
# Short rendezvous timings for one machine: a lost agent is declared dead after 3 s without a
# heartbeat, and a round with fewer than --nnodes' maximum closes 5 s after its first node joined.
RDZV_CONF = "join_timeout=60,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
ELASTIC_DEADLINE = 150.0  # seconds for the whole elastic job


def _torchrun(out: Path, nproc: int, *extra: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(ROOT / "examples" / "train_gpt.py"), "--out", str(out), *INVARIANT, *extra]
    return run_job(command, cwd=ROOT, writes=out).stdout


def _losses(printed: str) -> dict[tuple[str, int], str]:
    """``(stage, step) -> loss`` as rank 0 printed it (every digit ``--invariant`` prints)."""
    return {(stage, int(step)): loss for stage, step, loss in re.findall(r"^stage (\S+) step (\d+) loss (\S+)$", printed, re.M)}


def _final_state(out: Path, stage: str) -> dict:
    """The full (torch-format) model and optimizer state of the run's last checkpoint of ``stage``."""
    model = GPT(**DIMS)
    optimizer = torch.optim.AdamW(model.parameters())
    state = checkpoint.get_state_dict(model, optimizer)
    latest = checkpoint.latest_checkpoint(out / "checkpoints" / f"stage-{stage}")
    assert latest is not None and latest.name == f"step-{STEPS:06d}", latest
    checkpoint.load(state, latest)
    checkpoint.set_state_dict(model, optimizer, state)
    return checkpoint.get_state_dict(model, optimizer, full=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    """One run at 4 ranks that never changes size: its folder and printed losses."""
    out = tmp_path_factory.mktemp("reference")
    printed = _torchrun(out, 4, "--stage", "2,3", "--steps", str(STEPS), "--save-every", "0")
    return out, _losses(printed)


def test_a_run_resized_4_to_2_to_4_ranks_ends_with_the_bits_of_one_that_never_resized(tmp_path, reference):
    reference_out, reference_losses = reference
    printed = ""
    for nproc, steps in ((4, 3), (2, 6), (4, STEPS)):  # each leg saves at its end, the next resumes there
        leg = _torchrun(tmp_path, nproc, "--stage", "2,3", "--steps", str(steps), "--save-every", "0", "--resume")
        assert f"{nproc} ranks on cpu" in leg, leg
        printed += leg
    for stage in ("2", "3"):
        for stop in (3, 6):
            assert f"resuming from {tmp_path / 'checkpoints' / f'stage-{stage}' / f'step-{stop:06d}'}" in printed, printed
        assert_full_equal(_final_state(tmp_path, stage), _final_state(reference_out, stage), f"stage {stage}, resized")
    assert _losses(printed) == reference_losses, printed


def test_an_elastic_job_that_loses_a_node_resumes_on_the_other_and_ends_with_the_same_bits(tmp_path, reference):
    reference_out, reference_losses = reference
    port = _free_port()
    # the doomed agent first, as a client: the survivor hosts the rendezvous store, and both
    # agents join the first round well within its last call
    doomed = _agent(tmp_path, "doomed", port, is_host=False)
    survivor = _agent(tmp_path, "survivor", port, is_host=True)
    deadline = time.monotonic() + ELASTIC_DEADLINE
    try:
        first_checkpoint = _wait_for(tmp_path / "run" / "checkpoints" / "stage-3" / "step-000002", survivor, deadline)
        _kill_node(doomed)
        finished = _wait_for(None, survivor, deadline)
    finally:
        for agent in (doomed, survivor):
            if agent.poll() is None:
                _kill_node(agent)
    log = {name: (tmp_path / f"{name}.log").read_text() for name in ("doomed", "survivor")}
    assert first_checkpoint, "no checkpoint appeared: " + log["survivor"][-4000:]
    assert finished and survivor.returncode == 0, f"survivor: {survivor.returncode}\n" + log["survivor"][-4000:]
    assert "4 ranks on cpu" in log["doomed"] + log["survivor"], "the agents did not start as one job of 4 ranks"
    after_restart = log["survivor"].split("will restart worker group", 1)[-1]
    assert "2 ranks on cpu" in after_restart, log["survivor"][-4000:]
    resumed_at = re.search(r"resuming from \S+/step-(\d+)$", after_restart, re.M)
    assert resumed_at is not None and int(resumed_at.group(1)) < STEPS, log["survivor"][-4000:]
    assert_full_equal(_final_state(tmp_path / "run", "3"), _final_state(reference_out, "3"), "elastic run")
    resumed = _losses(after_restart)
    assert resumed and resumed == {key: reference_losses[key] for key in resumed}, after_restart


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _agent(tmp_path: Path, name: str, port: int, is_host: bool) -> subprocess.Popen:
    """One torchrun agent (a node of 2 ranks) of the elastic job, in a session of its own; its
    output goes to ``<tmp_path>/<name>.log``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "invariant-elastic",
               "--rdzv-conf", f"{RDZV_CONF},is_host={str(is_host).lower()}", "--max-restarts", "2",
               "--monitor-interval", "0.2", str(ROOT / "examples" / "train_gpt.py"), "--out", str(tmp_path / "run"),
               *INVARIANT, "--stage", "3", "--steps", str(STEPS), "--save-every", "2", "--resume"]
    # a second restart is spare: gloo's known abort at exit would restart the finished job, which
    # resumes from its final checkpoint and has nothing left to do
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO"}
    with open(tmp_path / f"{name}.log", "w") as log:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(path: Optional[Path], agent: subprocess.Popen, deadline: float) -> bool:
    """Whether ``path`` appeared (``None``: whether ``agent`` ended) before ``agent`` ended
    (``path``: or ended) and before ``deadline``."""
    while time.monotonic() < deadline:
        if path is not None and path.exists():
            return True
        if agent.poll() is not None:
            return path is None
        time.sleep(0.02)
    return False


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers: its process group and each worker's session."""
    workers = _children(agent.pid)
    for group in (agent.pid, *workers):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.parametrize("arguments, refusal", [
    ("--invariant", "needs --micro-batches M, a power of two"),
    ("--invariant --micro-batches 6", "needs --micro-batches M, a power of two"),
    ("--invariant --micro-batches 4 --batch 6", "--batch 6 is the global batch and must split into 4"),
    ("--invariant --micro-batches 4 --accumulate 2", "drop --accumulate"),
    ("--micro-batches 4", "--micro-batches belongs to --invariant"),
])
def test_the_example_refuses_what_invariant_mode_cannot_keep_invariant(arguments, refusal, capsys):
    train_gpt = _example_module()
    with pytest.raises(SystemExit) as exited:
        train_gpt.parse_args(arguments.split())
    assert exited.value.code == 2 and refusal in capsys.readouterr().err


def _example_module():
    """``examples/train_gpt.py`` as a module (it imports its neighbours by their bare names)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_gpt
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return train_gpt
