"""The model DDP cannot fit: a per-rank memory budget enforced by the operating system, under
which ``sharded.plan`` says DDP does not fit and ZeRO-3 does, and both are started to see.

    python examples/fit_in_budget.py                  # the last part of `make demo`
    python examples/fit_in_budget.py --budget 600MiB --dim 512 --layers 16 --steps 3

The driver prints ``plan``'s table for a GPT of the example's code (``examples/gpt.py``) at 2
ranks, then launches four runs of it, each on fresh rank processes: DDP and ZeRO-3 unlimited
(the reference losses and peaks), then DDP and ZeRO-3 under the budget. DDP stops on every
rank with an out-of-memory message; ZeRO-3 trains to the loss it reaches unlimited. Last, the
memory table (``estimate_memory``'s peak beside the measured one, per run) and the budget line
in ``<out>/memory.png``.

How the budget is enforced: each rank lowers its own ``RLIMIT_DATA`` (``resource.setrlimit``,
no privilege needed) just before it builds the model, to the data it has mapped at that
moment plus the budget. ``RLIMIT_DATA`` counts private writable mappings (Linux 4.7 and
later): the heap and anonymous mmaps, which is where tensors live, so an allocation past the
budget fails with ``ENOMEM`` and torch raises "can't allocate memory". It also counts what
torch maps once per process, whatever the model: libraries' writable data (830 MiB after
import on the CUDA build 2.14.1+cu130, 269 MiB on the CPU build 2.13.0+cpu) and the stacks of
threads torch starts on first use (on the CUDA build, eight autograd threads at ZeRO-3's first
backward: 68 MiB). So before setting the limit each rank runs one step of a tiny model built
the same way (:func:`warm_up`): the budget is then what the run's own data needs, on either
build. ``RLIMIT_AS`` would
count the whole address space, and torch's process reserves far more than it uses (libraries,
each thread's stack, glibc's 64 MiB per-thread malloc arenas reserved ``PROT_NONE``): 600 MiB
of address space already at start for 200 MiB of data, and more with every gloo or OpenMP
thread started later, so a budget in it is not a budget of live bytes. A cgroup's
``memory.max`` would bound resident memory exactly, but creating one needs systemd or root.

Why fresh processes per run: a rank that fails mid-step leaves the process group poisoned (a
later collective may hang on its peer), so each run's ranks are new processes (forked, per
rank, from one that imported torch once), and the driver, not the ranks, decides what a failure
means. A rank that runs out of memory reports where and exits; a peer blocked in a collective
gets a connection error within seconds and exits too; a rank still alive after ``--timeout`` is
killed. A peak is the rise of VmHWM over the resident set before the model is built, with
``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors go back to the system, less the file pages
(torch's own code) the step mapped meanwhile, which RLIMIT_DATA does not count either. (A
stopped run's peak can still sit above the budget: the limit counts address space mapped, the
peak resident pages.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402

from gpt import GPT, Block, next_token_loss  # noqa: E402  examples/gpt.py, beside this script
from peak_memory import DataPeak, status_kib  # noqa: E402
from sharded import estimate_memory  # noqa: E402
from sharded.plan import fit_table, parse_bytes, plan  # noqa: E402

VOCAB = 256
OOM_EXIT = 3  # a rank's exit status when it ran out of memory
RUNS = (("DDP", "ddp", False), ("ZeRO-3", "3", False), ("DDP", "ddp", True), ("ZeRO-3", "3", True))
STAGE_NUMBER = {"ddp": 0, "3": 3}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=parse_bytes, default=parse_bytes("800MiB"), help="bytes per rank, e.g. 800MiB")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--timeout", type=float, default=120, help="seconds a run may take before its ranks are killed")
    parser.add_argument("--out", default="demo_out")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # set by the driver for a rank process
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------ planning


def meta_model(args) -> GPT:
    with torch.device("meta"):
        return GPT(VOCAB, args.dim, args.layers, args.heads, args.seq)


def estimate_kwargs(args) -> dict:
    """What ``estimate_memory`` needs to know about a run: the example's optimizer, units and batch."""
    return dict(optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95)),
                wrap={Block}, example_input=torch.randint(0, VOCAB, (args.batch, args.seq + 1)),
                loss_fn=next_token_loss, built_whole=True)


def check_plan(args) -> dict[int, int]:
    """Print plan's table; fail unless DDP does not fit and ZeRO-3 does. Returns estimated peaks."""
    model, kwargs = meta_model(args), estimate_kwargs(args)
    print(fit_table(model, args.world_size, args.budget, (0, 1, 2, 3), **kwargs))
    fitting = {e.stage for e in plan(model, world_size=args.world_size, budget_bytes=args.budget, **kwargs)}
    if 0 in fitting or 3 not in fitting:
        raise SystemExit(f"--budget {args.budget / 2**20:.0f} MiB: this part needs DDP not to fit and ZeRO-3 to fit "
                         f"(fitting: {sorted(fitting)}); choose a budget between their peaks")
    return {s: estimate_memory(model, world_size=args.world_size, stage=s, **kwargs).peak_bytes for s in (0, 3)}


