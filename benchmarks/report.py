"""Render ``bench.json`` files (written by ``bench.py``) as the Markdown tables of
``docs/benchmarks.md``, so the document is regenerated from a run rather than copied by hand.

    python benchmarks/report.py bench_out/bench.json [more.json ...]

Each file gives one table per model size; a file that holds layer-3 rows gets the columns that
compare them with torch's FSDP2, one that holds the Muon rows the Muon table (against DDP + Muon
and FSDP2 + Muon, the optimizer step beside the whole step), one that holds the gradient
accumulation rows the invariant mode's table (each ``*_invariant`` row against its stage's
default accumulation: step, bytes sent and peak, where the step's time went, and whether the
parameters are the same bits), one that holds the low-bit rows the low-bit table (each against its
stage's exact row: step, peak, bytes per step; benchmarks/lowbit_rows.py), one written by
``lowbit_kernels.py`` the codecs' throughput and the break-even, and its ``zero_memory`` section
becomes the bytes-per-parameter table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from accumulation import ACCUMULATION_HEAD, accumulation_cells, accumulation_rows
import lowbit_kernels
from lowbit_rows import LOWBIT_HEAD, lowbit_cells, lowbit_rows
from bench import IMPLS, MUON, SAME_STRATEGY, STAGES, peak_of, ratios_to_ideal, sent_per_model, zero_formula

LAYER_3 = {"fsdp2", "fsdp2_no_reshard", "fsdp1", "zero3", "zero3_grad_op", "ds_zero3", "fsdp2_compile", "zero3_compile"}
# DeepSpeed's row at the same ZeRO stage as each of ours
SAME_STAGE = {"zero1": "ds_zero1", "zero2": "ds_zero2", "zero3": "ds_zero3"}


def mib(values: list[float]) -> str:
    return " / ".join(f"{v / 2**20:.0f}" if v >= 2**24 else f"{v / 2**20:.1f}" for v in values) or "-"


def vs_ideal(row: dict) -> str:
    return f"{row['vs_ideal']:.2f} ± {row['ratio_noise']:.2f}" if "vs_ideal" in row else "-"


def exposed(row: dict) -> str:
    return f"{row['exposed_ms']:.0f} ({100 * row['exposed_share']:.0f} %)" if "exposed_ms" in row else "-"


def vs_deepspeed(impl: str, rows: dict) -> str:
    """Step time and peak against DeepSpeed at the same stage, where both ran."""
    other = rows.get(SAME_STAGE.get(impl, ""))
    if not other:
        return "-"
    time = f"{rows[impl]['median_step_s'] / other['median_step_s']:.2f}"
    mine, theirs = peak_of(rows[impl]), peak_of(other)
    return f"{time} / {mine[0] / theirs[0]:.2f}" if mine and theirs else time


def diff(row: dict) -> str:
    value = row["max_param_diff_vs_ddp"]
    return "-" if value != value else "0" if value == 0 else f"{value:.1e}"  # NaN: no reference


def layer_12_row(impl: str, row: dict, rows: dict, ddp: float, world: int) -> list[str]:
    overlap, early_bytes = (f"{row[key]:.2f}" if row.get(key) is not None else "-" for key in ("overlap", "overlap_bytes"))
    return [IMPLS[impl], f"{row['median_step_s']:.3f}", f"{row['median_step_s'] / ddp:.2f}",
            vs_deepspeed(impl, rows), vs_ideal(row), exposed(row), overlap, early_bytes, mib(row["state_bytes"]),
            mib(row["grad_bytes"]), mib(peak_of(row)),
            f"{row['comm_bytes'] / 2**20:.1f}", str(row["comm_calls_python"]), diff(row)]


def layer_3_row(impl: str, row: dict, rows: dict, ddp: float, world: int) -> list[str]:
    same = rows.get(SAME_STRATEGY.get(impl, ""))
    fsdp2 = f"{row['median_step_s'] / same['median_step_s']:.2f}" if same else "-"
    return [IMPLS[impl], f"{row['median_step_s']:.3f}", f"{row['median_step_s'] / ddp:.2f}", fsdp2,
            vs_deepspeed(impl, rows), vs_ideal(row), mib(row.get("param_bytes", [])), mib(row["state_bytes"]),
            mib(row["grad_bytes"]), mib(peak_of(row)), f"{sent_per_model(row, world):.2f}", str(row["comm_calls_python"]),
            diff(row)]


def muon_row(impl: str, row: dict, rows: dict, world: int) -> list[str]:
    """Against DDP + Muon and, for ZeRO-3, torch's FSDP2 + Muon: the step, and the optimizer step alone."""
    ddp, fsdp2 = rows["ddp_muon"], rows.get("fsdp2_muon")
    versus = lambda key, other: f"{row[key] / other[key]:.2f}" if other else "-"  # noqa: E731
    return [IMPLS[impl], f"{row['median_step_s']:.3f}", versus("median_step_s", ddp),
            versus("median_step_s", fsdp2) if impl == "zero3_muon" else "-", f"{1e3 * row['median_optim_step_s']:.0f}",
            versus("median_optim_step_s", ddp), versus("median_optim_step_s", fsdp2) if impl == "zero3_muon" else "-",
            mib(row.get("param_bytes", [])), mib(row["state_bytes"]), mib(peak_of(row)), f"{row['comm_bytes'] / 2**20:.1f}",
            str(row["comm_calls_python"]), diff(row)]


