"""The gradient-accumulation rows of ``bench.py`` (issue 29): the invariant mode,
``sharded.invariant.MicroBatches``, against the usual accumulation, per stage, in one launch.

Both kinds of row train on the same global batch every step: ``M`` micro-batches
(``--micro-batches``, default 8) of ``max(1, 2 * batch // M)`` sequences each, micro-batch ``i`` of
step ``s`` drawn from ``(s, i)`` alone. So the global batch does not depend on the world size (at
10m it is 8 micro-batches of 2 sequences: at world 2 the 16 sequences the other rows' two ranks
take), the invariant rows of one launch can be compared bit for bit with another launch's at
another world size (the ``digest`` column), and each rank computes ``M / W`` micro-batches.

- default rows (``*_accum``): this rank's block of micro-batches (rank ``r`` takes
  ``r * M/W ... (r + 1) * M/W - 1``), each loss divided by ``M / W`` (the wrapper averages over the
  ranks), under the wrapper's ``no_sync()`` for all but the last; stage 1 is ``OSS`` + DDP, stage 2
  ``OSS`` + ``ShardedDataParallel``. Stage 3 (``fully_shard``, each block a unit) has two:
  ``zero3_accum`` reduce-scatters every micro-batch's gradients into the sharded ones (what
  torchtitan does: gradients stay sharded) and ``zero3_accum_nosync`` accumulates unsharded ones
  under ``set_requires_gradient_sync(False)`` and reduce-scatters once (torch's documented switch,
  fewer bytes for more memory).
- invariant rows (``*_invariant``): the same model, data and Adam through ``MicroBatches(wrapped, M)``,
  each micro-batch's own mean loss unscaled. Neither kind clips (no other row of the bench does).

Each step also records where its time went, on the slowest rank: **compute** (the micro-batches'
forward and backward, with the communication that runs inside backward: DDP's and
``ShardedDataParallel``'s reduces of the last micro-batch, layer 3's gathers and its reduce-scatters
or exchanges), **between** (in the loop, outside the micro-batches' bodies, before the last one:
the invariant mode's copy of each micro-batch's gradients into a flat leaf and its tree's
additions) and **after** (once the last backward has returned: the invariant mode's last copy, its
exchange and the landing of the mean; next to nothing for the default rows).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

ACCUMULATION = {
    "zero1_accum": "OSS + DDP, no_sync accumulation",
    "zero1_invariant": "OSS + DDP, MicroBatches",
    "zero2_accum": "OSS + SDP, no_sync accumulation",
    "zero2_invariant": "OSS + SDP, MicroBatches",
    "zero3_accum": "fully_shard, reduce every micro-batch",
    "zero3_accum_nosync": "fully_shard, requires_gradient_sync(False)",
    "zero3_invariant": "fully_shard, MicroBatches",
}
STAGE = {impl: int(impl[4]) for impl in ACCUMULATION}
# the default row each invariant row is measured against
DEFAULT_OF = {"zero1_invariant": "zero1_accum", "zero2_invariant": "zero2_accum", "zero3_invariant": "zero3_accum"}
# read by the rank processes (spawned: they inherit the environment, not bench.py's arguments)
MICRO_BATCHES_ENV = "BENCH_MICRO_BATCHES"


def micro_batch_count() -> int:
    """``M``, the micro-batches of every step's global batch (``--micro-batches``)."""
    return int(os.environ.get(MICRO_BATCHES_ENV, "8"))


