"""Train a small GPT-style byte model on Python's own standard library, with DDP or ZeRO-1/2/3.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py            # what `make demo` runs
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --stage 2 --accumulate 2 --amp bf16
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --stage 2 --resume
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 examples/train_gpt.py --stage 2 --resume
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --stage 3 --invariant --micro-batches 8
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --stage 1,2,3 --lowbit int8

Stages, on the same model code: ``ddp`` = DDP + AdamW; ``1`` = DDP + ``sharded.OSS(AdamW)``
(optimizer state sharded); ``2`` = ``sharded.ShardedDataParallel`` + ``OSS`` (gradients sharded
too); ``3`` = ``sharded.fully_shard`` on every block and the model + AdamW (parameters sharded
too). ``--stage ddp,1,2,3`` trains each in turn from the same weights on the same batches and
compares what each rank holds at the end (a table and ``<out>/memory.png``).

Checkpoints are sharded (``sharded.checkpoint``, on torch.distributed.checkpoint): every
``--save-every`` steps and after the last (``--save-every 0``: after the last only) each rank
writes what it holds to ``<out>/checkpoints/stage-S/step-N``, which appears atomically once
complete. ``--resume`` continues from the latest complete one, at any number of ranks. If a rank
dies or stops answering (``--crash-at`` / ``--freeze-at`` show it), the others stop within
``--timeout`` seconds (plus a few to tell which rank) with an error naming it and the step;
under ``torchrun --max-restarts N`` the job restarts and resumes, ending exactly where an
uninterrupted run ends (the batches of a step depend only on the step and the rank).

``--invariant --micro-batches M`` trains the same bits at any number of ranks that divides ``M``
(``sharded.invariant.MicroBatches``; ``M`` a power of two): ``--batch`` is then the global batch, ``M``
micro-batches of ``batch / M`` sequences, each drawn from (step, micro-batch index) alone, and the
gradients, the clipping norm, the printed losses (rank 0, one line a step), the validation loss,
the parameters and the optimizer state come out bit-identical at 1, 2, 4... ranks. So does a run
saved at one world size and resumed at another. On the CPU each rank then uses ``--threads``
intra-op threads (default 1) whatever the world size, since a matrix product's bits depend on how
it is split over threads; on CUDA deterministic algorithms are switched on.

``--lowbit MODE`` sends parameters and/or gradients in fewer bits (a mode of ``sharded.LowBit.mode``:
``int8``, ``int4-grads``, ``fp8``...; ``off`` sends everything exact and prints the same lines):
stage 1 gives the mode's parameter format to ``OSS`` (its broadcast of updated parameters), stage 2
its gradient format to ``ShardedDataParallel`` (the reduce to each owner) and its parameter format
to ``OSS``, stage 3 both to ``fully_shard`` (its all-gathers and reduce-scatters). A stage that
would send nothing in fewer bits under the mode (``ddp``; stage 1 with a gradients-only mode) is
refused. Rank 0 prints one line a step: the loss, every digit, and the bytes it sent in that step's
low-bit collectives beside what the same collectives send exact (``lowbit_traffic``), and the
step's time. ``--check-every K`` runs the shadow check every ``K`` steps (``LowBit(check_every=K)``:
the exact collective beside each low-bit one, its relative error logged on ``sharded.lowbit``,
which the script shows).

On GPUs the same script uses NCCL, one rank per GPU (``--nproc-per-node`` = GPUs per node). Across
machines use torchrun's usual rendezvous instead of ``--standalone``, on every node::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 \\
             --rdzv-backend c10d --rdzv-endpoint HOST:29500 examples/train_gpt.py

The text is every top-level ``.py`` file of the standard library (found through ``sysconfig``),
concatenated in name order; the last 10 % is held out for validation. No download.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import logging
import os
import signal
import sysconfig
import time
from pathlib import Path
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpt import GPT, next_token_loss  # examples/gpt.py, beside this script
from peak_memory import DataPeak
import sharded
from sharded import OSS, LowBit, ShardedDataParallel, ShardedGradScaler, checkpoint, fully_shard
from sharded.invariant import MicroBatches

VOCAB = 256  # bytes


def stdlib_text() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) bytes of the standard library's top-level modules."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8).long()
    split = int(0.9 * len(data))
    return data[:split], data[split:]


def sample(data: torch.Tensor, generator: torch.Generator, batch: int, seq: int, device) -> torch.Tensor:
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
    return torch.stack([data[s : s + seq + 1] for s in starts]).to(device)


def build(stage: str, model: GPT, args):
    """(wrapped model, optimizer) for a stage, with ``--lowbit``'s policy where the stage sends it."""
    hyper = dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    lowbit = stage_lowbit(stage, args.lowbit)
    if stage == "ddp":
        return DDP(model), torch.optim.AdamW(model.parameters(), **hyper)
    if stage == "3":  # bottom-up: each block is a unit, the model the unit for the rest
        for block in model.blocks:
            fully_shard(block, lowbit=lowbit["fully_shard"])
        fully_shard(model, lowbit=lowbit["fully_shard"])
        return model, torch.optim.AdamW(model.parameters(), **hyper)  # built after sharding
    optimizer = OSS(model.parameters(), torch.optim.AdamW, lowbit=lowbit["OSS"], **hyper)
    if stage == "1":
        return DDP(model), optimizer
    return ShardedDataParallel(model, optimizer, lowbit=lowbit["ShardedDataParallel"]), optimizer


