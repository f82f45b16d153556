"""Loss curves of low-bit communication against the exact run (issue 39): the example GPT
(``examples/train_gpt.py``) for ``--steps`` steps at each world size, every ``sharded.LowBit`` mode
on every stage that sends something in fewer bits under it, beside ``--lowbit off``.

    python benchmarks/lowbit_curves.py                              # 300 steps, worlds 2 and 4, every mode
    python benchmarks/lowbit_curves.py --steps 20 --worlds 2 --modes int8

One ``torchrun`` launch per (world, mode) trains its stages in turn (the example's ``--stage 1,2,3``:
each from the same weights on the same batches), and rank 0 prints each step's loss with every
digit and the bytes it sent beside what the same collectives send exact. Stage 1 sends only
parameters (``OSS``'s broadcast), so a gradients-only mode runs stages 2 and 3 alone, and a mode
whose parameter format an earlier mode of the list already ran at stage 1 is not run there again
(``int8-params-int4-grads`` at stage 1 is ``int8``). Each launch's curves are kept in
``<out>/runs/``: a later call with other ``--stages`` or ``--modes`` adds to them (``--fresh``
runs everything again), and the table covers every run kept.

Per (mode, stage, world): bytes/step (median of rank 0's steps) against exact; the final loss
minus the exact run's at the same stage and world; the largest per-step ``|loss - exact loss|``.
Written to ``<out>/lowbit_curves.json``, ``.md`` (the table of docs/guides/lowbit.md's
"Measured" section) and ``.png`` (each run's loss difference per step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from sharded import LowBit  # noqa: E402
from sharded._common.lowbit import MODES  # noqa: E402

# the example's sizes: a small GPT whose block matrices (64 x 64) and units' shards are above
# LowBit's min_numel (4096), so the modes act on them; one thread per rank on this shared machine
MODEL = ["--dim", "64", "--layers", "2", "--heads", "2", "--seq", "64", "--batch", "8", "--val-batches", "1",
         "--save-every", "0", "--threads", "1"]
LINE = re.compile(r"stage (\S+) step (\d+) loss (\S+) sent (\d+) bytes exact (\d+) bytes time (\S+) ms")


def plan(modes: list[str], stages: list[str]) -> dict[str, list[str]]:
    """The stages each mode runs: those of ``stages`` that send something in fewer bits under it
    (every one for ``off``); stage 1 once per parameter format."""
    planned, params_run = {}, set()
    for mode in modes:
        policy = None if mode == "off" else LowBit.mode(mode)
        mine = [s for s in stages if policy is None or s != "1" or (policy.params is not None and policy.params not in params_run)]
        if policy is not None and "1" in mine:
            params_run.add(policy.params)
        if mine:
            planned[mode] = mine
    return planned


def run(world: int, mode: str, stages: list[str], steps: int, out: Path, extra: tuple[str, ...] = ()) -> dict[str, dict[str, list]]:
    """One launch (``extra``: more options of the example); ``{stage: {"loss": [...], "sent": [...],
    "exact": [...], "ms": [...]}}`` from rank 0's lines."""
    folder = out / f"world{world}-{mode}{''.join(extra).replace('-', '_')}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               str(ROOT / "examples" / "train_gpt.py"), "--stage", ",".join(stages), "--steps", str(steps),
               "--lowbit", mode, "--out", str(folder), *MODEL, *extra]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"world {world}, --lowbit {mode} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    curves: dict[str, dict[str, list]] = {}
    for stage, step, loss, sent, exact, ms in LINE.findall(done.stdout):
        curve = curves.setdefault(stage, {"loss": [], "sent": [], "exact": [], "ms": []})
        curve["loss"].append(float(loss))
        curve["sent"].append(int(sent))
        curve["exact"].append(int(exact))
        curve["ms"].append(float(ms))
    print(f"world {world} {mode}: {time.perf_counter() - started:.0f} s, stages {sorted(curves)}", flush=True)
    return curves


