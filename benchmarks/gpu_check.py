"""What only a GPU can show, measured in one run and written as one report (``make gpu-check``).

    python benchmarks/gpu_check.py                       # CUDA when available, else the CPU
    python benchmarks/gpu_check.py --quick --device cpu  # tiny sizes: what `make test` runs

One process, world 1 (NCCL on CUDA, gloo on the CPU), the example's GPT and AdamW. Checks:

* ``stages``: DDP, ZeRO-1 (DDP + ``OSS``), ZeRO-2 (``ShardedDataParallel`` + ``OSS``), ZeRO-3
  (``fully_shard``) and torch FSDP2 on the same batches: median step time and peak memory;
  passes when each ends within AdamW's bound (tests/_fsdp_reference.py) of DDP's parameters.
* ``unit_overhead``: forward + backward of a stack of tiny units, less the plain stack's, per
  unit: the Python cost a GPU exposes and a CPU's slow kernels hide, ours and FSDP2's.
* ``grad_scaler``: fp16 autocast with an inf injected into the head's gradient at step
  ``INF_STEP``: ``ShardedGradScaler`` with ZeRO-1/2 against ``torch.amp.GradScaler`` with DDP, and
  with ZeRO-3 against torch's with FSDP2: scales, skipped steps and parameters bit for bit.
* ``memory_estimate``: ``estimate_memory(..., runtime_bytes=0)`` of every stage against the
  ``stages`` check's measured peaks. Compared on CUDA (within ``ESTIMATE_TOLERANCE``), where the
  peak is ``max_memory_allocated``; on the CPU reported only (tests/test_memory_estimate.py
  compares it there against VmHWM, with the runtime bytes).
* ``offload``: ZeRO-3 with ``CPUOffloadPolicy(pin_memory=True)`` against without: step times, the
  shards and gradients on the CPU (pinned on CUDA), SGD's parameters within ``OFFLOAD_ATOL``; on CUDA a profile of one
  step, how much of the host-device copies' time ran beside computation.
* ``compile``: one block ``.compile()``-d in a ZeRO-3 model (inductor on CUDA; on the CPU
  ``aot_eager``: inductor's C++ build of this block took 69 s on a 2-core CI machine) trains as
  the eager model does (SGD: within ``COMPILE_ATOL``).
* ``lowbit_kernels``: the low-bit codecs' encode and decode GB/s per format on the device
  (benchmarks/lowbit_kernels.py, the same torch functions as on the CPU); passes when every
  decoded element is within the codec's stated bound.
* ``device_tests`` (with ``--device-tests``): the device-agnostic tests' junit XML, folded in.

Each check catches its own exception and records it as a failure; the exit status is 1 when any
check failed. The report: ``<out>/report.md`` and ``<out>/report.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
import sharded  # noqa: E402
from gpt import GPT, Block, next_token_loss  # noqa: E402  (examples/gpt.py)
from peak_memory import DataPeak  # noqa: E402

ADAMW = dict(lr=1e-2, weight_decay=0.1)
SGD = dict(lr=0.05, momentum=0.9)
IMPLS = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": None}  # name: ZeRO stage
INF_STEP = 2
ESTIMATE_TOLERANCE = 0.10
COMPILE_ATOL = 1e-4  # SGD after a few steps: fused kernels reorder float32 sums (ulps), a wrong graph moves ~1e-2
# The offloaded SGD step runs on the CPU, the plain one on the GPU: float32 rounding apart (CUDA
# fuses multiply-adds), ulps per step; a stale or lost gradient moves an element by ~lr * |g|, 1e-3
# and more. (AdamW, compared on the first GPU run, magnifies such ulps on near-zero gradients into
# the worst element: 0.024 after 13 steps, with a mean of 5e-6: too loose to tell a race from rounding.)
OFFLOAD_ATOL = 1e-4


@dataclass(frozen=True)
class Size:
    vocab: int
    dim: int
    layers: int
    heads: int
    seq: int
    batch: int
    warmup: int
    steps: int
    units: int  # tiny units in the overhead stack
    reps: int


SIZES = {
    "cuda": Size(8192, 512, 8, 8, 256, 8, warmup=3, steps=10, units=32, reps=30),
    "cpu": Size(256, 64, 2, 2, 32, 4, warmup=1, steps=3, units=16, reps=5),
    "quick": Size(64, 32, 2, 2, 16, 2, warmup=1, steps=3, units=8, reps=3),
}


@dataclass
class Context:
    device: torch.device
    size: Size
    out: Path
    compile_backend: str
    measured_peaks: dict[str, int] = field(default_factory=dict)  # filled by the stages check


@dataclass
class Outcome:
    passed: bool
    figures: dict[str, Any]
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_gpt(ctx: Context, seed: int = 0) -> GPT:
    s = ctx.size
    torch.manual_seed(seed)
    return GPT(s.vocab, s.dim, s.layers, s.heads, s.seq).to(ctx.device)


def batch(ctx: Context, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 + step)
    return torch.randint(0, ctx.size.vocab, (ctx.size.batch, ctx.size.seq + 1), generator=generator).to(ctx.device)


def wrap(impl: str, model: GPT, optim: type = torch.optim.AdamW, kwargs: Optional[dict] = None, **shard_kwargs: Any):
    """``(what to call, optimizer)`` for ``impl`` over ``model``."""
    kwargs = ADAMW if kwargs is None else kwargs
    if impl == "ddp":
        return DDP(model), optim(model.parameters(), **kwargs)
    if impl == "zero1":
        return DDP(model), sharded.OSS(model.parameters(), optim, **kwargs)
    if impl == "zero2":
        oss = sharded.OSS(model.parameters(), optim, **kwargs)
        return sharded.ShardedDataParallel(model, oss), oss
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    shard = sharded.fully_shard if impl == "zero3" else torch_fully_shard
    for block in model.blocks:
        shard(block, **shard_kwargs)
    shard(model, **shard_kwargs)
    return model, optim(model.parameters(), **kwargs)


def train(ctx: Context, wrapped: nn.Module, optimizer, steps: int, first: int = 0) -> tuple[list[float], list[float]]:
    """``steps`` steps; returns each step's seconds (device synchronised) and loss."""
    seconds, losses = [], []
    for step in range(first, first + steps):
        sync(ctx.device)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = next_token_loss(wrapped, batch(ctx, step))
        loss.backward()
        optimizer.step()
        sync(ctx.device)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    return seconds, losses


