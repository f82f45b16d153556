"""benchmarks/lowbit_kernels.py (``make bench``'s codec throughput and break-even) runs its CPU
kernels and its gloo measurement at world 2 on a tiny size, and report.py renders its JSON; the
low-bit bench rows' table (each row against its stage's exact row) and the loss curves' plan and
table (benchmarks/lowbit_curves.py) from known figures."""

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


def _benchmarks_module(name: str):
    import importlib
    import sys as _sys

    saved = list(_sys.path)
    _sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        _sys.path[:] = saved


def test_low_bit_rows_are_reported_against_the_same_stage_exact():
    rows_module = _benchmarks_module("lowbit_rows")
    row = lambda step, peak, lowbit: {"median_step_s": step, "peak_rise": [peak], "lowbit_bytes": lowbit,  # noqa: E731
                                      "comm_bytes": 2**20, "final_loss": 5.0, "max_param_diff_vs_ddp": 1e-3}
    rows = {"ddp": row(1.0, 100, None), "zero2": row(2.0, 200, None), "zero2_int4": row(3.0, 150, (129, 1000)),
            "ds_zero3": row(4.0, 400, None), "ds_zeropp_hpz": row(2.0, 800, None)}
    assert rows_module.lowbit_rows(rows) == ["zero2", "zero2_int4", "ds_zero3", "ds_zeropp_hpz"]
    peak_of = lambda r: r["peak_rise"]  # noqa: E731
    cells = rows_module.lowbit_cells("zero2_int4", rows, "int4 row", peak_of)
    assert cells[:8] == ["int4 row", "int4-grads", "3.000", "1.50", "0.75", "129", "1,000", "0.129"]
    assert rows_module.lowbit_cells("ds_zeropp_hpz", rows, "hpZ", peak_of)[3:5] == ["0.50", "2.00"]  # against DeepSpeed's ZeRO-3
    assert rows_module.lowbit_rows({"ddp": rows["ddp"], "zero2": rows["zero2"]}) == []  # no low-bit row: no table


def test_loss_curves_plan_and_table():
    curves = _benchmarks_module("lowbit_curves")
    # stage 1 sends parameters only: a gradients-only mode skips it, a parameter format runs there once
    assert curves.plan(["off", "int8", "int4-grads", "int8-params", "fp8-params"], ["1", "2", "3"]) == {
        "off": ["1", "2", "3"], "int8": ["1", "2", "3"], "int4-grads": ["2", "3"], "int8-params": ["2", "3"],
        "fp8-params": ["1", "2", "3"]}
    curve = lambda losses, sent, exact: {"loss": losses, "sent": [sent] * len(losses), "exact": [exact] * len(losses)}  # noqa: E731
    results = {"2": {"off": {"2": curve([5.0, 4.0, 3.0], 0, 0)}, "int8": {"2": curve([5.0, 4.1, 2.99], 26, 100)}}}
    (only,) = curves.table(results)
    assert only["mode"] == "int8" and only["stage"] == "2" and only["world"] == 2 and only["sent_bytes"] == 26
    assert abs(only["final_loss_diff"] + 0.01) < 1e-12 and abs(only["max_step_diff"] - 0.1) < 1e-12
    assert "| int8 | 2 | 2 | 26 | 100 | 0.260 |" in curves.markdown([only])


def test_shadow_cost_compares_the_checked_steps_with_the_others_of_one_run(monkeypatch, tmp_path):
    """benchmarks/lowbit_shadow.py: with --check-every 2 the example's odd steps (the wires' even
    ones) are checked; after the warm-up, the medians of checked and unchecked steps per stage and
    their ratio (the launches are stubbed with known step times; the example's time column and
    --check-every are run by test_examples)."""
    shadow = _benchmarks_module("lowbit_shadow")
    launches = []

    def fake_run(world, mode, stages, steps, out, extra=()):
        launches.append((mode, tuple(extra)))
        ms = [50.0] * 6 if mode == "off" else [900.0, 10.0, 30.0, 12.0, 32.0, 11.0, 31.0]  # steps 1..7
        return {stage: {"ms": ms} for stage in stages}

    monkeypatch.setattr(shadow, "run", fake_run)
    rows = shadow.measure("int8", ["2", "3"], 2, 7, 1, tmp_path)
    assert launches == [("off", ()), ("int8", ("--check-every", "2"))]
    row = rows[1]
    assert (row["stage"], row["exact_ms"], row["unchecked_ms"], row["checked_ms"]) == ("3", 50.0, 11.0, 31.0)
    assert row["checked_vs_unchecked"] == 31.0 / 11.0 and abs(row["added_at_every_10"] - 20.0 / 110.0) < 1e-12
    assert "| 3 | int8 | 50.0 | 11.0 | 31.0 | 2.82 | 18.2 % |" in shadow.markdown(rows)
