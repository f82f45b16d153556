"""Side-by-side benchmark: DDP, torch ZeRO, fairscale and sharded, in one launch.

    python benchmarks/bench.py                       # what `make bench` runs
    python benchmarks/bench.py --sizes 10m --steps 6 # quicker

World size 2 on gloo by default (NCCL when CUDA is present). For each GPT-style model size, every
implementation keeps its own copy of the model and optimizer, and they take turns, a few steps
each, round after round, so that drift in this shared machine's speed hits them all alike.

Per implementation it reports: median step time and its ratio to DDP (each step's time is the
slowest rank's); its ratio to the **ideal** sharded step, measured in the same turns: forward +
backward of the same batch with no communication at all, plus the optimizer step on this rank's
1/N of the parameters; the **exposed communication** (step minus ideal) in ms and as a share of
the step; the run's **noise** on that ratio (half the spread of the per-round ratios: differences
smaller than it are ties); for ZeRO-2, the share of backward during which reduces were already
under way (``overlap``, from ``ShardedDataParallel.backward_stats``); optimizer-state and
gradient bytes held on each rank (gradients measured after backward, i.e. after reduction); peak
RSS per rank (a separate short launch per implementation, so peaks don't mix); bytes and calls
communicated per step, counted at the Python collective level as algorithmic bytes per rank
(ring model: all-reduce moves 2(W-1)/W of its tensor, reduce, broadcast, all-gather and
reduce-scatter (W-1)/W); DDP's gradient all-reduce runs in its C++ reducer, out of Python's
sight, so it is added from the gradient sizes. Finally the last loss and the largest parameter
difference to DDP after the same batches: a fast but wrong result shows.

Two ZeRO-2 variants show what survives outside the plain case: ``zero2_compile`` runs the model
through ``torch.compile`` (inductor) and ``zero2_unused`` adds one parameter that never gets a
gradient, placed where the first-guess reduce order expects the first gradient.

    python benchmarks/bench.py --profile zero2 --sizes 40m-short   # where a step's time goes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt import GPT, next_token_loss  # noqa: E402  (examples/gpt.py: the model every job shares)

IMPLS = {
    "ideal": "ideal: no communication, 1/N step",
    "ddp": "torch DDP + Adam",
    "torch_zero": "torch ZeroRedundancyOptimizer + DDP",
    "fairscale": "fairscale OSS + ShardedDDP",
    "zero1": "sharded OSS + DDP",
    "zero2": "sharded OSS + ShardedDDP",
    "zero2_fp16": "sharded OSS + SDP, fp16 on the wire",
    "zero2_compile": "sharded OSS + SDP, torch.compile",
    "zero2_unused": "sharded OSS + SDP, 1 unused parameter",
}
SHORT_NAMES = {"ddp": "DDP", "torch_zero": "torch ZeRO\n+ DDP", "fairscale": "fairscale\nOSS + SDP",
               "zero1": "sharded\nOSS + DDP", "zero2": "sharded\nOSS + SDP",
               "zero2_fp16": "sharded SDP\nfp16 wire", "ideal": "ideal",
               "zero2_compile": "sharded SDP\ncompile", "zero2_unused": "sharded SDP\nunused param"}
# "-short" sizes run 32 tokens per rank: the step is then optimizer and communication work, as it is
# when an accelerator makes the matrix work cheap, and that is where the implementations differ.
SIZES = {"10m": dict(dim=384, layers=6, batch=8, seq=128), "40m": dict(dim=640, layers=8, batch=4, seq=128),
         "40m-short": dict(dim=640, layers=8, batch=1, seq=32)}
COLLECTIVES = {"all_reduce": 2, "reduce": 1, "broadcast": 1, "all_gather": 1, "all_gather_into_tensor": 1,
               "reduce_scatter_tensor": 1, "send": None, "recv": None}
VOCAB = 256
LR = 1e-3


def make_model(size: str, device) -> GPT:
    torch.manual_seed(0)
    cfg = SIZES[size]
    return GPT(VOCAB, cfg["dim"], cfg["layers"], max(1, cfg["dim"] // 64), cfg["seq"]).to(device)


def tokens_for(size: str, step: int, rank: int, device) -> torch.Tensor:
    cfg = SIZES[size]
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randint(0, VOCAB, (cfg["batch"], cfg["seq"] + 1), generator=g).to(device)


def build(impl: str, model: nn.Module):
    """(wrapped model, optimizer, set_to_none, local optimizer whose state this rank holds)."""
    if impl == "ideal":  # the same work minus all communication: no wrapper, Adam on 1/N
        from sharded._partition import Partition

        mine = Partition.build([list(model.parameters())], dist.get_world_size()).owned_by_group(dist.get_rank())[0]
        opt = torch.optim.Adam(mine, lr=LR)
        return model, opt, True, opt
    if impl == "zero2_unused":  # defined last: the first gradient the initial reduce order expects
        model.unused = nn.Linear(model.head.in_features, model.head.in_features).to(model.head.weight.device)
    params = model.parameters()
    if impl == "ddp":
        opt = torch.optim.Adam(params, lr=LR)
        return DDP(model), opt, True, opt
    if impl == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=LR)
        return DDP(model), opt, True, opt.optim
    if impl == "fairscale":
        from fairscale.nn.data_parallel import ShardedDataParallel as FairscaleSDP
        from fairscale.optim import OSS as FairscaleOSS

        opt = FairscaleOSS(params, torch.optim.Adam, lr=LR)
        # fairscale 0.4.13 computes wrong gradients with set_to_none=True and buckets on
        return FairscaleSDP(model, opt), opt, False, opt.optim
    from sharded import OSS, ShardedDataParallel

    fp16_wire = impl == "zero2_fp16"
    opt = OSS(params, torch.optim.Adam, lr=LR, broadcast_fp16=fp16_wire)
    if impl == "zero1":
        return DDP(model), opt, True, opt.optim
    if impl == "zero2_compile":
        model = torch.compile(model)
    return ShardedDataParallel(model, opt, reduce_fp16=fp16_wire), opt, True, opt.optim


def train_step(size, setup, step, rank, device):
    wrapped, opt, set_to_none, _ = setup
    tokens = tokens_for(size, step, rank, device)
    opt.zero_grad(set_to_none=set_to_none)
    loss = next_token_loss(wrapped, tokens)
    loss.backward()
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in wrapped.parameters() if p.grad is not None)
    opt.step()
    return loss.item(), grad_bytes


class CollectiveCounter:
    """Counts calls and algorithmic bytes per rank of torch.distributed collectives."""

    def __init__(self) -> None:
        self.calls, self.bytes = 0, 0.0
        self._saved = {}

    def __enter__(self):
        world = dist.get_world_size()
        for name, factor in COLLECTIVES.items():
            fn = self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._counting(fn, factor, world))
        return self

    def _counting(self, fn, factor, world):
        def counted(tensor, *args, **kwargs):
            t = tensor if torch.is_tensor(tensor) else args[0]
            nbytes = t.numel() * t.element_size()
            self.calls += 1
            self.bytes += nbytes * (factor * (world - 1) / world if factor else 1)
            return fn(tensor, *args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def state_bytes(local_optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in local_optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def gather(value: float, device) -> list[float]:
    mine = torch.tensor([float(value)], dtype=torch.float64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.item() for t in out]


def timing_rank(rank, world, args, store_path, results_path):
    device = init_rank(rank, world, store_path)
    report = {}
    for size in args.sizes:
        models = {impl: make_model(size, device) for impl in args.impls}
        setups = {impl: build(impl, models[impl]) for impl in args.impls}
        rounds_of = {impl: [] for impl in args.impls}  # timed step times, one list per round
        overlaps = {impl: [] for impl in args.impls}
        losses, grads = {}, {}
        step_of = {impl: 0 for impl in args.impls}
        rounds = args.warmup + args.steps
        for round_index in range(0, rounds, args.turn):
            for impl in args.impls:
                this_round = []
                for _ in range(min(args.turn, rounds - round_index)):
                    dist.barrier()
                    start = time.perf_counter()
                    losses[impl], grads[impl] = train_step(size, setups[impl], step_of[impl], rank, device)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    elapsed = max(gather(time.perf_counter() - start, device))
                    if step_of[impl] >= args.warmup:
                        this_round.append(elapsed)
                        stats = getattr(setups[impl][0], "backward_stats", None)
                        if stats is not None:
                            overlaps[impl].append(stats.overlap)
                    step_of[impl] += 1
                if this_round:
                    rounds_of[impl].append(this_round)
        reference = dict(models["ddp"].named_parameters()) if "ddp" in models else {}
        for impl in args.impls:
            with CollectiveCounter() as counter:
                train_step(size, setups[impl], step_of[impl], rank, device)
            named = dict(models[impl].named_parameters())
            common = [name for name in named if name in reference]
            exact = impl != "ideal" and common
            diff = max((named[n] - reference[n]).abs().max().item() for n in common) if exact else float("nan")
            ddp_bytes = 0.0
            if impl in ("ddp", "torch_zero", "zero1"):  # DDP's C++ all-reduce of every gradient
                ddp_bytes = sum(p.numel() * p.element_size() for p in named.values()) * 2 * (world - 1) / world
            overlap = statistics.mean(gather(statistics.median(overlaps[impl]), device)) if overlaps[impl] else None
            report.setdefault(size, {})[impl] = {
                "median_step_s": statistics.median(t for r in rounds_of[impl] for t in r),
                "round_steps_s": rounds_of[impl],
                "overlap": overlap,
                "state_bytes": gather(state_bytes(setups[impl][3]), device),
                "grad_bytes": gather(grads[impl], device),
                "comm_calls_python": counter.calls,
                "comm_bytes": counter.bytes + ddp_bytes,
                "final_loss": losses[impl],
                "max_param_diff_vs_ddp": diff,
                "params": sum(p.numel() for p in named.values()),
            }
        del setups, models
    if rank == 0:
        Path(results_path).write_text(json.dumps(report))
    finish_rank()


def ratios_to_ideal(rows: dict) -> None:
    """Add each implementation's ratio to the ideal step, its exposed communication and the
    noise of that ratio (half the spread of the per-round ratios), in place."""
    if "ideal" not in rows:
        return
    ideal_rounds = [statistics.median(r) for r in rows["ideal"]["round_steps_s"]]
    ideal = rows["ideal"]["median_step_s"]
    for r in rows.values():
        per_round = [statistics.median(mine) / base for mine, base in zip(r["round_steps_s"], ideal_rounds)]
        r["vs_ideal"] = r["median_step_s"] / ideal
        r["ratio_noise"] = (max(per_round) - min(per_round)) / 2 if per_round else 0.0
        r["exposed_ms"] = 1e3 * (r["median_step_s"] - ideal)
        r["exposed_share"] = (r["median_step_s"] - ideal) / r["median_step_s"]


def memory_rank(rank, world, size, impl, store_path, results_path):
    device = init_rank(rank, world, store_path)
    setup = build(impl, make_model(size, device))
    for step in range(3):
        train_step(size, setup, step, rank, device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peaks = gather(peak, device)
    if rank == 0:
        Path(results_path).write_text(json.dumps(peaks))
    finish_rank()


def profile_rank(rank, world, size, impl, store_path, results_path):
    """Where one rank's step goes: the sharded:: regions and the largest ops, per step, and the
    wait of each reduce in the order the flush waited on them."""
    device = init_rank(rank, world, store_path)
    setup = build(impl, make_model(size, device))
    steps = 4
    for step in range(3):
        train_step(size, setup, step, rank, device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for step in range(3, 3 + steps):
            with torch.profiler.record_function("bench::step"):
                train_step(size, setup, step, rank, device)
    lines = []
    for event in sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total):
        if event.key.startswith(("sharded::", "bench::")) or (event.key.startswith("aten::") and len(lines) < 24):
            lines.append(f"{event.key:<36}{event.count / steps:>8.1f} calls{event.cpu_time_total / steps / 1e3:>10.1f} ms")
    waits = [e.cpu_time_total / 1e3 for e in prof.events() if e.name == "sharded::wait_reduce"]
    per_step = len(waits) // steps
    if per_step:
        lines.append("reduce waits in the flush, last step (ms): " + " ".join(f"{w:.1f}" for w in waits[-per_step:]))
    texts = [None] * world
    dist.all_gather_object(texts, "\n".join(lines))
    if rank == 0:
        Path(results_path).write_text(json.dumps(texts))
    finish_rank()


def init_rank(rank, world, store_path) -> torch.device:
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    return torch.device("cuda", rank) if use_cuda else torch.device("cpu")


def finish_rank() -> None:
    dist.barrier()
    dist.destroy_process_group()


def launch(target, world, *args):
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.json")
        mp.spawn(target, args=(world, *args, os.path.join(tmp, "store"), results), nprocs=world)
        return json.loads(Path(results).read_text())


def print_table(report, world) -> None:
    for size, rows in report.items():
        ratios_to_ideal(rows)
        ddp_time = rows.get("ddp", {}).get("median_step_s")
        print(f"\n{size} ({rows[next(iter(rows))]['params'] / 1e6:.1f}M params), world {world}")
        print(f"{'implementation':<40}{'step s':>8}{'vs DDP':>8}{'vs ideal':>10}{'± noise':>9}{'exposed ms':>12}"
              f"{'exposed %':>10}{'overlap':>9}{'state MiB/rank':>18}{'grads MiB/rank':>18}{'peak RSS MiB':>16}"
              f"{'MiB sent':>10}{'calls':>7}{'loss':>8}{'max |Δ|':>10}")
        for impl, r in rows.items():
            mib = lambda xs: "/".join(f"{x / 2**20:.1f}" for x in xs)
            ratio = f"{r['median_step_s'] / ddp_time:.2f}" if ddp_time else "-"
            overlap = f"{r['overlap']:.2f}" if r.get("overlap") is not None else "-"
            ideal = (f"{r['vs_ideal']:>10.2f}{r['ratio_noise']:>9.2f}{r['exposed_ms']:>12.0f}{100 * r['exposed_share']:>9.0f}%"
                     if "vs_ideal" in r else f"{'-':>10}{'-':>9}{'-':>12}{'-':>10}")
            print(f"{IMPLS[impl]:<40}{r['median_step_s']:>8.3f}{ratio:>8}{ideal}{overlap:>9}{mib(r['state_bytes']):>18}"
                  f"{mib(r['grad_bytes']):>18}{mib(r.get('peak_rss', [])):>16}{r['comm_bytes'] / 2**20:>10.1f}"
                  f"{r['comm_calls_python']:>7}{r['final_loss']:>8.4f}{r['max_param_diff_vs_ddp']:>10.2e}")


def plot(report, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    width = 0.8 / len(report)
    for offset, (size, rows) in enumerate(report.items()):
        ddp_time = rows["ddp"]["median_step_s"] if "ddp" in rows else 1.0
        names = list(rows)
        xs = [i + width * offset for i in range(len(names))]
        axes[0].bar(xs, [rows[n]["median_step_s"] / ddp_time for n in names], width=width, label=size)
        axes[1].bar(xs, [max(rows[n]["state_bytes"]) / 2**20 for n in names], width=width, label=size)
    for ax, title in zip(axes, ("step time / DDP", "optimizer state on the largest rank (MiB)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], [SHORT_NAMES[n] for n in names], fontsize=7)
        ax.set_title(title)
        ax.legend()
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sizes", type=lambda s: s.split(","), default=list(SIZES))
    parser.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS))
    parser.add_argument("--steps", type=int, default=8, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--turn", type=int, default=2, help="steps each implementation takes per turn")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-implementation RSS launches")
    parser.add_argument("--profile", metavar="IMPL", help="profile IMPL on the first of --sizes instead")
    args = parser.parse_args()
    if args.profile:
        for rank, text in enumerate(launch(profile_rank, args.world, args.sizes[0], args.profile)):
            print(f"\n--- rank {rank}: {IMPLS[args.profile]}, {args.sizes[0]}, per step ---\n{text}")
        return

    started = time.time()
    report = launch(timing_rank, args.world, args)
    if not args.no_memory:
        for size, rows in report.items():
            for impl in rows:
                if impl != "ideal":
                    rows[impl]["peak_rss"] = launch(memory_rank, args.world, size, impl)
    print_table(report, args.world)
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    meta = {"world": args.world, "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "backend": "nccl" if torch.cuda.is_available() else "gloo", "command": " ".join(sys.argv),
            "seconds": round(time.time() - started)}
    (out / "bench.json").write_text(json.dumps({"meta": meta, "results": report}, indent=1))
    plot(report, out / "bench.png")
    print(f"\n{meta}\nwrote {out / 'bench.json'} and {out / 'bench.png'}")


if __name__ == "__main__":
    main()
