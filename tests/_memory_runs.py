"""Measured peaks of real training steps, to hold ``sharded.estimate_memory`` against.

A rank's peak is the data it holds at its worst moment (examples/peak_memory.py: VmHWM's rise
over the resident set just before the case builds its model, less RssFile's, the file pages of
torch's code, which vary with the machine; forked and fresh processes then agree to 0.1 MiB).
The ranks must start with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then maps tensors of 64 KiB
and more and returns them on free, so the high-water mark follows live bytes); glibc reads it
when the process starts, so :func:`measure` launches fresh
processes rather than forking from the test harness's forkserver. Every case runs in a process
of its own, forked after the imports (cases run one after another in one process leave memory
behind that the next would count).

Run as a script it is one rank slot: ``python tests/_memory_runs.py RANK TMPDIR JOBS_JSON``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
# Jobs of one world size measured at once, each in processes of its own. 1: ZeRO-2's peak
# depends on timing (a reduce bucket sent to another owner is freed only once its reduce has
# completed, so a starved gloo thread leaves more buckets alive): measured 777 MiB instead of
# 696 for the MLP at world 2 with two jobs at once on a loaded 2-core machine.
CONCURRENT = 1


def measure(jobs: list[tuple[int, str]], timeout: float = 600.0) -> list[dict]:
    """Run each ``(world, case)`` job (case ``model:stage[:option...]``, e.g. ``mlp:3``, :func:`parse_case`) on fresh rank
    processes; returns per job ``{"world", "case", "measured": [peak rise per rank]}``.

    One "zygote" process per rank slot starts with the allocator setting and imports torch,
    DDP and sharded once; for every job it forks a child that joins that job's process group
    and runs the case, so each case is measured in a process of its own without paying the
    imports again (a forked child's resident set starts where its zygote's was).
    """
    slots = max(world for world, _ in jobs)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryDirectory(prefix="sharded-memory-") as tmp:
        spec = json.dumps([[world, case] for world, case in jobs])
        procs = [subprocess.Popen([sys.executable, __file__, str(rank), tmp, spec], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(slots)]
        outputs = [p.communicate(timeout=timeout) for p in procs]
        for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
            if p.returncode != 0:
                raise RuntimeError(f"measuring rank {rank} exited with {p.returncode}:\n{out[-2000:]}\n{err[-4000:]}")
        return [
            {"world": world, "case": case,
             "measured": [json.loads(Path(tmp, f"job{i}-rank{r}.json").read_text()) for r in range(world)]}
            for i, (world, case) in enumerate(jobs)
        ]


# ------------------------------------------------------------------------------ rank side


def build_model(name: str):
    import torch
    from torch import nn

    from examples.gpt import GPT, Block

    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(16)]), nn.Linear
    if name == "gpt":
        return GPT(vocab=256, dim=384, layers=6, heads=6, seq=128), Block
    raise ValueError(f"unknown model {name!r}")


def batch_for(name: str, rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(100 * step + rank)
    if name == "mlp":
        return torch.randn(32, 2048, generator=g)
    return torch.randint(0, 256, (4, 129), generator=g)


def loss_of(name: str, model, batch):
    from examples.gpt import next_token_loss

    if name == "mlp":
        return model(batch).square().mean()
    return next_token_loss(model, batch)


def stage_lowbit(stage: int, mode: Optional[str]):
    """What the stage's wrapper takes of the low-bit mode ``mode`` (``None``: exact): ZeRO-1's
    ``OSS`` its parameter format, ZeRO-2's ``ShardedDataParallel`` its gradient format, ZeRO-3's
    ``fully_shard`` both."""
    import dataclasses

    from sharded import LowBit

    if mode is None:
        return None
    policy = LowBit.mode(mode)
    if stage == 1:
        return dataclasses.replace(policy, grads=None)
    if stage == 2:
        return dataclasses.replace(policy, params=None)
    return policy


def wrap(stage: int, model, unit_class, bucket_view: bool = True, lowbit=None):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sharded import OSS, ShardedDataParallel, fully_shard

    if stage == 0:
        return DDP(model), torch.optim.Adam(model.parameters())
    if stage == 3:
        for sub in [m for m in model.modules() if isinstance(m, unit_class) and m is not model]:
            fully_shard(sub, lowbit=lowbit)
        fully_shard(model, lowbit=lowbit)
        return model, torch.optim.Adam(model.parameters())
    optimizer = OSS(model.parameters(), torch.optim.Adam, parameters_as_bucket_view=bucket_view,
                    lowbit=lowbit if stage == 1 else None)
    return (DDP(model) if stage == 1 else ShardedDataParallel(model, optimizer, lowbit=lowbit)), optimizer


def run_case(name: str, stage: int, rank: int, peak, bucket_view: bool = True, lowbit: Optional[str] = None) -> int:
    """The data peak in bytes (``peak``'s rise, examples/peak_memory.py) of two training steps of
    ``name`` at ``stage`` and the third step's backward, model build included.

    The first optimizer step creates the optimizer state: its peak is every later step's.
    The third backward is the first of the steady state: DDP re-plans its buckets in the
    second step's forward by the order the first backward saw, freeing the old ones, so only
    from the third backward on are its buckets resident from the start beside the activations.
    A third optimizer step would only repeat the first's peak. ``lowbit``: a ``LowBit.mode``
    name, of which the stage's wrapper takes its part (:func:`stage_lowbit`).

    With low-bit parameters at ZeRO-1, the second optimizer step is the first that holds the
    masters the first one kept beside the replicas it sets aside, so its peak is every later
    step's; low-bit gradients' residuals exist from the first backward on."""
    model, unit_class = build_model(name)
    wrapped, optimizer = wrap(stage, model, unit_class, bucket_view, stage_lowbit(stage, lowbit))
    for step in range(3):
        optimizer.zero_grad()
        loss_of(name, wrapped, batch_for(name, rank, step)).backward()
        if step < 2:
            optimizer.step()
    rise = peak.rise()
    if hasattr(wrapped, "remove_hooks"):
        wrapped.remove_hooks()
    del model, wrapped, optimizer
    return rise


def estimate_case(name: str, stage: int, world: int, lowbit: Optional[str] = None, **overrides):
    """``sharded.estimate_memory`` for a case, from a meta-device copy of its model."""
    import torch

    from sharded import estimate_memory

    with torch.device("meta"):
        model, unit_class = build_model(name)
    return estimate_memory(model, world_size=world, stage=stage, optimizer=torch.optim.Adam, wrap={unit_class},
                           example_input=batch_for(name, 0, 0), loss_fn=lambda m, b: loss_of(name, m, b),
                           built_whole=True, lowbit=stage_lowbit(stage, lowbit), **overrides)


def parse_case(case: str) -> tuple[str, int, dict]:
    """``model:stage[:option...]`` -> model, stage and :func:`run_case`'s options: ``own-storage``
    (``parameters_as_bucket_view=False``), ``lowbit=MODE`` (a ``LowBit.mode`` name)."""
    name, stage, *options = case.split(":")
    modes = [option.split("=", 1)[1] for option in options if option.startswith("lowbit=")]
    return name, int(stage), {"bucket_view": "own-storage" not in options, "lowbit": modes[0] if modes else None}


def zygote(rank: int, tmp: str, jobs: list) -> None:
    """Import once, then fork one child per job this rank slot takes part in, ``CONCURRENT``
    at a time (a child's peak is its own process's, whatever runs beside it)."""
    import torch
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import torch._dynamo  # noqa: F401  DDP imports it at its first build
    import sharded.fsdp.api  # noqa: F401  layer 3 and DTensor: imports, not the step, cost their memory

    torch.set_num_threads(1)
    for group in _groups(jobs):
        if rank >= group[0][1]:
            continue
        children = {}
        for index, world, case in group:
            pid = os.fork()
            if pid == 0:
                os._exit(child(rank, world, case, Path(tmp), index))
            children[pid] = (index, world, case)
        for pid, (index, world, case) in children.items():
            _, code = os.waitpid(pid, 0)
            if code != 0:
                raise SystemExit(f"rank {rank}: job {index} ({case} at world {world}) failed with status {code}")


def _groups(jobs: list) -> list[list[tuple[int, int, str]]]:
    """``(index, world, case)`` in runs of at most ``CONCURRENT`` consecutive jobs of one world
    size: every rank slot forks the same groups in the same order."""
    groups: list[list[tuple[int, int, str]]] = []
    for index, (world, case) in enumerate(jobs):
        if groups and len(groups[-1]) < CONCURRENT and groups[-1][0][1] == world:
            groups[-1].append((index, world, case))
        else:
            groups.append([(index, world, case)])
    return groups


def child(rank: int, world: int, case: str, tmp: Path, index: int) -> int:
    import torch.distributed as dist

    from examples.peak_memory import DataPeak

    try:
        store = dist.FileStore(str(tmp / f"store{index}"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        name, stage, options = parse_case(case)
        rise = run_case(name, stage, rank, DataPeak(), **options)
        (tmp / f"job{index}-rank{rank}.json").write_text(json.dumps(rise))
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        return 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    zygote(int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]))