def full_params(model: nn.Module) -> list[torch.Tensor]:
    """Copies (never views) of the full parameters, in float32 on the CPU."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to("cpu", torch.float32, copy=True) for p in model.parameters()]


def adamw_gap(mine: list[torch.Tensor], theirs: list[torch.Tensor], steps: int) -> tuple[float, float, bool]:
    """Max and mean difference, and whether within AdamW's bound (tests/_fsdp_reference.py)."""
    diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(mine, theirs)])
    worst, mean = diffs.max().item(), diffs.mean().item()
    return worst, mean, len(mine) == len(theirs) and worst <= 0.1 * ADAMW["lr"] * steps and mean <= 1e-6


def median_ms(seconds: list[float]) -> float:
    return round(1e3 * statistics.median(seconds), 3)


def release() -> None:
    for _ in range(2):  # a model that ran a forward needs two rounds (its hooks' cycles)
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class PeakMemory:
    """The most a run held since this object was made (bytes)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        release()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
            self.device = device
        else:
            self.data = DataPeak()

    @staticmethod
    def measure(device: torch.device) -> str:
        if device.type == "cuda":
            return "torch.cuda.max_memory_allocated's rise over what was allocated before the model was built (tensors only)"
        mmap = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        return ("host data: VmHWM's rise less RssFile's (examples/peak_memory.py), indicative; it follows live tensors only "
                f"with MALLOC_MMAP_THRESHOLD_=65536 (here: {mmap or 'not set'})")

    def rise(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return self.data.rise()


# ------------------------------------------------------------------------------ checks


def warm_up(ctx: Context) -> None:
    """One training step of a tiny GPT: the allocations a process makes once (cuBLAS's
    workspace, first-use buffers) then stay out of the first stage's peak."""
    tiny = GPT(64, 32, 1, 2, 16).to(ctx.device)
    next_token_loss(tiny, torch.randint(0, 64, (2, 17), device=ctx.device)).backward()
    del tiny
    release()


