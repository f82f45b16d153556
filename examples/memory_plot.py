"""The demo's figure, ``<out>/memory.png``: what each rank holds per stage (train_gpt.py), and
the budget part (fit_in_budget.py): each run's estimated and measured peak against the budget line.

train_gpt.py saves its panel's numbers in ``<out>/memory.json`` so that fit_in_budget.py, run
after it, redraws the figure with both panels.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def save_figure(out: Path, stage_results: Optional[dict] = None, budget_rows: Optional[list] = None,
                budget: Optional[int] = None) -> None:
    """Draw the panels there are numbers for. ``stage_results``: train_gpt's per-stage
    ``params/grads/state`` per rank (saved to, or else read from, ``memory.json``);
    ``budget_rows``: ``(label, estimated peak, measured peak, outcome)`` per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    saved = out / "memory.json"
    if stage_results is not None:
        saved.write_text(json.dumps(stage_results))
    elif saved.exists():
        stage_results = json.loads(saved.read_text())
    panels = [p for p in (stage_results, budget_rows) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    axes = iter(axes[0])
    if stage_results:
        _held_per_stage(next(axes), stage_results)
    if budget_rows:
        _budget(next(axes), budget_rows, budget)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=110)
    plt.close(fig)


def _held_per_stage(ax, results: dict) -> None:
    world = len(next(iter(results.values()))["params"])
    labels, parts = [], []
    for stage, r in results.items():
        for rank in range(world):
            labels.append(f"{stage}\nrank {rank}")
            parts.append((r["params"][rank], r["grads"][rank], r["state"][rank]))
    x = range(len(labels))
    base = [0.0] * len(labels)
    for i, name in enumerate(("parameters", "gradients", "optimizer state")):
        heights = [p[i] / 2**20 for p in parts]
        ax.bar(x, heights, bottom=base, label=name)
        base = [a + h for a, h in zip(base, heights)]
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("MiB held per rank")
    ax.set_title("held per rank by stage (ddp = DDP + AdamW, 1/2/3 = ZeRO-1/2/3)")
    ax.legend()


def _budget(ax, rows: list, budget: Optional[int]) -> None:
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[1] / 2**20 for r in rows], width=0.4, label="estimated peak")
    ax.bar([i + 0.2 for i in x], [r[2] / 2**20 for r in rows], width=0.4, label="measured peak (or where it stopped)")
    if budget:
        ax.axhline(budget / 2**20, color="red", linestyle="--", label=f"budget {budget / 2**20:.0f} MiB per rank")
    ax.set_xticks(list(x), [f"{r[0]}\n{r[3]}" for r in rows])
    ax.set_ylabel("MiB per rank")
    ax.set_title("the model DDP cannot fit: peak per rank against the budget")
    ax.legend(loc="upper right")
