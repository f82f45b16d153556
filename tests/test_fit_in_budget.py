"""The demo's last part, examples/fit_in_budget.py, on a 6M-parameter GPT: under an OS-enforced
per-rank budget between ZeRO-3's and DDP's estimated peaks, DDP stops with an out-of-memory
message on every rank (no hang: each run is bounded by its timeout) and ZeRO-3 trains to the
loss it reaches unlimited."""

from __future__ import annotations

import sys
from pathlib import Path

from tests._device import cpu_only

pytestmark = cpu_only("the budget is an RLIMIT_DATA on host memory")

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--dim", "256", "--layers", "8", "--heads", "4", "--seq", "32", "--batch", "2", "--steps", "2",
        "--budget", "115MiB", "--timeout", "90"]


def test_ddp_runs_out_of_memory_and_zero3_trains_to_the_unlimited_loss(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import fit_in_budget
    finally:
        sys.path.remove(str(ROOT / "examples"))
    runs = fit_in_budget.drive(fit_in_budget.parse_args([*TINY, "--out", str(tmp_path)]))
    printed = capsys.readouterr().out

    ddp = runs[("ddp", True)]
    assert [r["status"] for r in ddp] == ["oom", "oom"], printed
    assert all(r["returncode"] == fit_in_budget.OOM_EXIT for r in ddp), printed
    assert printed.count("out of memory during") == 2 and "115 MiB per rank is not enough" in printed, printed

    limited, unlimited = runs[("3", True)], runs[("3", False)]
    assert [r["status"] for r in limited + unlimited] == ["ok"] * 4, printed
    assert all(r["returncode"] == 0 for r in limited + unlimited), printed
    assert limited[0]["loss"] == unlimited[0]["loss"] == runs[("ddp", False)][0]["loss"], printed
    assert max(r["peak"] for r in limited) < 115 * 2**20 < max(r["peak"] for r in runs[("ddp", False)]), printed
    assert (tmp_path / "memory.png").exists()
