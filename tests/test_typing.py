"""Type checkers see sharded's annotations (``py.typed`` ships with the package), and the
package itself type-checks.

mypy runs as a user's CI would: on the training example and on a deliberately wrong use of the
API, against an installed (not editable) copy of the package. The wrong use must be reported;
if the marker or the annotations were missing, mypy would see ``Any`` and stay silent. Then
mypy checks the whole package from source, all three layers, the checkpoint engine and (where
Lightning is installed) the Lightning strategies: zero errors.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MISUSE = '''
import torch
from sharded import OSS, ShardedDataParallel

model = torch.nn.Linear(4, 4)
optimizer = OSS(model.parameters(), torch.optim.AdamW, lr=1e-3)
wrapped = ShardedDataParallel(model, optimizer)
total: torch.Tensor = wrapped.clip_grad_norm_(1.0)
wrong: int = optimizer.clip_grad_norm(1.0)
'''


def test_mypy_sees_the_public_annotations(tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(ROOT)], check=True, capture_output=True)
    assert (site / "sharded" / "py.typed").exists()
    (tmp_path / "misuse.py").write_text(MISUSE)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--cache-dir", str(tmp_path / "cache"),
         str(ROOT / "examples" / "train_gpt.py"), str(tmp_path / "misuse.py")],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
    )
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, done.stdout
    assert 'misuse.py:9: error: Incompatible types in assignment (expression has type "Tensor", variable has type "int")' in errors[0]


def test_the_whole_package_type_checks(tmp_path):
    args = [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "sharded"]
    if importlib.util.find_spec("lightning") is None:
        args += ["--exclude", "^sharded/lightning/"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout, done.stdout
