"""The training example runs stage 3 (fully_shard) end to end: same validation losses as DDP,
and a checkpoint it resumes from exactly as DDP's resumes."""

from __future__ import annotations

import re

from tests.test_examples import _train


def _val(out: str) -> dict[str, tuple[str, str]]:
    return {stage: (first, last) for stage, first, last in re.findall(r"^(ddp|3)\s+(\S+) -> (\S+)", out, re.MULTILINE)}


def test_train_gpt_stage_3_agrees_with_ddp_and_resumes(tmp_path):
    first = _val(_train(tmp_path, "--stage", "ddp,3", "--steps", "4", "--accumulate", "2", "--amp", "bf16"))
    assert set(first) == {"ddp", "3"} and first["ddp"] == first["3"], first
    resumed = _val(_train(tmp_path, "--stage", "ddp,3", "--steps", "6", "--accumulate", "2", "--amp", "bf16", "--resume"))
    assert resumed["3"][0] == first["3"][1], "stage 3 did not resume from its checkpoint's weights"
    assert resumed["3"] == resumed["ddp"], "after resuming, stage 3 and DDP disagree (optimizer state lost?)"