def stage_lowbit(stage: str, policy: Optional[LowBit]) -> dict[str, Optional[LowBit]]:
    """What each wrapper of ``stage`` is given under ``policy``: ``OSS`` broadcasts parameters
    (stages 1 and 2), ``ShardedDataParallel`` reduces gradients (stage 2), ``fully_shard`` does both
    (stage 3). A wrapper whose collective the policy leaves exact gets ``None``."""
    if policy is None:
        return {"OSS": None, "ShardedDataParallel": None, "fully_shard": None}
    params = replace(policy, grads=None) if policy.params is not None else None
    grads = replace(policy, params=None) if policy.grads is not None else None
    return {"OSS": params, "ShardedDataParallel": grads, "fully_shard": policy}


def lowbit_refusal(stage: str, policy: Optional[LowBit]) -> Optional[str]:
    """Why ``stage`` cannot run ``policy`` (``None`` when it can): a stage that would send nothing
    in fewer bits would print exact bytes under a low-bit name."""
    if policy is None:
        return None
    if stage == "ddp":
        return "--lowbit: the ddp stage's all-reduce has no low-bit path (stages 1, 2 and 3 have)"
    if stage == "1" and policy.params is None:
        return f"--lowbit: stage 1 sends only parameters (OSS's broadcast) and this mode sends only gradients in fewer bits ({policy})"
    return None


def lowbit_traffic(wrapped: Any, optimizer: Any) -> tuple[int, int]:
    """(bytes sent, bytes the same collectives send exact) by this rank in the last step: ``OSS``'s
    broadcasts and ``ShardedDataParallel``'s reduces, or the root ``fully_shard`` module's gathers
    and reduce-scatters (its ``lowbit_traffic`` sums its units'). ``None`` where a policy is off."""
    steps = [t for t in (getattr(s, "lowbit_traffic", None) for s in (optimizer, wrapped)) if t is not None]
    return sum(t.sent_bytes for t in steps), sum(t.exact_bytes for t in steps)


@torch.no_grad()
def validation_loss(model: nn.Module, val: torch.Tensor, args, device, micro_batches: Optional[MicroBatches]) -> float:
    """The mean loss on held-out text: ``--val-batches`` batches per rank, averaged over the ranks
    (with ``--invariant``: :func:`invariant_validation_loss`)."""
    if micro_batches is not None:
        return invariant_validation_loss(model, micro_batches, val, args, device)
    g = torch.Generator().manual_seed(1234)  # the same validation batches every time
    total = torch.zeros((), device=device)
    for _ in range(args.val_batches):
        with autocast(args, device):
            total += next_token_loss(model, sample(val, g, args.batch, args.seq, device))
    dist.all_reduce(total)
    return total.item() / args.val_batches / dist.get_world_size()


