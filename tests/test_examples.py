"""The training example runs end to end: every stage, accumulation, AMP, checkpoint (``--save-every 0``:
at the end only) and resume."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests._harness import run_job

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq", "32", "--batch", "4", "--val-batches", "1"]


def _train(out: Path, *extra: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples" / "train_gpt.py"), "--out", str(out), *TINY, *extra]
    return run_job(command, cwd=ROOT, writes=out).stdout


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