def check_stages(ctx: Context) -> Outcome:
    s = ctx.size
    figures: dict[str, dict[str, Any]] = {}
    params: dict[str, list[torch.Tensor]] = {}
    warm_up(ctx)
    for impl in IMPLS:
        peak = PeakMemory(ctx.device)
        wrapped, optimizer = wrap(impl, build_gpt(ctx))
        seconds, losses = train(ctx, wrapped, optimizer, s.warmup + s.steps)
        figures[impl] = {"step_ms": median_ms(seconds[s.warmup:]), "peak_bytes": peak.rise(), "last_loss": round(losses[-1], 6)}
        params[impl] = full_params(wrapped)
        del wrapped, optimizer
    passed = True
    for impl in IMPLS:
        worst, mean, within = adamw_gap(params[impl], params["ddp"], s.warmup + s.steps)
        figures[impl].update(max_diff_to_ddp=worst, mean_diff_to_ddp=mean, step_vs_ddp=round(figures[impl]["step_ms"] / figures["ddp"]["step_ms"], 3))
        passed &= within
    ctx.measured_peaks = {impl: figures[impl]["peak_bytes"] for impl in IMPLS}
    return Outcome(passed, figures, [f"peak: {PeakMemory.measure(ctx.device)}"])


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def check_unit_overhead(ctx: Context) -> Outcome:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    n, x = ctx.size.units, torch.randn(4, 16, device=ctx.device)
    seconds, outputs = {}, {}
    for name, shard in (("plain", None), ("sharded", sharded.fully_shard), ("fsdp2", torch_fully_shard)):
        torch.manual_seed(0)
        stack = nn.Sequential(*[Tiny() for _ in range(n)]).to(ctx.device)
        if shard is not None:
            for unit in stack:
                shard(unit)
            shard(stack)
        times = []
        for _ in range(ctx.size.reps + 1):
            sync(ctx.device)
            start = time.perf_counter()
            out = stack(x)
            out.sum().backward()
            sync(ctx.device)
            times.append(time.perf_counter() - start)
        seconds[name], outputs[name] = statistics.median(times[1:]), out.detach().cpu()
    per_unit = {name: round(1e6 * (seconds[name] - seconds["plain"]) / n, 2) for name in ("sharded", "fsdp2")}
    figures = {"units": n, "plain_fwd_bwd_ms": round(1e3 * seconds["plain"], 3), "per_unit_us": per_unit,
               "ours_over_fsdp2": round(per_unit["sharded"] / per_unit["fsdp2"], 3) if per_unit["fsdp2"] > 0 else None}
    same = all(torch.allclose(outputs[name], outputs["plain"], atol=1e-6) for name in ("sharded", "fsdp2"))
    return Outcome(same, figures, ["passes when both sharded stacks compute the plain stack's output; the times are figures"])


def _scaled_run(ctx: Context, impl: str, ours: bool) -> tuple[list[float], list[bool], list[torch.Tensor]]:
    """fp16 autocast, an inf in the head's gradient at INF_STEP; the scale after each step,
    which steps left the parameters as they were, and the final parameters."""
    model = build_gpt(ctx)
    wrapped, optimizer = wrap(impl, model)
    kind = ctx.device.type
    scaler = sharded.ShardedGradScaler(init_scale=2.0**10, device=kind) if ours else torch.amp.GradScaler(kind, init_scale=2.0**10)
    poisoned: list[Any] = []

    def poison(module: nn.Module, args: Any) -> None:  # the weight the forward uses (gathered under ZeRO-3 / FSDP2)
        weight = cast(torch.Tensor, module.weight)
        poisoned.append(weight.register_hook(lambda grad: torch.full_like(grad, float("inf"))))

    scales, skipped = [], []
    for step in range(ctx.size.warmup + ctx.size.steps):
        optimizer.zero_grad()
        handle = model.head.register_forward_pre_hook(poison) if step == INF_STEP else None
        with torch.autocast(kind, dtype=torch.float16):
            loss = next_token_loss(wrapped, batch(ctx, step))
        scaler.scale(loss).backward()
        for hook in [handle, *poisoned] if handle is not None else []:
            hook.remove()
        poisoned.clear()
        before = full_params(wrapped)
        scaler.step(optimizer)
        scaler.update()
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, full_params(wrapped))))
        scales.append(scaler.get_scale())
    return scales, skipped, full_params(wrapped)