@torch.no_grad()
def invariant_validation_loss(model: nn.Module, micro_batches: MicroBatches, val: torch.Tensor, args, device) -> float:
    """``--val-batches`` global batches of held-out text, the same bits at every world size: each
    micro-batch drawn from (batch, index) alone, each batch's mean taken by ``MicroBatches.mean``
    (the canonical tree) and the batches' means added in order on every rank."""
    total = 0.0
    for batch in range(args.val_batches):
        losses = []
        for index in micro_batches.indices:
            g = torch.Generator().manual_seed(batch * args.micro_batches + index)
            with autocast(args, device):
                losses.append(next_token_loss(model, sample(val, g, micro_batch_size(args), args.seq, device)))
        total += micro_batches.mean(losses).item()
    return total / args.val_batches


def micro_batch_size(args) -> int:
    """Sequences in one forward: ``--batch / M`` with ``--invariant``, else ``--batch``."""
    return args.batch // args.micro_batches if args.invariant else args.batch


def autocast(args, device):
    if args.amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if args.amp == "bf16" else torch.float16)


def train_stage(stage: str, args, device, train: torch.Tensor, val: torch.Tensor, peers: checkpoint.PeerWatch) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    peak_meter = DataPeak()
    torch.manual_seed(0)
    model = GPT(VOCAB, args.dim, args.layers, args.heads, args.seq).to(device)
    wrapped, optimizer = build(stage, model, args)
    micro_batches = MicroBatches(wrapped, args.micro_batches) if args.invariant else None
    scaler = ShardedGradScaler(enabled=args.amp == "fp16", device=device.type)
    checkpoints = Path(args.out) / "checkpoints" / f"stage-{stage}"
    start = resume(checkpoints, wrapped, optimizer, scaler) if args.resume else 0
    progress = progress_bar(rank, start, args.steps, stage)
    tokens_per_step = args.batch * args.seq * (1 if args.invariant else args.accumulate * world)
    first_val = validation_loss(wrapped, val, args, device, micro_batches)
    peak: Optional[int] = None
    tick = time.perf_counter()
    for step in range(start, args.steps):
        peers.begin_step(step)  # a PeerFailure names the step, and the rank that stopped answering
        fail_if_asked(step, args)
        optimizer.zero_grad()
        if micro_batches is None:
            losses = accumulated_backward(step, wrapped, scaler, train, args, device)
        else:
            losses = invariant_backward(step, wrapped, micro_batches, scaler, train, args, device)
        grads = held_bytes(p.grad for p in model.parameters() if p.grad is not None)
        scaler.unscale_(optimizer)
        clip_gradients(model, optimizer, micro_batches)
        scaler.step(optimizer)
        scaler.update()
        loss = micro_batches.mean(losses).item() if micro_batches else losses[-1].item()
        now = time.perf_counter()
        progress.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / (now - tick):,.0f}")
        progress.update()
        if micro_batches is not None and rank == 0:  # every digit, to compare runs at other world sizes
            progress.write(f"stage {stage} step {step + 1} loss {loss:.7f}")
        elif args.lowbit_name is not None and rank == 0:  # every digit, to compare with the exact run (--lowbit off)
            sent, exact = lowbit_traffic(wrapped, optimizer)
            progress.write(f"stage {stage} step {step + 1} loss {loss:.7f} sent {sent} bytes exact {exact} bytes "
                           f"time {1000 * (now - tick):.1f} ms")
        tick = now
        if checkpoint_due(step + 1, args):
            peak = peak_meter.rise() if peak is None else peak  # the steps' peak, not the checkpoint writer's
            save(checkpoints, step + 1, wrapped, optimizer, scaler)
    progress.close()
    peak = peak_meter.rise() if peak is None else peak
    final_val = validation_loss(wrapped, val, args, device, micro_batches)
    if micro_batches is not None and rank == 0:
        print(f"stage {stage} validation loss {first_val:.7f} -> {final_val:.7f}")
    local = optimizer.optim if isinstance(optimizer, OSS) else optimizer
    state = held_bytes(v for s in local.state.values() for v in s.values() if torch.is_tensor(v))
    return {
        "val": (first_val, final_val),
        "params": gather(held_bytes(model.parameters()), device),
        "grads": gather(grads if args.steps > start else 0, device),
        "state": gather(state, device),
        "peak": gather(peak, device),
    }