def table(results: dict[str, dict[str, dict[str, dict[str, list]]]]) -> list[dict[str, Any]]:
    """One row per (mode, stage, world) against the exact run of the same stage and world."""
    rows = []
    for world, modes in results.items():
        exact_run = modes.get("off", {})
        for mode, stages in modes.items():
            if mode == "off":
                continue
            for stage, curve in stages.items():
                if stage not in exact_run:
                    continue
                reference = exact_run[stage]["loss"]
                diffs = [a - b for a, b in zip(curve["loss"], reference)]
                rows.append({"mode": mode, "stage": stage, "world": int(world), "steps": len(diffs),
                             "sent_bytes": statistics.median(curve["sent"]), "exact_bytes": statistics.median(curve["exact"]),
                             "final_loss": curve["loss"][-1], "exact_final_loss": reference[-1],
                             "final_loss_diff": diffs[-1], "max_step_diff": max(abs(d) for d in diffs)})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["mode", "stage", "world", "bytes/step (rank 0)", "exact bytes/step", "ratio", "final loss (exact)",
            "final loss diff", "max per-step diff"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r["mode"], r["stage"], r["world"])):
        ratio = r["sent_bytes"] / r["exact_bytes"] if r["exact_bytes"] else float("nan")
        lines.append(f"| {r['mode']} | {r['stage']} | {r['world']} | {r['sent_bytes']:,.0f} | {r['exact_bytes']:,.0f} | "
                     f"{ratio:.3f} | {r['final_loss']:.4f} ({r['exact_final_loss']:.4f}) | {r['final_loss_diff']:+.1e} | "
                     f"{r['max_step_diff']:.1e} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    names = sorted({mode for modes in results.values() for mode in modes if mode != "off"})
    for ax, (world, modes) in zip(axes[0], results.items()):
        for mode, stages in modes.items():
            if mode == "off":
                continue
            for stage, curve in stages.items():
                if stage not in modes.get("off", {}):
                    continue
                reference = modes["off"][stage]["loss"]
                ax.plot([a - b for a, b in zip(curve["loss"], reference)], linewidth=0.7, color=f"C{names.index(mode) % 10}",
                        linestyle={"1": ":", "2": "--", "3": "-"}[stage], label=f"{mode}, stage {stage}")
        ax.axhline(0.0, color="grey", linewidth=0.6)
        ax.set_title(f"world {world}: loss minus the exact run's, per step")
        ax.set_xlabel("step")
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=lambda s: [int(w) for w in s.split(",")], default=[2, 4])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES), help="LowBit.mode names ('off' always runs)")
    parser.add_argument("--stages", type=lambda s: s.split(","), default=["1", "2", "3"])
    parser.add_argument("--out", type=Path, default=Path("bench_out/lowbit_curves"))
    parser.add_argument("--fresh", action="store_true", help="run again what <out>/runs/ already holds")
    args = parser.parse_args()
    runs = args.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    started = time.time()
    for world in args.worlds:
        for mode, stages in plan(["off", *args.modes], args.stages).items():
            todo = [s for s in stages if args.fresh or not (runs / f"world{world}-{mode}-stage{s}.json").exists()]
            if todo:
                for stage, curve in run(world, mode, todo, args.steps, args.out).items():
                    (runs / f"world{world}-{mode}-stage{stage}.json").write_text(json.dumps(curve))
    results: dict[str, dict[str, dict[str, dict[str, list]]]] = {}
    for path in sorted(runs.glob("world*-stage*.json")):
        world, mode, stage = re.fullmatch(r"world(\d+)-(.+)-stage(\w+)\.json", path.name).groups()
        results.setdefault(world, {}).setdefault(mode, {})[stage] = json.loads(path.read_text())
    rows = table(results)
    meta = {"steps": args.steps, "model": " ".join(MODEL), "seconds": round(time.time() - started),
            "load_average": round(os.getloadavg()[0], 2)}
    (args.out / "lowbit_curves.json").write_text(json.dumps({"meta": meta, "curves": results, "rows": rows}))
    text = markdown(rows)
    (args.out / "lowbit_curves.md").write_text(f"<!-- {meta} -->\n\n{text}\n")
    plot(results, args.out / "lowbit_curves.png")
    print(text)


if __name__ == "__main__":
    main()
