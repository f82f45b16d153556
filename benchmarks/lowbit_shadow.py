"""What the shadow check costs (issue 39, ``LowBit(check_every=K)``): the example GPT
(``examples/train_gpt.py``, the sizes of ``lowbit_curves.py``) with one low-bit mode on each stage,
without the check, with it every step and every ``K`` steps, and the same stage exact.

    python benchmarks/lowbit_shadow.py                      # int8, stages 1-3, world 2, 40 steps
    python benchmarks/lowbit_shadow.py --steps 10 --every 1,5

A checked step also runs the exact collective beside each low-bit one (synchronously, before it)
and compares: its cost is that collective plus the comparison. Per (stage, setting): the median
step time of rank 0 over the steps after the first ``--warmup`` (a step's time is printed by the
example), and its ratio to the low-bit run without checks. Written to ``<out>/lowbit_shadow.json``
and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lowbit_curves import run  # noqa: E402


def measure(mode: str, stages: list[str], world: int, steps: int, every: list[int], warmup: int, out: Path) -> list[dict[str, Any]]:
    """One launch per setting (exact, unchecked, each ``every``); a row per stage and setting."""
    settings: dict[str, tuple[str, tuple[str, ...]]] = {"exact": ("off", ()), "low-bit": (mode, ())}
    settings.update({f"low-bit, check every {k}": (mode, ("--check-every", str(k))) for k in every})
    medians: dict[str, dict[str, float]] = {}
    for name, (setting_mode, extra) in settings.items():
        curves = run(world, setting_mode, stages, steps, out, extra)
        medians[name] = {stage: statistics.median(curve["ms"][warmup:]) for stage, curve in curves.items()}
    rows = []
    for stage in stages:
        base = medians["low-bit"][stage]
        for name in settings:
            ms = medians[name][stage]
            rows.append({"stage": stage, "setting": name, "mode": mode if name != "exact" else "off", "world": world,
                         "median_step_ms": ms, "vs_low_bit": ms / base})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| stage | setting | median step (ms) | vs low-bit unchecked |", "|---|---|---|---|"]
    lines += [f"| {r['stage']} | {r['setting']} | {r['median_step_ms']:.1f} | {r['vs_low_bit']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="int8", help="a LowBit.mode name sending parameters and gradients (stage 1 needs parameters)")
    parser.add_argument("--stages", type=lambda s: s.split(","), default=["1", "2", "3"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    parser.add_argument("--every", type=lambda s: [int(k) for k in s.split(",")], default=[1, 10])
    parser.add_argument("--out", type=Path, default=Path("bench_out/lowbit_shadow"))
    args = parser.parse_args()
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no step of --steps {args.steps} to measure")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = measure(args.mode, args.stages, args.world, args.steps, args.every, args.warmup, args.out / "runs")
    (args.out / "lowbit_shadow.json").write_text(json.dumps(rows, indent=1))
    table = markdown(rows)
    (args.out / "lowbit_shadow.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
