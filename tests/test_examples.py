"""The training example runs end to end: every stage, accumulation, AMP, checkpoint (``--save-every 0``:
at the end only) and resume; ``--lowbit``'s per-step losses and bytes against the exact run, and its refusals."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests._harness import run_job

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq", "32", "--batch", "4", "--val-batches", "1"]


def _train(out: Path, *extra: str) -> str:
    return _train_job(out, *extra).stdout


def _train_job(out: Path, *extra: str):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples" / "train_gpt.py"), "--out", str(out), *TINY, *extra]
    return run_job(command, cwd=ROOT, writes=out)


def test_train_gpt_stages_agree_and_resume(tmp_path):
    out = _train(tmp_path, "--stage", "ddp,1,2", "--steps", "4", "--accumulate", "2", "--amp", "bf16", "--save-every", "0")
    val = dict(re.findall(r"^(ddp|1|2)\s+\S+ -> (\S+)", out, re.MULTILINE))
    assert set(val) == {"ddp", "1", "2"} and len(set(val.values())) == 1, out
    for stage in val:  # --save-every 0: a checkpoint at the end only
        saved = sorted(p.name for p in (tmp_path / "checkpoints" / f"stage-{stage}").iterdir())
        assert saved == ["step-000004"], f"stage {stage} saved {saved}"
    assert (tmp_path / "memory.png").exists()
    resumed = _train(tmp_path, "--stage", "2", "--steps", "6", "--accumulate", "2", "--amp", "bf16", "--resume")
    start = re.search(r"^2\s+(\S+) ->", resumed, re.MULTILINE).group(1)
    assert start == val["2"], "resume did not start from the checkpoint's weights"


LOWBIT_LINE = re.compile(r"^stage (\S+) step (\d+) loss (\S+) sent (\d+) bytes exact (\d+) bytes time [0-9.]+ ms$", re.MULTILINE)


def test_train_gpt_lowbit_prints_each_steps_bytes_and_refuses_a_stage_it_cannot_narrow(tmp_path):
    # every stage, int8: the first step's loss is the exact run's at stages 1 and 2 (nothing low-bit
    # has reached the weights yet) and not at stage 3 (its first forward computes with int8-gathered
    # weights); every step sends fewer bytes than the same collectives exact; --check-every 1 logs
    # every collective's shadow check
    job = _train_job(tmp_path / "int8", "--stage", "1,2,3", "--steps", "2", "--lowbit", "int8", "--save-every", "0", "--check-every", "1")
    lines = {(stage, int(step)): (float(loss), int(sent), int(exact)) for stage, step, loss, sent, exact
             in LOWBIT_LINE.findall(job.stdout)}
    assert set(lines) == {(s, n) for s in "123" for n in (1, 2)}, lines
    checked = set(re.findall(r"low-bit check, step \d+: LowBitCheck\(step=\d+, collective='(\w+)'", job.stderr))
    assert checked == {"broadcast", "reduce", "all_gather", "reduce_scatter"}, job.stderr[-3000:]
    assert all(0 < sent < exact / 3 for _, sent, exact in lines.values()), lines
    off = {(stage, int(step)): (float(loss), int(sent), int(exact)) for stage, step, loss, sent, exact
           in LOWBIT_LINE.findall(_train(tmp_path / "off", "--stage", "1,2,3", "--steps", "2", "--lowbit", "off", "--save-every", "0"))}
    assert all(sent == exact == 0 for _, sent, exact in off.values()), off
    assert lines["1", 1][0] == off["1", 1][0] and lines["2", 1][0] == off["2", 1][0]
    assert lines["3", 1][0] != off["3", 1][0]
    assert max(abs(lines[k][0] - off[k][0]) for k in lines) < 0.05  # int8 weights and gradients: a small change
    for stage, mode, why in (("ddp", "int8", "no low-bit path"), ("1", "int4-grads", "stage 1 sends only parameters"),
                             ("2", "int9", "unknown low-bit mode"), ("2 --check-every 2", "off", "with a --lowbit mode")):
        refused = subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--stage", *stage.split(), "--lowbit", mode],
                                 capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert refused.returncode == 2 and why in refused.stderr, refused.stderr[-2000:]
