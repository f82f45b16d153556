"""The low-bit communication rows of ``bench.py`` (issue 39): each stage with a ``sharded.LowBit``
mode against the same stage exact, and DeepSpeed's ZeRO++ where it runs.

Each ``zero*_<mode>`` row builds the stage as ``examples/train_gpt.py --lowbit`` does: ``OSS`` gets
the mode's parameter format (its broadcast of updated parameters), ``ShardedDataParallel`` its
gradient format (the reduce to each owner), ``fully_shard`` both (the all-gathers and the
reduce-scatters), on every block and the root. Defaults of ``LowBit`` otherwise: blocks of 256,
messages under 4096 elements sent exact (logged once per wrapper), error feedback on.

Beside the bench's usual columns a row reports the bytes this rank sent in one step's low-bit
collectives and what the same collectives send exact, from the wrappers' ``lowbit_traffic``
(rank 0; the ``MiB sent`` column counts every collective at the Python level, low-bit or not).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

LOWBIT = {
    "zero1_int8": "sharded OSS + DDP, int8 broadcast",
    "zero1_fp8": "sharded OSS + DDP, fp8 broadcast",
    "zero2_int8": "sharded OSS + SDP, int8 reduce + broadcast",
    "zero2_int4": "sharded OSS + SDP, int4 reduce",
    "zero3_int8": "sharded fully_shard, int8 gather + reduce-scatter",
    "zero3_int8_int4": "sharded fully_shard, int8 gather, int4 reduce-scatter",
    "zero3_fp8": "sharded fully_shard, fp8 gather + reduce-scatter",
}
MODE_OF = {"zero1_int8": "int8-params", "zero1_fp8": "fp8-params", "zero2_int8": "int8", "zero2_int4": "int4-grads",
           "zero3_int8": "int8", "zero3_int8_int4": "int8-params-int4-grads", "zero3_fp8": "fp8"}
# DeepSpeed's ZeRO++ on its CPU accelerator (deepspeed 0.19.8, torch 2.13.0+cpu, world 2): only hpZ
# runs. zero_quantized_weights (qwZ) stops in deepspeed.initialize (zero.Init builds a
# CUDAQuantizer, whose QuantizerBuilder().load() is the CPU accelerator's NotImplementedBuilder:
# "ValueError: This op had not been implemented on CPU backend.") and zero_quantized_gradients
# (qgZ) stops the same way in the first backward (all_to_all_quant_reduce loads the same builder):
# their quantisation kernels are CUDA sources (csrc/quantization). At world 2 hpZ's secondary
# group of 2 ranks is the whole world: the backward's gather reaches the same ranks as the
# forward's, so the row shows hpZ's own bookkeeping, not the saving it makes across nodes.
ZEROPP = {"ds_zeropp_hpz": {"zero_hpz_partition_size": 2}}
ZEROPP_NAMES = {"ds_zeropp_hpz": "DeepSpeed ZeRO++ hpZ (partition 2)"}
# the exact row of the same stage each low-bit row is measured against
EXACT_OF = {**{impl: impl.split("_")[0] for impl in LOWBIT}, **{impl: "ds_zero3" for impl in ZEROPP}}
LOWBIT_HEAD = ["implementation", "mode", "step s", "vs exact", "peak vs exact", "low-bit bytes/step (rank 0)",
               "exact bytes/step", "ratio", "MiB sent (all)", "loss", "max abs diff to DDP"]


def build_lowbit(impl: str, model: nn.Module, lr: float):
    """(wrapped model, optimizer, set_to_none, local optimizer) for a low-bit row, Adam as every row."""
    import sharded

    policy = sharded.LowBit.mode(MODE_OF[impl])
    stage = impl[4]
    if stage == "3":
        from gpt import Block  # noqa: F401  (examples/: the blocks are the units)

        for block in model.blocks:
            sharded.fully_shard(block, lowbit=policy)
        sharded.fully_shard(model, lowbit=policy)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        return model, opt, True, opt
    params = replace(policy, grads=None) if policy.params is not None else None
    opt = sharded.OSS(model.parameters(), torch.optim.Adam, lr=lr, lowbit=params)
    if stage == "1":
        return DDP(model), opt, True, opt.optim
    grads = replace(policy, params=None) if policy.grads is not None else None
    return sharded.ShardedDataParallel(model, opt, lowbit=grads), opt, True, opt.optim


def lowbit_bytes(wrapped: Any, optimizer: Any) -> Optional[tuple[int, int]]:
    """(sent, exact) bytes of this rank's last step: ``OSS``'s and ``ShardedDataParallel``'s
    ``lowbit_traffic``, or the root ``fully_shard`` module's (the sum of its units'); ``None`` when
    no wrapper sends low-bit."""
    steps = [t for t in (getattr(s, "lowbit_traffic", None) for s in (optimizer, wrapped)) if t is not None]
    if not steps:
        return None
    return sum(t.sent_bytes for t in steps), sum(t.exact_bytes for t in steps)


def lowbit_cells(impl: str, rows: dict, name: str, peak_of) -> list[str]:
    """One row of the low-bit table (report.py and bench.py's text table)."""
    row, exact = rows[impl], rows.get(EXACT_OF.get(impl, ""))
    versus = f"{row['median_step_s'] / exact['median_step_s']:.2f}" if exact else "-"
    mine, theirs = peak_of(row), peak_of(exact) if exact else []
    peak = f"{mine[0] / theirs[0]:.2f}" if mine and theirs else "-"
    sent, exact_bytes = row.get("lowbit_bytes") or (None, None)
    ratio = f"{sent / exact_bytes:.3f}" if sent is not None and exact_bytes else "-"
    diff = row["max_param_diff_vs_ddp"]
    return [name, MODE_OF.get(impl, "-"), f"{row['median_step_s']:.3f}", versus, peak,
            f"{sent:,}" if sent is not None else "-", f"{exact_bytes:,}" if exact_bytes is not None else "-", ratio,
            f"{row['comm_bytes'] / 2**20:.1f}", f"{row['final_loss']:.4f}", "-" if diff != diff else f"{diff:.1e}"]


def lowbit_rows(rows: dict) -> list[str]:
    """The rows of a report that belong in the low-bit table: the low-bit rows, their exact rows,
    and DeepSpeed's ZeRO++ rows, in the report's order."""
    ours = (set(LOWBIT) | set(ZEROPP)) & set(rows)
    wanted = ours | {EXACT_OF[i] for i in ours}
    return [impl for impl in rows if impl in wanted] if ours else []