def micro_batch_tokens(cfg: dict, vocab: int, step: int, index: int, device: torch.device) -> torch.Tensor:
    """Micro-batch ``index`` of ``step``: ``max(1, 2 * batch // M)`` sequences, the same on any rank."""
    sequences = max(1, 2 * cfg["batch"] // micro_batch_count())
    g = torch.Generator().manual_seed(1_000_003 * step + index)
    return torch.randint(0, vocab, (sequences, cfg["seq"] + 1), generator=g).to(device)


def build_accumulation(impl: str, model: nn.Module, lr: float):
    """(wrapped model, its ``AccumulatedSteps``, set_to_none, local optimizer) for ``impl``."""
    from sharded import OSS, ShardedDataParallel, fully_shard

    if STAGE[impl] == 3:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        return model, AccumulatedSteps(impl, model, optimizer), True, optimizer
    oss = OSS(model.parameters(), torch.optim.Adam, lr=lr)
    wrapped = DDP(model) if STAGE[impl] == 1 else ShardedDataParallel(model, oss)
    return wrapped, AccumulatedSteps(impl, wrapped, oss), True, oss.optim


class AccumulatedSteps:
    """The optimizer interface ``bench.py``'s ``train_step`` drives, for a step of ``M``
    micro-batches: :meth:`forward_backward` runs this rank's (a default row's or ``MicroBatches``'),
    then ``step`` is the optimizer's. Keeps the last step's losses and where its time went."""

    def __init__(self, impl: str, wrapped: nn.Module, optimizer) -> None:
        from sharded.invariant import MicroBatches

        self.impl, self.wrapped, self.optimizer = impl, wrapped, optimizer
        self.count = micro_batch_count()
        per_rank = self.count // dist.get_world_size()
        self.invariant = MicroBatches(wrapped, self.count) if impl.endswith("_invariant") else None
        self.indices = list(range(dist.get_rank() * per_rank, (dist.get_rank() + 1) * per_rank))
        self.loss_scale = 1.0 if self.invariant is not None else 1.0 / per_rank
        self.losses: dict[int, float] = {}
        self.phases: dict[str, float] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.optimizer.step()

    def forward_backward(self, cfg: dict, vocab: int, step: int, device: torch.device,
                         loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> float:
        """This rank's micro-batches of ``step``, forward and backward; their mean loss. Times the
        loop bodies (compute), the loop around them before the last (between) and after it (after)."""
        clock = time.perf_counter
        loop: Iterator[int] = iter(self.invariant) if self.invariant is not None else self._default_loop()
        self.losses, compute, between = {}, 0.0, 0.0
        while True:
            started = clock()
            index: Optional[int] = next(loop, None)
            waited = clock() - started
            if index is None:
                break
            between += waited
            started = clock()
            loss = loss_fn(self.wrapped, micro_batch_tokens(cfg, vocab, step, index, device))
            (loss * self.loss_scale).backward()
            self.losses[index] = loss.item()
            compute += clock() - started
        self.phases = {"compute_s": compute, "between_s": between, "after_s": waited}
        return sum(self.losses.values()) / len(self.losses)

    def _default_loop(self) -> Iterator[int]:
        """This rank's indices, each run in the context the default accumulation wants: no
        synchronisation but for the last (stages 1 and 2; ``zero3_accum_nosync``), or a
        reduce-scatter every time (``zero3_accum``)."""
        for index in self.indices:
            last = index == self.indices[-1]
            if self.impl == "zero3_accum_nosync":  # FSDP2's switch; the setting at a forward decides for its backward
                self.wrapped.set_requires_gradient_sync(last)
            no_sync = not last and STAGE[self.impl] < 3
            with self.wrapped.no_sync() if no_sync else contextlib.nullcontext():
                yield index

    def global_loss(self) -> float:
        """The last step's loss over the global batch (collective): every micro-batch's loss,
        summed in index order in float64, the same computation for every row."""
        by_index = torch.zeros(self.count, dtype=torch.float64)
        for index, loss in self.losses.items():
            by_index[index] = loss
        device = next(self.wrapped.parameters()).device
        by_index = by_index.to(device)
        dist.all_reduce(by_index)  # one contributor per entry: exact
        return math.fsum(by_index.tolist()) / self.count


def accumulation_rows(rows: dict) -> list[str]:
    """The accumulation rows of one size's results, in launch order."""
    return [impl for impl in rows if impl in ACCUMULATION]


def reference_invariant(rows: dict) -> Optional[str]:
    """The invariant row every row's parameters are compared with: the launch's first."""
    return next((impl for impl in rows if impl in ACCUMULATION and impl.endswith("_invariant")), None)


ACCUMULATION_HEAD = ["implementation", "stage", "step s", "invariant / default ± noise", "compute ms", "between ms", "after ms",
                     "optim ms", "MiB sent", "sent: invariant / default", "calls", "peak MiB (largest rank)",
                     "peak: invariant / default", "loss", "max abs diff to default", "max abs diff to first invariant",
                     "digest"]


def accumulation_cells(impl: str, rows: dict, name: str) -> list[str]:
    """One row of the accumulation table: ``name`` and the figures, each invariant row's ratios
    to its stage's default row."""
    row = rows[impl]
    default = rows.get(DEFAULT_OF.get(impl, ""))
    ms = lambda key: f"{1e3 * row[key]:.0f}" if key in row else "-"  # noqa: E731
    peak, default_peak = max(row.get("peak_rise") or [0]), max((default or {}).get("peak_rise") or [0])

    def versus(mine: float, theirs: Optional[float]) -> str:
        return f"{mine / theirs:.2f}" if theirs else "-"

    def step_versus() -> str:
        """The median of the per-round step ratios, ± half their spread. The rows take turns, so a
        round's two steps ran seconds apart: on this shared machine, whose load comes and goes,
        a paired ratio is steadier than the ratio of the two medians."""
        if not default:
            return "-"
        per_round = [statistics.median(a) / statistics.median(b) for a, b in zip(row["round_steps_s"], default["round_steps_s"])]
        if not per_round:
            return "-"
        return f"{statistics.median(per_round):.2f} ± {(max(per_round) - min(per_round)) / 2:.2f}"

    def diff(key: str) -> str:
        value = row.get(key, float("nan"))
        return "-" if value != value else "0" if value == 0 else f"{value:.1e}"

    return [name, str(STAGE[impl]), f"{row['median_step_s']:.3f}",
            step_versus(), ms("median_compute_s"),
            ms("median_between_s"), ms("median_after_s"), f"{1e3 * row['median_optim_step_s']:.0f}",
            f"{row['comm_bytes'] / 2**20:.1f}", versus(row["comm_bytes"], default and default["comm_bytes"]),
            str(row["comm_calls_python"]), f"{peak / 2**20:.0f}" if peak else "-",
            versus(peak, default_peak) if peak else "-", f"{row['final_loss']:.6f}", diff("max_param_diff_vs_default"),
            diff("max_param_diff_vs_invariant"), row.get("param_digest", "-")]
