"""Sharded vs consolidated checkpoints of the GPT example: seconds to save and load, and the
peak memory rank 0 adds while doing it.

    torchrun --standalone --nproc-per-node 2 benchmarks/checkpoint_bench.py
    torchrun --standalone --nproc-per-node 2 benchmarks/checkpoint_bench.py --stage 3 --dim 256

*Sharded*: ``sharded.checkpoint`` (each rank writes what it holds through
torch.distributed.checkpoint; loading reads each rank's part). *Consolidated*: what fairscale
offered and the example did before: ``OSS.consolidate_state_dict`` gathers the optimizer state
on rank 0, which ``torch.save``-s it with the model; every rank then ``torch.load``-s the whole
file and keeps its part. (Stage 3 consolidates with torch's own
``torch.distributed.checkpoint.state_dict`` full state dicts, on rank 0's CPU, and loads them
back with its ``set_state_dict``.)

Memory is the rise of rank 0's peak resident set over its resident set just before the
operation (Linux: the peak is reset through ``/proc/self/clear_refs``), so it counts every
buffer the operation allocates, torch's and DCP's, whether or not Python sees it. Files go to a
temporary directory; the page cache is not part of a process's resident set. Freed memory is
handed back to the OS before each operation (``malloc_trim``), so that reused heap does not hide
an allocation. Times are the median of ``--repeats`` rounds, memory the largest. Not a test:
timings depend on the machine.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt import GPT, next_token_loss  # noqa: E402  examples/gpt.py: the example's model

from sharded import OSS, ShardedDataParallel, checkpoint, fully_shard  # noqa: E402

VOCAB = 256


def build(args):
    """(model, wrapped, optimizer) as the example's stage ``args.stage`` builds them."""
    torch.manual_seed(0)
    model = GPT(VOCAB, args.dim, args.layers, args.heads, args.seq)
    if args.stage == "3":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = OSS(model.parameters(), torch.optim.AdamW, lr=1e-3)
    return model, ShardedDataParallel(model, optimizer), optimizer


def train_one_step(wrapped, optimizer, args) -> None:
    """One step, so that the optimizer has its state (Adam: two moments per parameter)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    optimizer.zero_grad()
    next_token_loss(wrapped, torch.randint(0, VOCAB, (4, args.seq + 1), generator=g)).backward()
    optimizer.step()


# ------------------------------------------------------------------------ the operations


def save_sharded(wrapped, optimizer, path: Path) -> None:
    checkpoint.save(checkpoint.get_state_dict(wrapped, optimizer), path)


def load_sharded(wrapped, optimizer, path: Path) -> None:
    state = checkpoint.get_state_dict(wrapped, optimizer)
    checkpoint.load(state, path)
    checkpoint.set_state_dict(wrapped, optimizer, state)


def save_consolidated(wrapped, optimizer, path: Path) -> None:
    if isinstance(optimizer, OSS):
        optimizer.consolidate_state_dict(recipient_rank=0)
        full = {"model": wrapped.module.state_dict(), "optim": optimizer.state_dict()} if dist.get_rank() == 0 else {}
    else:  # stage 3: torch's full state dicts, gathered onto rank 0's CPU (what main's example did)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_state_dict(wrapped, optimizer, options=options)
        full = {"model": model_state, "optim": optim_state}
    if dist.get_rank() == 0:
        torch.save(full, path)
    dist.barrier()


def load_consolidated(wrapped, optimizer, path: Path) -> None:
    full = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(optimizer, OSS):
        wrapped.module.load_state_dict(full["model"])
        optimizer.load_state_dict(full["optim"])
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(wrapped, optimizer, model_state_dict=full["model"], optim_state_dict=full["optim"],
                       options=StateDictOptions(full_state_dict=True))


# ----------------------------------------------------------------------------- measuring


def resident_kib() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmHWM:", "VmRSS:")):
                fields[line.split(":")[0]] = int(line.split()[1])
    return fields


def release_free_memory() -> None:
    """Hand memory that was freed back to the OS (glibc keeps freed heap resident), so that the
    next operation's allocations show in the peak instead of reusing what an earlier one left."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass  # not glibc: peaks may then understate what an operation allocates


def measure(operation, *args) -> tuple[float, int]:
    """(seconds on the slowest rank, bytes rank 0's peak resident set rose by) for one call."""
    release_free_memory()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak resident set restarts from the current one
    before = resident_kib()["VmRSS"]
    start = time.perf_counter()
    operation(*args)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    peak = resident_kib()["VmHWM"]
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item(), (peak - before) * 1024


def local_bytes(tensors) -> int:
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in local)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state this rank holds (its shard)."""
    states = (optimizer.optim if isinstance(optimizer, OSS) else optimizer).state.values()
    return local_bytes(v for state in states for v in state.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=("2", "3"), default="2", help="ZeRO-2 (OSS + ShardedDataParallel) or ZeRO-3")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, wrapped, optimizer = build(args)
    train_one_step(wrapped, optimizer, args)
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-")) if rank == 0 else None
    shared = [str(root) if root else None]
    dist.broadcast_object_list(shared)
    root = Path(shared[0])

    results: dict[str, list[tuple[float, int]]] = {name: [] for name in ("save sharded", "load sharded", "save consolidated", "load consolidated")}
    for r in range(args.repeats):
        sharded_dir, consolidated_file = root / f"sharded-{r}", root / f"consolidated-{r}.pt"
        results["save sharded"].append(measure(save_sharded, wrapped, optimizer, sharded_dir))
        results["save consolidated"].append(measure(save_consolidated, wrapped, optimizer, consolidated_file))
        results["load sharded"].append(measure(load_sharded, wrapped, optimizer, sharded_dir))
        results["load consolidated"].append(measure(load_consolidated, wrapped, optimizer, consolidated_file))

    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    own = torch.tensor([optimizer_state_bytes(optimizer)])
    total = own.clone()
    dist.all_reduce(total)
    if rank == 0:
        mib = 2**20
        print(f"GPT dim={args.dim} layers={args.layers}: {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"stage {args.stage}, world {world}, gloo on {os.cpu_count()} CPUs")
        print(f"model {model_bytes / mib:.1f} MiB; optimizer state {total.item() / mib:.1f} MiB in all, "
              f"rank 0's shard {own.item() / mib:.1f} MiB")
        print(f"{'':20}{'seconds':>10}{'rank-0 peak extra MiB':>24}")
        for name, runs in results.items():
            seconds = statistics.median(s for s, _ in runs)
            peak = max(b for _, b in runs)
            print(f"{name:20}{seconds:>10.3f}{peak / mib:>24.1f}")
        if args.dir is None:
            shutil.rmtree(root)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
