"""Memory given back (issue 36): models dropped and rebuilt, and long runs, at every stage.

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/memory_given_back.py --cycles 30 --steps 2000

Two measurements per stage, on each rank, one stage after another in the same processes:

- **cycles**: build a ``Linear(256,512)-Linear(512,512)-Linear(512,8)`` MLP and its wrapper, train
  3 Adam steps, drop every reference, ``--cycles`` times, then one ``gc.collect()``: how many of
  the models are still alive (weak references to the model and to a parameter) and how much the
  anonymous resident set (``RssAnon``) grew, per cycle, after one warm-up cycle.
- **steady**: one model trained ``--steps`` steps; ``RssAnon`` sampled every ``--every`` steps;
  the least-squares slope over the samples after ``--warmup`` steps, in KiB per 1,000 steps, and
  the range of those samples.

Start the ranks with ``MALLOC_MMAP_THRESHOLD_=65536`` (TESTING.md): glibc then maps every block
of 64 KiB and more and unmaps it on free, so the resident set follows live tensors instead of
what glibc keeps in its heap. Rank 0 prints a Markdown table; ``--stages`` picks stages (torch's
DDP with a plain Adam is the baseline row).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sharded


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))


def _ddp(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    return DDP(model), torch.optim.Adam(model.parameters(), lr=1e-3)


def _oss_ddp(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    return DDP(model), sharded.OSS(model.parameters(), torch.optim.Adam, lr=1e-3)


def _sharded_ddp(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    optimizer = sharded.OSS(model.parameters(), torch.optim.Adam, lr=1e-3)
    return sharded.ShardedDataParallel(model, optimizer), optimizer


def _fully_shard(model: nn.Module, owned: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    from sharded.fsdp import Owned

    placement = {"shard_placement_fn": lambda p: Owned() if p.dim() == 2 else None} if owned else {}
    for layer in model.children():
        if isinstance(layer, nn.Linear):
            sharded.fully_shard(layer, **placement)
    sharded.fully_shard(model, **placement)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _fsdp_wrapper(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    wrapped = sharded.FullyShardedDataParallel(model)
    return wrapped, torch.optim.Adam(wrapped.parameters(), lr=1e-3)


STAGES: dict[str, Callable[[nn.Module], tuple[nn.Module, torch.optim.Optimizer]]] = {
    "ddp": _ddp,
    "zero1": _oss_ddp,
    "zero2": _sharded_ddp,
    "zero3": _fully_shard,
    "zero3_owned": lambda m: _fully_shard(m, owned=True),
    "fsdp1": _fsdp_wrapper,
}
LABELS = {
    "ddp": "torch DDP + Adam (the baseline)",
    "zero1": "OSS + DDP",
    "zero2": "OSS + ShardedDataParallel",
    "zero3": "fully_shard",
    "zero3_owned": "fully_shard, Owned() matrices",
    "fsdp1": "FullyShardedDataParallel",
}


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:")) / 1024


def _train(wrapped: nn.Module, optimizer: torch.optim.Optimizer, steps: int, first: int = 0) -> None:
    rank = dist.get_rank()
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(rank * 1_000_003 + step)
        wrapped(torch.randn(16, 256, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _cycle(wrap: Callable) -> tuple[weakref.ref, weakref.ref]:
    model = _mlp()
    wrapped, optimizer = wrap(model)
    _train(wrapped, optimizer, 3)
    return weakref.ref(model), weakref.ref(next(model.parameters()))


def measure_cycles(wrap: Callable, cycles: int) -> dict:
    """Models alive after ``cycles`` build-train-drop cycles and one collection; growth per cycle."""
    _cycle(wrap)
    gc.collect()
    before = _rss_anon_mib()
    refs = [_cycle(wrap) for _ in range(cycles)]
    gc.collect()
    alive = sum(model() is not None or param() is not None for model, param in refs)
    return {"alive": alive, "mib_per_cycle": (_rss_anon_mib() - before) / cycles}


def measure_steady(wrap: Callable, steps: int, every: int, warmup: int) -> dict:
    """The resident set's slope over a long run, after warm-up (KiB per 1,000 steps)."""
    wrapped, optimizer = wrap(_mlp())
    samples: list[tuple[int, float]] = []
    start = time.perf_counter()
    for first in range(0, steps, every):
        _train(wrapped, optimizer, every, first)
        if first + every > warmup:
            samples.append((first + every, _rss_anon_mib()))
    seconds = time.perf_counter() - start
    xs, ys = [s for s, _ in samples], [m for _, m in samples]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return {"kib_per_1000_steps": slope * 1024 * 1000, "range_mib": max(ys) - min(ys), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=50, help="steps between samples of the steady run")
    parser.add_argument("--warmup", type=int, default=200, help="steps before the steady run's first sample")
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        raise SystemExit("start the ranks with MALLOC_MMAP_THRESHOLD_=65536 (see the docstring)")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for stage in args.stages.split(","):
        cycles = measure_cycles(STAGES[stage], args.cycles) if args.cycles else None
        steady = measure_steady(STAGES[stage], args.steps, args.every, args.warmup) if args.steps else None
        rows.append((stage, _gathered(cycles, steady, world)))
    if rank == 0:
        print(f"world {world}, {args.cycles} cycles, {args.steps} steps (slope after {args.warmup}), "
              f"torch {torch.__version__}, sharded at {os.path.dirname(sharded.__file__)}")
        print("| stage | models alive after the cycles | RssAnon per cycle (MiB) | "
              "slope over the long run (KiB / 1,000 steps) | range (MiB) | long run (s) |")
        print("|---|---|---|---|---|---|")
        for stage, gathered in rows:
            print(f"| {LABELS[stage]} | " + " | ".join(_cells(gathered)) + " |")
    dist.destroy_process_group()


KEYS = (("alive", "mib_per_cycle"), ("kib_per_1000_steps", "range_mib", "seconds"))


def _gathered(cycles: dict | None, steady: dict | None, world: int) -> list:
    """Every rank's ``(cycles, steady)``, through a tensor all-gather (object collectives need
    numpy, which sharded does not depend on)."""
    parts = (cycles, steady)
    mine = torch.tensor([float(part[k]) if part else float("nan") for part, keys in zip(parts, KEYS) for k in keys],
                        dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    out = []
    for values in everyone:
        it = iter(values.tolist())
        out.append(tuple(None if part is None else {k: next(it) for k in keys} for part, keys in zip(parts, KEYS)))
    return out


def _cells(per_rank: list) -> list[str]:
    """One table row's cells, each rank's value separated by ' / '."""
    def joined(part: int, key: str, fmt: str) -> str:
        values = [r[part][key] for r in per_rank if r[part] is not None]
        return " / ".join(format(v, fmt) for v in values) if values else "-"

    return [joined(0, "alive", ".0f"), joined(0, "mib_per_cycle", "+.2f"),
            joined(1, "kib_per_1000_steps", "+.1f"), joined(1, "range_mib", ".2f"), joined(1, "seconds", ".0f")]


if __name__ == "__main__":
    main()
