"""examples/lightning_gpt.py runs end to end on CPU, Lightning starting its 2 processes itself."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from tests._harness import run_job

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--accelerator", "cpu", "--devices", "2", "--dim", "32", "--layers", "1", "--heads", "2", "--seq", "32",
        "--batch", "4", "--steps", "4", "--val-batches", "1", "--lr", "1e-2"]


def _train(out: Path, *extra: str) -> tuple[float, float]:
    command = [sys.executable, str(ROOT / "examples" / "lightning_gpt.py"), "--out", str(out), *TINY, *extra]
    done = run_job(command, cwd=ROOT, writes=out)
    found = re.search(r"validation loss (\S+) -> (\S+) after 4 steps", done.stdout)
    assert found, done.stdout[-3000:]
    assert (out / "last.ckpt").exists()
    return float(found.group(1)), float(found.group(2))


@pytest.mark.parametrize("strategy, extra", [
    ("ddp_sharded", ["--accumulate", "2", "--precision", "bf16-mixed"]),
    ("sharded_fsdp", []),
])
def test_lightning_example_trains_and_checkpoints(tmp_path, strategy, extra):
    before, after = _train(tmp_path, "--strategy", strategy, *extra)
    assert math.isfinite(after) and after < before - 0.05, f"4 steps should lower the loss: {before} -> {after}"