def accumulated_backward(step: int, wrapped: Any, scaler, train: torch.Tensor, args, device) -> list[torch.Tensor]:
    """Forward and backward of this rank's ``--accumulate`` micro-batches, drawn from (step, rank),
    under ``no_sync`` but the last; returns the last one's loss."""
    g = torch.Generator().manual_seed(step * dist.get_world_size() + dist.get_rank())  # nothing else
    for micro in range(args.accumulate):
        last = micro == args.accumulate - 1
        with (contextlib.nullcontext() if last else wrapped.no_sync()), autocast(args, device):
            loss = next_token_loss(wrapped, sample(train, g, args.batch, args.seq, device))
        scaler.scale(loss / args.accumulate).backward()
    return [loss.detach()]


def invariant_backward(step: int, wrapped: nn.Module, micro_batches: MicroBatches, scaler, train: torch.Tensor,
                       args, device) -> list[torch.Tensor]:
    """Forward and backward of this rank's micro-batches of the step's global batch, each drawn
    from (step, index) alone and each its own mean loss; after the loop the gradients hold the
    mean over all of them, the same bits at any world size. Returns this rank's losses."""
    losses = []
    for index in micro_batches:
        g = torch.Generator().manual_seed(step * args.micro_batches + index)
        with autocast(args, device):
            loss = next_token_loss(wrapped, sample(train, g, micro_batch_size(args), args.seq, device))
        scaler.scale(loss).backward()
        losses.append(loss.detach())
    return losses


def clip_gradients(model: nn.Module, optimizer, micro_batches: Optional[MicroBatches]) -> None:
    """Clip by the global gradient norm 1.0: the world-size-invariant norm with ``--invariant``,
    ``OSS``'s (gradients spread over owners) or torch's otherwise."""
    if micro_batches is not None:
        micro_batches.clip_grad_norm_(1.0)
    elif isinstance(optimizer, OSS):
        optimizer.clip_grad_norm(1.0)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def checkpoint_due(done: int, args) -> bool:
    """Whether to save after ``done`` steps: every ``--save-every`` steps and at the end
    (``--save-every 0``: at the end only)."""
    return done == args.steps or (args.save_every > 0 and done % args.save_every == 0)


def save(root: Path, step: int, model: nn.Module, optimizer, scaler) -> None:
    """Collective: each rank writes what it holds (no gathering on rank 0) into
    ``root/step-N``, which becomes visible in one atomic rename once every rank is done."""
    state = checkpoint.get_state_dict(model, optimizer)
    state["scaler"] = scaler.state_dict()
    state["step"] = step
    checkpoint.save(state, root / f"step-{step:06d}")


def resume(root: Path, model: nn.Module, optimizer, scaler) -> int:
    """Collective: load the latest complete checkpoint under ``root``, saved at any world size
    and stage; return its step (0 when there is none)."""
    latest = checkpoint.latest_checkpoint(root)
    if latest is None:
        return 0
    state = checkpoint.get_state_dict(model, optimizer)  # what this rank wants: its own shard
    state["scaler"] = scaler.state_dict()
    state["step"] = 0
    checkpoint.load(state, latest)
    checkpoint.set_state_dict(model, optimizer, state)
    scaler.load_state_dict(state["scaler"])
    if dist.get_rank() == 0:
        print(f"resuming from {latest}")
    return state["step"]


