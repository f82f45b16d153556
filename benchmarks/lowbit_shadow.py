"""What the shadow check costs (issue 39, ``LowBit(check_every=K)``): the example GPT
(``examples/train_gpt.py``, the sizes of ``lowbit_curves.py``) with one low-bit mode on each stage,
checked every second step, beside the same stage exact.

    python benchmarks/lowbit_shadow.py                      # int8, stages 1-3, world 2, 40 steps
    python benchmarks/lowbit_shadow.py --steps 10 --stages 2

A checked step also runs the exact collective beside each low-bit one (synchronously, before it)
and compares: its cost is that collective plus the comparison. With ``--check-every 2`` the
checked and unchecked steps alternate in one run, so a machine whose load drifts slows both
alike: per stage, the median step time of rank 0 over the checked steps and over the others
(after the first ``--warmup``; the example prints each step's time), their ratio, and what
checking every ``K`` steps adds on average, ``(ratio - 1) / K``. Written to
``<out>/lowbit_shadow.json`` and ``.md``.
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


def measure(mode: str, stages: list[str], world: int, steps: int, warmup: int, out: Path) -> list[dict[str, Any]]:
    """One launch exact, one low-bit checked every second step; a row per stage. The example's
    step ``n`` (counted from 1) is the wires' step ``n - 1``, checked when that is even."""
    exact = run(world, "off", stages, steps, out)
    checked_run = run(world, mode, stages, steps, out, ("--check-every", "2"))
    rows = []
    for stage in stages:
        times = checked_run[stage]["ms"][warmup:]
        first = warmup  # the wires' step of times[0]
        checked = [t for i, t in enumerate(times) if (first + i) % 2 == 0]
        unchecked = [t for i, t in enumerate(times) if (first + i) % 2 == 1]
        ratio = statistics.median(checked) / statistics.median(unchecked)
        rows.append({"stage": stage, "mode": mode, "world": world, "exact_ms": statistics.median(exact[stage]["ms"][warmup:]),
                     "unchecked_ms": statistics.median(unchecked), "checked_ms": statistics.median(checked),
                     "checked_vs_unchecked": ratio, "added_at_every_10": (ratio - 1) / 10})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| stage | mode | exact step (ms) | low-bit step (ms) | checked step (ms) | checked / low-bit | added by check_every=10 |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['stage']} | {r['mode']} | {r['exact_ms']:.1f} | {r['unchecked_ms']:.1f} | {r['checked_ms']:.1f} | "
              f"{r['checked_vs_unchecked']:.2f} | {100 * r['added_at_every_10']:.1f} % |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="int8", help="a LowBit.mode name sending parameters and gradients (stage 1 needs parameters)")
    parser.add_argument("--stages", type=lambda s: s.split(","), default=["1", "2", "3"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    parser.add_argument("--out", type=Path, default=Path("bench_out/lowbit_shadow"))
    args = parser.parse_args()
    if args.steps - args.warmup < 2:
        parser.error(f"--warmup {args.warmup} leaves fewer than two steps of --steps {args.steps} to measure")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = measure(args.mode, args.stages, args.world, args.steps, args.warmup, args.out / "runs")
    (args.out / "lowbit_shadow.json").write_text(json.dumps(rows, indent=1))
    table = markdown(rows)
    (args.out / "lowbit_shadow.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