def check_grad_scaler(ctx: Context) -> Outcome:
    figures, passed = {}, True
    for impl, reference in (("zero1", "ddp"), ("zero2", "ddp"), ("zero3", "fsdp2")):
        ours, theirs = _scaled_run(ctx, impl, ours=True), _scaled_run(ctx, reference, ours=False)
        same_params = all(torch.equal(a, b) for a, b in zip(ours[2], theirs[2]))
        expected_skips = [step == INF_STEP for step in range(len(ours[1]))]
        ok = ours[0] == theirs[0] and ours[1] == theirs[1] == expected_skips and same_params
        figures[f"{impl} vs {reference}"] = {"scales": ours[0], "torch_scales": theirs[0], "skipped": [i for i, s in enumerate(ours[1]) if s],
                                             "torch_skipped": [i for i, s in enumerate(theirs[1]) if s], "params_bit_equal": same_params, "passed": ok}
        passed &= ok
    return Outcome(passed, figures, [f"inf injected into head.weight's gradient at step {INF_STEP}"])


def check_memory_estimate(ctx: Context) -> Outcome:
    if not ctx.measured_peaks:
        raise RuntimeError("no measured peaks: the stages check did not finish")
    with torch.device("meta"):
        s = ctx.size
        meta = GPT(s.vocab, s.dim, s.layers, s.heads, s.seq)
    figures, passed = {}, True
    for impl, stage in IMPLS.items():
        if stage is None:
            continue
        estimate = sharded.estimate_memory(
            meta, world_size=1, stage=stage, optimizer=torch.optim.AdamW, optimizer_kwargs=ADAMW, wrap={Block},
            example_input=batch(ctx, 0), loss_fn=next_token_loss, device=ctx.device, built_whole=True, runtime_bytes=0,
        )
        measured = ctx.measured_peaks[impl]
        ratio = round(measured / estimate.peak_bytes, 4)
        figures[estimate.name] = {"estimate_bytes": estimate.peak_bytes, "measured_bytes": measured, "measured_over_estimate": ratio,
                                  "phases": estimate.phases}
        if ctx.device.type == "cuda":
            passed &= abs(ratio - 1) <= ESTIMATE_TOLERANCE
    note = (f"passes when every stage is within {ESTIMATE_TOLERANCE:.0%}" if ctx.device.type == "cuda" else
            "CPU: reported, not compared (runtime_bytes=0 leaves out the process's own allocations, which the CPU "
            "measurement includes; tests/test_memory_estimate.py compares with them)")
    return Outcome(passed, figures, [note, f"measured: {PeakMemory.measure(ctx.device)}"])


def copy_overlap(intervals: list[tuple[str, float, float]]) -> dict[str, Any]:
    """From a profile's device events ``(name, start, end)``: the host-to-device and
    device-to-host copies (count and time) and the share of their time during which a
    computation ran."""
    copies = [(n, a, b) for n, a, b in intervals if n.startswith("Memcpy HtoD") or n.startswith("Memcpy DtoH")]
    compute = sorted((a, b) for n, a, b in intervals if not n.startswith(("Memcpy", "Memset")))
    merged: list[list[float]] = []
    for a, b in compute:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = sum(b - a for _, a, b in copies)
    beside = sum(max(0.0, min(b, y) - max(a, x)) for _, a, b in copies for x, y in merged)
    return {
        "htod": sum(n.startswith("Memcpy HtoD") for n, _, _ in copies),
        "dtoh": sum(n.startswith("Memcpy DtoH") for n, _, _ in copies),
        "copy_us": round(total, 1),
        "overlapped_us": round(beside, 1),
        "overlapped_share": round(beside / total, 3) if total else None,
    }