def fail_if_asked(step: int, args) -> None:
    """``--crash-at`` / ``--freeze-at``: rank 1 kills (SIGKILL) or freezes (SIGSTOP) itself at the
    start of that step, on the job's first attempt only, to show (and test) that the others stop
    with an error naming it and that a restarted job resumes and ends where an uninterrupted one does."""
    if dist.get_rank() != 1 or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if step == args.crash_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if step == args.freeze_at:
        print(f"rank 1 freezes (SIGSTOP) at step {step} at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


def held_bytes(tensors) -> int:
    """Bytes this rank holds (of a sharded DTensor: its local shard)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def gather(value: int, device) -> list[int]:
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [int(t.item()) for t in out]


def progress_bar(rank: int, start: int, total: int, stage: str):
    from tqdm import tqdm

    return tqdm(initial=start, total=total, desc=f"stage {stage}", disable=rank != 0, dynamic_ncols=True)


def estimated(stage: str, args) -> "sharded.MemoryEstimate":
    """``sharded.estimate_memory`` for a stage of this run (fp32, one micro-batch), from a meta model."""
    from gpt import Block

    with torch.device("meta"):
        model = GPT(VOCAB, args.dim, args.layers, args.heads, args.seq)
    return sharded.estimate_memory(
        model, world_size=dist.get_world_size(), stage=0 if stage == "ddp" else int(stage), optimizer=torch.optim.AdamW,
        optimizer_kwargs=dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95)), wrap={Block}, built_whole=True,
        example_input=torch.zeros(micro_batch_size(args), args.seq + 1, dtype=torch.long), loss_fn=next_token_loss)


def report(results: dict, out: Path, args) -> None:
    """Per-rank memory table on stdout, each stage's estimate beside it, and the figure."""
    world = len(next(iter(results.values()))["params"])
    print(f"\n{'stage':<7}{'val loss':>18}" + "".join(f"{'rank ' + str(r) + ' params/grads/state (MiB)':>36}" for r in range(world))
          + f"{'estimate (busiest rank)':>36}{'peak: est / measured':>24}")
    for stage, r in results.items():
        cells = "".join(f"{r['params'][i] / 2**20:>16.2f}{r['grads'][i] / 2**20:>10.2f}{r['state'][i] / 2**20:>10.2f}" for i in range(world))
        e = estimated(stage, args)
        peaks = f"{e.peak_bytes / 2**20:>14.1f} / {max(r['peak']) / 2**20:.1f}"
        print(f"{stage:<7}{r['val'][0]:>8.3f} -> {r['val'][1]:.3f}{cells}"
              f"{e.parameters / 2**20:>16.2f}{e.gradients / 2**20:>10.2f}{e.optimizer_state / 2**20:>10.2f}{peaks}")
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        print("(measured peaks follow live bytes only with MALLOC_MMAP_THRESHOLD_=65536 set, as `make demo` does)")
    from memory_plot import save_figure

    save_figure(out, stage_results=results)
    print(f"\nwrote {out / 'memory.png'}")


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group``, giving each torchrun restart its own namespace in the store.

    torchrun lends the job its rendezvous store, and what a process group publishes there (each
    rank's address) outlives a failed attempt: a restarted rank can read a dead peer's address
    and fail to connect. A key prefix per attempt keeps attempts apart. (Setting
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun avoids it too.)"""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}/", shared), timeout=timeout,
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def check_invariant_arguments(parser: argparse.ArgumentParser, args) -> None:
    """Refuse what ``--invariant`` cannot keep invariant, before any rank starts."""
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if not args.invariant:
        if args.micro_batches is not None:
            parser.error("--micro-batches belongs to --invariant (without it, --accumulate N accumulates per rank)")
        return
    m = args.micro_batches
    if m is None or m < 1 or m & (m - 1):
        parser.error(f"--invariant needs --micro-batches M, a power of two (1, 2, 4, 8...), got {m}")
    if args.batch % m:
        parser.error(f"--invariant: --batch {args.batch} is the global batch and must split into {m} equal micro-batches")
    if args.accumulate != 1:
        parser.error("--invariant accumulates the --micro-batches itself; drop --accumulate")


def cpu_threads(args) -> int:
    """Intra-op threads per rank: ``--threads``; by default 1 with ``--invariant`` (a matrix product's
    bits depend on its threads, so they must not change with the world size), else the cores shared out."""
    if args.threads is not None:
        return args.threads
    return 1 if args.invariant else max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line, checked (argparse's usage error, exit status 2, on a mistake)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", default="ddp,1,2,3", help="comma-separated: ddp, 1, 2, 3")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (no_sync)")
    parser.add_argument("--amp", choices=("off", "bf16", "fp16"), default="off")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint in <out>/checkpoints/stage-S")
    parser.add_argument("--save-every", type=int, default=50,
                        help="steps between checkpoints; one is always saved at the end (0: only then)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds a collective waits for a peer before failing (a dead rank is noticed within it)")
    parser.add_argument("--crash-at", type=int, default=None, help="rank 1 dies (SIGKILL) at this step, once")
    parser.add_argument("--freeze-at", type=int, default=None, help="rank 1 freezes (SIGSTOP) at this step, once")
    parser.add_argument("--out", default="demo_out")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--invariant", action="store_true",
                        help="the same bits at any number of ranks dividing --micro-batches (--batch is then global)")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="with --invariant: micro-batches per step, a power of two dividing --batch")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads per rank on the CPU (default: the cores shared out; 1 with --invariant)")
    parser.add_argument("--lowbit", default=None, metavar="MODE",
                        help="send parameters/gradients in fewer bits: a sharded.LowBit.mode name (int8, int4-grads, fp8...) or off")
    parser.add_argument("--check-every", type=int, default=0, metavar="K",
                        help="with --lowbit: run the exact collective beside the low-bit one every K steps and log the error (0: never)")
    args = parser.parse_args(argv)
    args.lowbit_name, args.lowbit = args.lowbit, None  # the name as given; the policy (None: off)
    if args.check_every < 0 or (args.check_every and args.lowbit_name in (None, "off")):
        parser.error(f"--check-every {args.check_every}: a number of steps >= 1 with a --lowbit mode, or 0 (off)")
    if args.lowbit_name not in (None, "off"):
        try:
            args.lowbit = LowBit.mode(args.lowbit_name, check_every=args.check_every or None)
        except ValueError as error:
            parser.error(f"--lowbit: {error}")
        if args.check_every:  # the checks are logged at INFO
            logging.basicConfig(format="%(message)s")
            logging.getLogger("sharded.lowbit").setLevel(logging.INFO)
    for stage in args.stage.split(","):
        refusal = lowbit_refusal(stage, args.lowbit)
        if refusal is not None:
            parser.error(refusal)
    if args.lowbit is not None and args.invariant:
        parser.error("--lowbit with --invariant: the invariant mode promises the same bits at every world size, which rounding the messages breaks")
    if args.save_every < 0:
        parser.error(f"--save-every must be 0 (save at the end only) or a number of steps, got {args.save_every}")
    check_invariant_arguments(parser, args)
    return args


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    if use_cuda and args.invariant:  # before CUDA starts: cuBLAS is deterministic only with this workspace
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    init_process_group("nccl" if use_cuda else "gloo", datetime.timedelta(seconds=args.timeout))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda")
    else:
        torch.set_num_threads(cpu_threads(args))
        device = torch.device("cpu")
    for module in ("torch._dynamo", "sharded.fsdp.api"):  # DDP's first build imports dynamo: not in a stage's peak
        importlib.import_module(module)

    train, val = stdlib_text()
    if dist.get_rank() == 0:
        print(f"{len(train):,} training / {len(val):,} validation bytes of the standard library; "
              f"{dist.get_world_size()} ranks on {device.type}")
    with checkpoint.detect_peer_failure() as peers:  # a dead or silent peer: an error naming it, not a backend one
        results = {stage: train_stage(stage, args, device, train, val, peers) for stage in args.stage.split(",")}
    if dist.get_rank() == 0:
        report(results, Path(args.out), args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
