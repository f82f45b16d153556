"""benchmarks/lowbit_kernels.py (``make bench``'s codec throughput and break-even) runs its CPU
kernels and its gloo measurement at world 2 on a tiny size, and report.py renders its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_kernel_benchmark_measures_every_format_and_both_collectives(tmp_path):
    out = tmp_path / "lowbit"
    done = subprocess.run([sys.executable, "benchmarks/lowbit_kernels.py", "--sizes", "4096", "--reps", "1", "--world", "2",
                           "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads((out / "lowbit_kernels.json").read_text())
    assert {r["format"] for r in run["kernels"]} == {"int8", "int4", "fp8_e4m3", "fp8_e5m2"}
    assert all(r["within_bound"] and r["encode_gbps"] > 0 and r["decode_gbps"] > 0 for r in run["kernels"])
    int4 = next(r for r in run["kernels"] if r["format"] == "int4")
    assert int4["wire_bytes"] == 16 * 4 + 4096 // 2  # 16 blocks of 256: a float32 scale each, two values a byte
    network = {(r["collective"], r["format"]) for r in run["network"]}
    assert network == {(c, f) for c in ("broadcast", "all_gather") for f in ("exact", "int8", "int4", "fp8_e4m3", "fp8_e5m2")}
    exact = next(r for r in run["network"] if r["format"] == "exact" and r["collective"] == "broadcast")
    assert exact["sent_bytes"] == 4 * 4096  # world 2: the source sends its float32 values once
    rendered = subprocess.run([sys.executable, "report.py", str(out / "lowbit_kernels.json")],
                              capture_output=True, text=True, timeout=120, cwd=ROOT / "benchmarks")
    assert rendered.returncode == 0, rendered.stderr[-3000:]
    assert "| cpu | int4 | 4,096 |" in rendered.stdout and "| broadcast | 4,096 |" in rendered.stdout