def check_offload(ctx: Context) -> Outcome:
    from sharded.fsdp import CPUOffloadPolicy

    s, runs = ctx.size, {}
    for name, kwargs in (("plain", {}), ("offloaded", {"offload_policy": CPUOffloadPolicy(pin_memory=True)})):
        wrapped, optimizer = wrap("zero3", build_gpt(ctx), torch.optim.SGD, SGD, **kwargs)
        seconds, _ = train(ctx, wrapped, optimizer, s.warmup + s.steps)
        runs[name] = (wrapped, optimizer, seconds)
    offloaded, optimizer, _ = runs["offloaded"]
    shards = [p.to_local() for p in offloaded.parameters()]
    on_cpu = all(t.device.type == "cpu" for t in shards) and all(p.grad.to_local().device.type == "cpu" for p in offloaded.parameters())
    pinned = all(t.is_pinned() for t in shards) if ctx.device.type == "cuda" else None
    diffs = [(a - b).abs() for a, b in zip(full_params(offloaded), full_params(runs["plain"][0]))]
    worst, mean = max(d.max().item() for d in diffs), torch.cat([d.flatten() for d in diffs]).mean().item()
    within = worst <= OFFLOAD_ATOL
    figures: dict[str, Any] = {"plain_step_ms": median_ms(runs["plain"][2][s.warmup:]), "offloaded_step_ms": median_ms(runs["offloaded"][2][s.warmup:]),
                               "shards_and_grads_on_cpu": on_cpu, "pinned": pinned, "max_diff_to_plain": worst, "mean_diff_to_plain": mean}
    passed = on_cpu and within and pinned is not False
    if ctx.device.type != "cuda":
        figures["profile"] = "no copies to overlap: on the CPU the shards and the computation share host memory"
        return Outcome(passed, figures)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        train(ctx, offloaded, optimizer, 1, first=s.warmup + s.steps)
    prof.export_chrome_trace(str(ctx.out / "offload_trace.json"))
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    figures["profile"] = copy_overlap(events)
    passed &= figures["profile"]["htod"] > 0 and figures["profile"]["dtoh"] > 0
    return Outcome(passed, figures, [f"SGD, within {OFFLOAD_ATOL} of the plain run; profile: one step, chrome trace in "
                                     "offload_trace.json; passes when it shows copies both ways"])


def check_compile(ctx: Context) -> Outcome:
    s, runs = ctx.size, {}
    for name in ("eager", "compiled"):
        model = build_gpt(ctx)
        if name == "compiled":
            model.blocks[0].compile(backend=ctx.compile_backend)
        wrapped, optimizer = wrap("zero3", model, torch.optim.SGD, SGD)
        seconds, losses = train(ctx, wrapped, optimizer, s.warmup + s.steps)
        runs[name] = (seconds, losses, full_params(wrapped))
    gap = max((a - b).abs().max().item() for a, b in zip(runs["compiled"][2], runs["eager"][2]))
    loss_gap = max(abs(a - b) for a, b in zip(runs["compiled"][1], runs["eager"][1]))
    figures = {"backend": ctx.compile_backend, "first_step_s": round(runs["compiled"][0][0], 3),
               "compiled_step_ms": median_ms(runs["compiled"][0][s.warmup:]), "eager_step_ms": median_ms(runs["eager"][0][s.warmup:]),
               "max_param_diff": gap, "max_loss_diff": loss_gap}
    notes = [f"blocks.0 compiled, ZeRO-3, SGD; passes within {COMPILE_ATOL} of eager"]
    if ctx.compile_backend != "inductor":
        notes.append(f"backend {ctx.compile_backend}, not inductor: inductor's C++ build of this block took 69 s on a 2-core CI machine")
    return Outcome(gap <= COMPILE_ATOL and loss_gap <= COMPILE_ATOL, figures, notes)


def check_lowbit_kernels(ctx: Context) -> Outcome:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from lowbit_kernels import kernel_rows

    sizes = {"cuda": [2**20, 2**24], "cpu": [2**16]}[ctx.device.type]
    rows = kernel_rows(ctx.device, sizes, 256, ctx.size.reps)
    figures = {f"{r['format']} {r['numel']}": {k: round(r[k], 3) if isinstance(r[k], float) else r[k]
                                               for k in ("encode_gbps", "decode_gbps", "break_even_gbps", "within_bound")} for r in rows}
    return Outcome(all(r["within_bound"] for r in rows), figures,
                   ["GB/s of float32 values; break-even: the link bandwidth below which encode + decode + fewer bytes beat exact bytes"])


CHECKS: dict[str, Callable[[Context], Outcome]] = {
    "stages": check_stages,
    "unit_overhead": check_unit_overhead,
    "grad_scaler": check_grad_scaler,
    "memory_estimate": check_memory_estimate,
    "offload": check_offload,
    "compile": check_compile,
    "lowbit_kernels": check_lowbit_kernels,
}


