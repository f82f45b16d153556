"""How often a short job aborts at exit, per implementation and launcher (not run in CI).

    python benchmarks/abort_rate.py --runs 30                    # all four, torchrun and spawn
    python benchmarks/abort_rate.py --runs 3 --impls ddp,zero3 --launchers spawn --no-destroy

A gloo job can die of SIGABRT after training has finished ("terminate called without an active
exception"): gloo's worker threads still hold tensors while the interpreter finalises. Plain
torch DDP does it too, so the question for sharded is only whether it makes that likelier. This
script answers it by counting: the same short job (a 3-layer MLP, 3 Adam steps, 2 ranks, gloo on
the CPU) is run ``--runs`` times per implementation, under ``torchrun`` and under
``torch.multiprocessing.spawn``. Implementations take turns run after run, so that every one sees
the same machine load.

A run counts as an *abort at exit* when every rank printed that its steps were done and the job
then died of SIGABRT (exit code -6 or 134, or the C++ runtime's message on stderr). Anything else
that fails (an abort before the steps were done, an error, a hang past ``--job-timeout``) is
counted apart, with the first lines of its stderr, so a real crash is never filed as the known
abort.

Implementations: ``ddp`` (torch DDP), ``zero1`` (sharded OSS + DDP), ``zero2`` (OSS +
ShardedDataParallel), ``zero3`` (sharded.fully_shard per layer and on the root).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IMPLS = ("ddp", "zero1", "zero2", "zero3")
LAUNCHERS = ("torchrun", "spawn")
STEPS = 3
WORLD = 2
DONE = "steps done on rank"
ABORT_MESSAGE = "terminate called without an active exception"
ABORT_MARKERS = (ABORT_MESSAGE, "SIGABRT", "exitcode  : -6", "exit code -6")


# ------------------------------------------------------------------------------ the job


def build(impl: str):
    """The model to call and the optimizer to step for ``impl``, on this rank's process group."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sharded import OSS, ShardedDataParallel, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    if impl == "ddp":
        return DDP(model), torch.optim.Adam(model.parameters(), lr=1e-3)
    if impl == "zero1":
        return DDP(model), OSS(model.parameters(), torch.optim.Adam, lr=1e-3)
    if impl == "zero2":
        optimizer = OSS(model.parameters(), torch.optim.Adam, lr=1e-3)
        return ShardedDataParallel(model, optimizer), optimizer
    if impl == "zero3":
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    raise ValueError(f"--impl: unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")


def train(rank: int, impl: str, destroy: bool) -> None:
    """The job itself, on a process group already initialised."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    model, optimizer = build(impl)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    print(f"{DONE} {rank}", flush=True)
    if destroy:
        dist.destroy_process_group()


def torchrun_rank(impl: str, destroy: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    train(dist.get_rank(), impl, destroy)


def spawned_rank(rank: int, impl: str, destroy: bool, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    train(rank, impl, destroy)


def spawn_job(impl: str, destroy: bool) -> None:
    import torch.multiprocessing as mp

    mp.spawn(spawned_rank, args=(impl, destroy, free_port()), nprocs=WORLD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the driver


@dataclass
class Outcome:
    kind: str  # "ok", "abort at exit" or "other failure"
    detail: str = ""


def run_job(launcher: str, impl: str, destroy: bool, timeout: float) -> Outcome:
    """One job in fresh processes, classified by how it ended."""
    job = [str(Path(__file__).resolve()), "--job", impl, "--launcher", launcher, "--destroy" if destroy else "--no-destroy"]
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", *job]
    else:
        command = [sys.executable, *job]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return Outcome("other failure", f"still running after {timeout:.0f} s (killed)")
    return classify(done.returncode, done.stdout, done.stderr)


def classify(returncode: int, stdout: str, stderr: str) -> Outcome:
    steps_done = all(f"{DONE} {rank}" in stdout for rank in range(WORLD))
    aborted = returncode in (-6, 134) or any(marker in stderr for marker in ABORT_MARKERS)
    if steps_done and aborted:
        return Outcome("abort at exit")
    if returncode == 0 and steps_done:
        return Outcome("ok")
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    tail = " | ".join(lines[-3:])[:300]
    when = "after" if steps_done else "before"
    return Outcome("other failure", f"exit code {returncode} {when} every rank's steps were done: {tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="jobs per implementation and launcher")
    parser.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS))
    parser.add_argument("--launchers", type=lambda s: s.split(","), default=list(LAUNCHERS))
    parser.add_argument(
        "--destroy", action=argparse.BooleanOptionalAction, default=True,
        help="whether the job calls dist.destroy_process_group() after its steps (default: yes)",
    )
    parser.add_argument("--job-timeout", type=float, default=300.0, help="seconds before a job counts as hung")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # internal: run one job's ranks
    parser.add_argument("--launcher", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.job:
        (torchrun_rank if args.launcher == "torchrun" else spawn_job)(args.job, args.destroy)
        return
    for name, chosen, known in (("--impls", args.impls, IMPLS), ("--launchers", args.launchers, LAUNCHERS)):
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            parser.error(f"{name}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    measure(args)


def measure(args: argparse.Namespace) -> None:
    counts: Counter = Counter()
    failures: list[str] = []
    start = time.monotonic()
    print(f"{args.runs} runs per implementation and launcher; destroy_process_group: {'yes' if args.destroy else 'no'}", flush=True)
    for run in range(1, args.runs + 1):
        for launcher in args.launchers:
            for impl in args.impls:
                outcome = run_job(launcher, impl, args.destroy, args.job_timeout)
                counts[launcher, impl, outcome.kind] += 1
                if outcome.kind == "other failure":
                    failures.append(f"run {run} {launcher} {impl}: {outcome.detail}")
                print(f"run {run:3d}  {launcher:8s}  {impl:5s}  {outcome.kind}  ({time.monotonic() - start:.0f} s)", flush=True)
    print(table(counts, args))
    for line in failures:
        print(line)


def table(counts: Counter, args: argparse.Namespace) -> str:
    """Markdown: aborts at exit (and other failures) out of the runs, launchers side by side."""
    head = "| implementation | " + " | ".join(f"{launcher}: aborts at exit | other failures" for launcher in args.launchers) + " |"
    rule = "|---|" + "---:|---:|" * len(args.launchers)
    rows = [
        f"| {impl} | "
        + " | ".join(
            f"{counts[launcher, impl, 'abort at exit']}/{args.runs} | {counts[launcher, impl, 'other failure']}"
            for launcher in args.launchers
        )
        + " |"
        for impl in args.impls
    ]
    title = f"\nAborts at exit, {args.runs} runs each, destroy_process_group: {'yes' if args.destroy else 'no'}\n"
    return title + "\n".join([head, rule, *rows])


if __name__ == "__main__":
    main()