# ------------------------------------------------------------------------------ driver


def start_ranks(args, tmp: Path) -> list[subprocess.Popen]:
    """One process per rank, for all the runs: it imports once, then forks a fresh child per run."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    settings = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("out", "rank")]
    command = [sys.executable, str(Path(__file__).resolve()), *settings, "--out", str(tmp)]
    return [subprocess.Popen([*command, "--rank", str(r)], env=env, stdout=(tmp / f"rank{r}.log").open("w"),
                             stderr=subprocess.STDOUT) for r in range(args.world_size)]


def wait_for_run(args, name: str, tmp: Path, ranks: list[subprocess.Popen]) -> list[dict]:
    """Each rank's result of run ``name``: its JSON, or how its process ended."""
    results = []
    for rank, proc in enumerate(ranks):
        ended = tmp / f"{name}-rank{rank}.exit"
        while not ended.exists() and proc.poll() is None:
            time.sleep(0.05)
        path = tmp / f"{name}-rank{rank}.json"
        result = json.loads(path.read_text()) if path.exists() else {"status": "died"}
        code = int(ended.read_text()) if ended.exists() else proc.returncode
        result.update(rank=rank, returncode=code)
        results.append(result)
    return results


def describe(result: dict) -> str:
    if result["status"] == "ok":
        return f"rank {result['rank']}: trained, loss {result['loss']:.6f}, peak {result['peak'] / 2**20:.0f} MiB"
    if result["status"] == "oom":
        return f"rank {result['rank']}: {result['message']}"
    how = "killed after --timeout" if result["returncode"] == -signal.SIGKILL else f"status {result['returncode']}"
    return f"rank {result['rank']}: ended without a result ({how}); its output is printed below"


def drive(args) -> dict:
    """The whole part: plan, the four runs, the report. Returns the runs' results by name."""
    estimates = check_plan(args)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="fit-in-budget-") as tmp:
        ranks = start_ranks(args, Path(tmp))
        try:
            for name, stage, limited in RUNS:
                label = f"{name} {'within ' + format(args.budget / 2**20, '.0f') + ' MiB' if limited else 'unlimited'}"
                print(f"\n{label}:", flush=True)
                results = wait_for_run(args, run_name(stage, limited), Path(tmp), ranks)
                for r in results:
                    print("  " + describe(r), flush=True)
                runs[(stage, limited)] = results
        finally:
            for rank, proc in enumerate(ranks):
                proc.wait(timeout=args.timeout)
                log = (Path(tmp) / f"rank{rank}.log").read_text().strip()
                if log:
                    print(f"rank {rank}'s output:\n{log}", file=sys.stderr)
    report(args, estimates, runs)
    return runs


def report(args, estimates: dict[int, int], runs: dict) -> None:
    """Losses compared, the memory table (estimate beside measurement), and the plot."""
    def loss(key):
        ok = [r for r in runs[key] if r["status"] == "ok"]
        return ok[0]["loss"] if len(ok) == len(runs[key]) else None

    limited, unlimited = loss(("3", True)), loss(("3", False))
    print(f"\nZeRO-3 loss after {args.steps} steps: {limited} within the budget, {unlimited} unlimited"
          f" ({'the same' if limited is not None and limited == unlimited else 'DIFFERENT'}); "
          f"DDP unlimited: {loss(('ddp', False))}")
    print(f"\n{'run':<22}{'estimated peak':>16}{'measured peak (max over ranks)':>34}  result")
    rows = []
    for name, stage, limited in RUNS:
        results = runs[(stage, limited)]
        peak = max(r.get("peak", 0) for r in results)
        outcome = ("trained" if all(r["status"] == "ok" for r in results)
                   else "out of memory" if any(r["status"] == "oom" for r in results) else "failed")
        measured = f"{peak / 2**20:.0f} MiB" + (" (when it stopped)" if outcome != "trained" else "")
        label = f"{name} {'budget' if limited else 'unlimited'}"
        print(f"{label:<22}{estimates[STAGE_NUMBER[stage]] / 2**20:>12.0f} MiB{measured:>34}  {outcome}")
        rows.append((label, estimates[STAGE_NUMBER[stage]], peak, outcome))
    warmed = max(r.get("warm_up", 0) for results in runs.values() for r in results)
    print(f"budget: {args.budget / 2**20:.0f} MiB per rank (RLIMIT_DATA over what each rank had mapped after a warm-up "
          f"step on a tiny model, which mapped up to {warmed / 2**20:.0f} MiB of threads and runtime state)")
    plot_budget(Path(args.out), rows, args.budget)


def plot_budget(out: Path, rows: list, budget: int) -> None:
    """Add the budget panel to ``<out>/memory.png``: the stages' estimated and measured peaks
    and the budget line, beside train_gpt's panel when its results are there."""
    from memory_plot import save_figure

    save_figure(out, budget_rows=rows, budget=budget)
    print(f"wrote {out / 'memory.png'}")