MUON_HEAD = ["implementation", "step s", "vs DDP + Muon", "vs FSDP2 + Muon", "optimizer step ms", "vs DDP + Muon",
             "vs FSDP2 + Muon", "params MiB/rank", "state MiB/rank", "peak MiB (largest rank)", "MiB sent", "calls",
             "max abs diff to DDP + Muon"]
LAYER_12_HEAD = ["implementation", "step s", "vs DDP", "vs DeepSpeed (step / peak)", "vs ideal ± noise",
                 "exposed ms (share)", "overlap", "overlap bytes", "state MiB/rank", "grads MiB/rank", "peak MiB (largest rank)",
                 "MiB sent", "calls", "max abs diff"]
LAYER_3_HEAD = ["implementation", "step s", "vs DDP", "vs FSDP2 (same strategy)", "vs DeepSpeed (step / peak)",
                "vs ideal ± noise", "params MiB/rank", "state MiB/rank", "grads MiB/rank", "peak MiB (largest rank)",
                "sent / model", "calls", "max abs diff"]


def markdown(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body])


def size_tables(report: dict, world: int, micro_batches: int | None = None) -> str:
    parts = []
    for size, rows in report.items():
        params = next(iter(rows.values()))["params"] / 1e6
        if accumulation_rows(rows):
            body = [accumulation_cells(i, rows, IMPLS[i]) for i in accumulation_rows(rows)]
            parts.append(f"### {size} ({params:.1f}M parameters), world {world}, {micro_batches} micro-batches per step\n\n"
                         + markdown(ACCUMULATION_HEAD, body))
            continue
        if lowbit_rows(rows):
            body = [lowbit_cells(i, rows, IMPLS[i], peak_of) for i in lowbit_rows(rows)]
            parts.append(f"### {size} ({params:.1f}M parameters), low-bit communication, world {world}\n\n"
                         + markdown(LOWBIT_HEAD, body))
            continue
        if "ddp_muon" in rows:
            body = [muon_row(i, r, rows, world) for i, r in rows.items() if i in MUON]
            parts.append(f"### {size} ({params:.1f}M parameters), Muon\n\n" + markdown(MUON_HEAD, body))
            continue
        ratios_to_ideal(rows)
        ddp = rows["ddp"]["median_step_s"]
        layer_3 = LAYER_3 & set(rows)
        body = [layer_3_row(i, r, rows, ddp, world) if layer_3 else layer_12_row(i, r, rows, ddp, world)
                for i, r in rows.items()]
        parts.append(f"### {size} ({params:.1f}M parameters)\n\n" + markdown(LAYER_3_HEAD if layer_3 else LAYER_12_HEAD, body))
    return "\n\n".join(parts)


def zero_table(zero: dict) -> str:
    worlds = [int(w) for w in zero["per_rank_bytes"]]
    head = ["stage"] + [f"N={w}: measured / fp32 formula / mixed-precision formula" for w in worlds]
    body = []
    for impl, stage in STAGES.items():
        cells = [stage]
        for world in worlds:
            held = zero["per_rank_bytes"][str(world)][impl]
            worst = max(sum(part[r] for part in held.values()) for r in range(world)) / zero["params"]
            cells.append(f"{worst:.2f} / {zero_formula(stage, world, False):.2f} / {zero_formula(stage, world, True):.2f}")
        body.append(cells)
    return markdown(head, body)


def main() -> None:
    for path in sys.argv[1:]:
        run = json.loads(Path(path).read_text())
        if "kernels" in run:  # lowbit_kernels.py's report
            print(f"<!-- {run['meta']} -->\n\n{lowbit_kernels.markdown(run)}\n")
            continue
        print(f"<!-- {run['meta']} -->\n")
        print(size_tables(run["results"], run["meta"]["world"], run["meta"].get("micro_batches")))
        if run.get("zero_memory"):
            print(f"\n### Bytes per parameter per rank ({run['zero_memory']['params'] / 1e6:.1f}M parameters, fp32 Adam)\n")
            print(zero_table(run["zero_memory"]))


if __name__ == "__main__":
    main()