def device_tests_check(junit: Path) -> Callable[[Context], Outcome]:
    """The device-agnostic tests' outcome, read from pytest's junit XML at ``junit``."""

    def check(ctx: Context) -> Outcome:
        if not junit.exists():
            raise FileNotFoundError(f"{junit}: pytest wrote no results (it did not run, or crashed)")
        cases = list(ET.parse(junit).getroot().iter("testcase"))
        failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("failure") is not None or c.find("error") is not None]
        skips: dict[str, int] = {}
        for c in cases:
            skip = c.find("skipped")
            if skip is not None:
                skips[skip.get("message", "")] = skips.get(skip.get("message", ""), 0) + 1
        figures = {"modules": sorted({c.get("classname", "") for c in cases}), "tests": len(cases), "failed": failed, "skipped": sum(skips.values()), "passed": len(cases) - len(failed) - sum(skips.values()),
                   "skip_reasons": skips}
        return Outcome(bool(cases) and not failed, figures)

    return check


# ------------------------------------------------------------------------- run, report


def run_checks(ctx: Context, checks: dict[str, Callable[[Context], Outcome]]) -> dict[str, dict[str, Any]]:
    """Run every check; one that raises is recorded as a failure with its traceback."""
    results = {}
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            outcome = check(ctx)
            results[name] = {"passed": bool(outcome.passed), "figures": outcome.figures, "notes": outcome.notes, "error": None}
        except Exception:
            results[name] = {"passed": False, "figures": {}, "notes": [], "error": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
        print(f"gpu_check: {name}: {'passed' if results[name]['passed'] else 'FAILED'} ({results[name]['seconds']} s)", flush=True)
        release()
    return results


def write_report(ctx: Context, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    cuda = ctx.device.type == "cuda"
    report = {
        "device": torch.cuda.get_device_name(ctx.device) if cuda else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "device_type": ctx.device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "world_size": 1,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "size": asdict(ctx.size),
        "peak_memory": PeakMemory.measure(ctx.device),
        "checks": results,
        "passed": all(r["passed"] for r in results.values()),
    }
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    lines = [f"# gpu_check: {'all checks passed' if report['passed'] else 'FAILED'}", ""]
    lines += [f"- {key}: {report[key]}" for key in ("device", "torch", "cuda", "date", "backend", "peak_memory")]
    lines += [f"- size: {report['size']}", ""]
    for name, result in results.items():
        lines += [f"## {name}: {'passed' if result['passed'] else 'FAILED'} ({result['seconds']} s)", ""]
        lines += [f"- {note}" for note in result["notes"]]
        lines += ["", *_figures_markdown(result["figures"]), ""]
        if result["error"]:
            lines += ["```", result["error"].rstrip(), "```", ""]
    (ctx.out / "report.md").write_text("\n".join(lines))
    return report


def _figures_markdown(figures: dict[str, Any]) -> list[str]:
    """A table when every figure is a row of plain values (one per implementation), else JSON."""
    rows = list(figures.values())
    plain = lambda v: isinstance(v, (int, float, str, bool, type(None)))  # noqa: E731
    if rows and all(isinstance(r, dict) and all(plain(v) for v in r.values()) for r in rows):
        columns = list(dict.fromkeys(k for r in rows for k in r))
        lines = ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        return lines + [f"| {name} | " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for name, row in figures.items()]
    return ["```json", json.dumps(figures, indent=2, default=str), "```"]


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (CI)")
    parser.add_argument("--out", type=Path, default=ROOT / "gpu_out", help="folder for report.md / report.json")
    parser.add_argument("--device-tests", type=Path, help="pytest junit XML of the device-agnostic tests, folded into the report")
    parser.add_argument("--only", help="comma-separated checks to run (default: all): " + ", ".join(CHECKS))
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch.cuda.is_available() is False (torch {torch.__version__})")
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise SystemExit(f"--only: no check named {', '.join(unknown)} (checks: {', '.join(CHECKS)})")
    checks = {n: CHECKS[n] for n in names}
    if args.device_tests is not None:
        checks = {"device_tests": device_tests_check(args.device_tests), **checks}
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1 if kind == "cpu" else min(4, os.cpu_count() or 1))
    ctx = Context(device, SIZES["quick" if args.quick else kind], args.out, "inductor" if kind == "cuda" else "aot_eager")
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        report = write_report(ctx, run_checks(ctx, checks))
    finally:
        dist.destroy_process_group()
    print(f"gpu_check: report in {ctx.out / 'report.md'}: {'passed' if report['passed'] else 'FAILED'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