# ------------------------------------------------------------------------------ rank side


def run_name(stage: str, limited: bool) -> str:
    return f"{stage}-{'limited' if limited else 'unlimited'}"


def rank_main(args) -> int:
    """One rank's process: import what the runs use (so the measured rise is tensors, not code
    pages), then fork a fresh child per run and write how it ended; a child that outlives
    ``--timeout`` is killed."""
    import torch._dynamo  # noqa: F401  DDP imports it at its first build
    import torch.distributed  # noqa: F401
    import sharded.fsdp.api  # noqa: F401

    torch.set_num_threads(1)
    out = Path(args.out)
    for _, stage, limited in RUNS:
        name = run_name(stage, limited)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = run_rank(args, stage, limited, name)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        code = wait_or_kill(pid, args.timeout)
        publish(out / f"{name}-rank{args.rank}.exit", str(code))
    return 0


def publish(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: the driver polls for it and reads it once it exists."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def wait_or_kill(pid: int, timeout: float) -> int:
    """The child's exit status (negative: the signal that ended it), killing it after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def warm_up(stage: str, lr: float) -> None:
    """One training step of a tiny GPT built as the run builds its own, so that what torch maps
    once per process, whatever the model, is mapped before the budget is set on top of it.

    What a build maps on first use differs. Torch's CUDA build (2.14.1+cu130, measured on a
    machine with no GPU) starts eight autograd device threads (``pt_autograd_0`` to ``7``) at
    ZeRO-3's first backward; each one's stack is an 8 MiB private writable mapping (glibc's
    default, ``ulimit -s``) and its malloc arena starts with 132 KiB, which ``RLIMIT_DATA``
    counts: 68 MiB in all, and with the limit set before them ZeRO-3 ran out of a 115 MiB budget
    holding 49 MiB of data. The CPU build (2.13.0+cpu) starts none: its step maps 3 MiB at
    most. After this step the budget is what the run's model, gradients, optimizer state and
    activations need, on either build. The step's tensors are freed (``MALLOC_MMAP_THRESHOLD_`` gives them
    back), and the run's model is built afterwards from its own seed.
    """
    from train_gpt import build

    wrapped, optimizer = build(stage, GPT(VOCAB, 16, 1, 1, 8), SimpleNamespace(lr=lr, lowbit=None))
    next_token_loss(wrapped, torch.zeros(1, 9, dtype=torch.long)).backward()
    optimizer.step()


def run_rank(args, stage: str, limited: bool, name: str) -> int:
    """One rank of one run: train ``--steps`` steps, write the result; on running out of memory,
    report where and exit with ``OOM_EXIT`` without touching the (now unreliable) group again."""
    import torch.distributed as dist

    from train_gpt import build

    out = Path(args.out)
    store = dist.FileStore(str(out / f"{name}.store"), args.world_size)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=args.timeout / 2))
    before_warm_up = status_kib()["VmData"] * 1024
    warm_up(stage, args.lr)
    mapped = status_kib()["VmData"] * 1024
    peak = DataPeak()
    if limited:
        resource.setrlimit(resource.RLIMIT_DATA, (mapped + args.budget, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    phase = "building the model"
    result: dict = {}
    try:
        torch.manual_seed(0)
        model = GPT(VOCAB, args.dim, args.layers, args.heads, args.seq)
        phase = "wrapping it"
        wrapped, optimizer = build(stage, model, SimpleNamespace(lr=args.lr, lowbit=None))
        for step in range(args.steps):
            g = torch.Generator().manual_seed(step * args.world_size + args.rank)
            tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g)
            phase = f"the forward and backward of step {step + 1}"
            optimizer.zero_grad()
            loss = next_token_loss(wrapped, tokens)
            loss.backward()
            phase = f"the optimizer step of step {step + 1}"
            optimizer.step()
        phase = "averaging the loss"
        total = loss.detach().clone()
        dist.all_reduce(total)
        result = {"status": "ok", "loss": total.item() / args.world_size}
    except (RuntimeError, MemoryError) as error:
        text = str(error)
        if not isinstance(error, MemoryError) and "can't allocate memory" not in text:
            raise
        wanted = re.search(r"tried to allocate (\d+) bytes", text)
        result = {"status": "oom", "message": (
            f"out of memory during {phase}: {args.budget / 2**20:.0f} MiB per rank is not enough "
            f"(an allocation of {int(wanted.group(1)) / 2**20 if wanted else float('nan'):.1f} MiB failed)")}
    result.update(peak=peak.rise(), warm_up=mapped - before_warm_up)
    (out / f"{name}-rank{args.rank}.json").write_text(json.dumps(result))
    if result["status"] != "ok":
        return OOM_EXIT  # a peer may still be in a collective the group cannot finish
    # No destroy_process_group either: the child ends with os._exit right after, which closes its
    # sockets, while gloo's teardown hung one rank after DDP now and then (twice in fresh clones),
    # holding that rank's later runs back until the others timed out.
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        return rank_main(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    drive(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
