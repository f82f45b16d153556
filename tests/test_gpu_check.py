"""benchmarks/gpu_check.py (``make gpu-check``) on the CPU at its quick sizes, so that CI runs
every line a GPU machine will run first; its failure path; and the copy-overlap arithmetic its
CUDA profile uses, which only a GPU can feed with real events."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    """The script as a module (it puts the repository and examples/ on sys.path: undone here)."""
    saved_path = list(sys.path)
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = saved_path
        del sys.modules["gpu_check"]


def test_the_cpu_path_runs_every_check_and_writes_one_report(tmp_path, gpu_check):
    junit = tmp_path / "device_tests.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="tests.test_x" name="test_a"/>'
                     '<testcase classname="tests.test_x" name="test_b"><skipped message="why"/></testcase></testsuite></testsuites>')
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(out), "--device-tests", str(junit)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["device_type"] == "cpu" and report["backend"] == "gloo" and report["passed"]
    assert list(report["checks"]) == ["device_tests", *gpu_check.CHECKS]
    failed = {name: check["error"] or check["figures"] for name, check in report["checks"].items() if not check["passed"]}
    assert not failed, failed
    stages = report["checks"]["stages"]["figures"]
    assert set(stages) == set(gpu_check.IMPLS) and all(f["step_ms"] > 0 and f["max_diff_to_ddp"] <= 1e-3 for f in stages.values())
    assert set(report["checks"]["memory_estimate"]["figures"]) == {"DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"}
    assert report["checks"]["device_tests"]["figures"] == {
        "modules": ["tests.test_x"], "tests": 2, "failed": [], "skipped": 1, "passed": 1, "skip_reasons": {"why": 1}}
    markdown = (out / "report.md").read_text()
    assert all(f"## {name}: passed" in markdown for name in report["checks"]), markdown[:2000]


def test_a_check_that_raises_fails_the_report_and_the_exit_status(tmp_path, gpu_check):
    def boom(ctx):
        raise ZeroDivisionError("a check's own bug")

    def fine(ctx):
        return gpu_check.Outcome(True, {"figure": 1})

    junit = tmp_path / "failing.xml"
    junit.write_text('<testsuite><testcase classname="tests.test_x" name="test_a"><failure message="no"/></testcase>'
                     '<testcase classname="tests.test_x" name="test_b"/></testsuite>')
    ctx = gpu_check.Context(gpu_check.torch.device("cpu"), gpu_check.SIZES["quick"], tmp_path, "aot_eager")
    checks = {"boom": boom, "fine": fine, "no tests": gpu_check.device_tests_check(tmp_path / "none.xml"),
              "failing tests": gpu_check.device_tests_check(junit)}
    results = gpu_check.run_checks(ctx, checks)
    assert [results[n]["passed"] for n in checks] == [False, True, False, False]
    assert "ZeroDivisionError: a check's own bug" in results["boom"]["error"]
    assert "pytest wrote no results" in results["no tests"]["error"]
    assert results["failing tests"]["figures"]["failed"] == ["tests.test_x::test_a"]
    report = gpu_check.write_report(ctx, results)
    assert not report["passed"] and "## boom: FAILED" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["checks"]["fine"]["figures"] == {"figure": 1}
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(tmp_path / "x"),
                           "--only", "unit_overhead", "--device-tests", str(tmp_path / "none.xml")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]


def test_copy_overlap_counts_the_copy_time_spent_beside_computation(gpu_check):
    events = [
        ("Memcpy HtoD (Pinned -> Device)", 0.0, 10.0),  # 5 of 10 beside the first kernel
        ("ampere_sgemm", 5.0, 20.0),
        ("elementwise_kernel", 18.0, 30.0),  # overlaps the sgemm: one stretch 5-30
        ("Memcpy DtoH (Device -> Pinned)", 25.0, 35.0),  # 5 of 10 beside
        ("Memcpy DtoH (Device -> Pinned)", 40.0, 50.0),  # alone
        ("Memset (Device)", 0.0, 100.0),  # neither a copy nor computation
    ]
    assert gpu_check.copy_overlap(events) == {"htod": 1, "dtoh": 2, "copy_us": 30.0, "overlapped_us": 10.0, "overlapped_share": 0.333}
    assert gpu_check.copy_overlap([("kernel", 0.0, 1.0)])["overlapped_share"] is None
