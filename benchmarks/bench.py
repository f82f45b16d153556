"""Side-by-side benchmark: DDP, torch ZeRO, fairscale, DeepSpeed and sharded, in one launch.

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
under way (``overlap``, from ``ShardedDataParallel.backward_stats``) and the share of gradient
bytes whose reduce left before the last gradient arrived (``overlap bytes``); optimizer-state and
gradient bytes held on each rank (gradients measured after backward, i.e. after reduction); the
peak memory of the rank that rose most (a separate short launch per implementation, so peaks
don't mix, whose ranks start with ``MALLOC_MMAP_THRESHOLD_=65536``: the rise of VmHWM over the
resident set before the model is built, which then follows live bytes, less the file pages of
library code mapped meanwhile: examples/peak_memory.py); bytes and calls
communicated per step, counted at the Python collective level as algorithmic bytes per rank
(ring model: all-reduce moves 2(W-1)/W of its tensor, reduce, broadcast, all-gather and
reduce-scatter (W-1)/W; an all-to-all sends its input less the piece it keeps, (W-1)/W of it
with equal pieces); DDP's gradient all-reduce runs in its C++ reducer, out of Python's
sight, so it is added from the gradient sizes. Finally the last loss and the largest parameter
difference to DDP after the same batches: a fast but wrong result shows.

The Muon rows (``ddp_muon``, ``zero2_muon``, ``fsdp2_muon``, ``zero3_muon``) step the blocks'
matrices with ``torch.optim.Muon`` and the rest with Adam, and report the optimizer step's time
alone beside the whole step's (``optim ms``, every row has it): DDP (every rank orthogonalises
every matrix), ZeRO-2 (each owner its own), torch's FSDP2 (Muon on DTensor shards, whose matrix
products gather each matrix on every rank) and ZeRO-3 with the matrices placed ``Owned()``.
Their parameter difference is taken against ``ddp_muon``.

The gradient-accumulation rows (``zero1_accum``, ``zero1_invariant``, ``zero2_accum``,
``zero2_invariant``, ``zero3_accum``, ``zero3_accum_nosync``, ``zero3_invariant``; issue 29) run
every step as ``--micro-batches`` M micro-batches of one global batch that does not depend on
the world size: the usual accumulation under the wrapper's ``no_sync()`` (or, at stage 3, a
reduce-scatter every micro-batch, or ``set_requires_gradient_sync(False)``) against the same
model, data and Adam through ``sharded.invariant.MicroBatches``, whose results are the same bits
at every world size (benchmarks/accumulation.py says what each does and what its ``compute``,
``between`` and ``after`` phases time). Beside the usual columns they report the loss over the
global batch, each invariant row's parameter difference to its stage's default row and every
row's to the launch's first invariant row, and a digest of the parameters' bytes that other
launches (other world sizes) can be compared with.

Two ZeRO-2 variants show what survives outside the plain case: ``zero2_compile`` runs the model
through ``torch.compile`` (inductor) and ``zero2_unused`` adds one parameter that never gets a
gradient, placed where the first-guess reduce order expects the first gradient. Two optional
layer-3 rows, not in ``make bench``'s list, run FSDP2 users' compile recipe (``block.compile()`` on
every block, then ``fully_shard`` each block and the root): ``fsdp2_compile`` (torch's) and
``zero3_compile`` (ours).

Two ZeRO-1 rows step the optimizer inside DDP's backward (``OSS(overlap_with_ddp=True)``, issue
38): ``zero1_overlap`` through ``sharded.hook_with_zero_step`` (each owner steps every bucket once
the last one is handed over) and ``zero1_overlap_interleaved`` through
``sharded.hook_with_zero_step_interleaved`` (each bucket one bucket later, during the backward),
both over torch's ``allreduce_hook`` and DDP's default buckets; compare them with ``zero1``. Their
``optim ms`` is what ``step()`` has left to do, nearly nothing.

The low-bit rows (issue 39; ``zero1_int8``, ``zero1_fp8``, ``zero2_int8``, ``zero2_int4``,
``zero3_int8``, ``zero3_int8_int4``, ``zero3_fp8``: benchmarks/lowbit_rows.py) build each stage with
a ``sharded.LowBit`` mode as ``examples/train_gpt.py --lowbit`` does and report, beside the usual
columns, the bytes one step's low-bit collectives sent against the same collectives exact (the
wrappers' ``lowbit_traffic``); report.py puts them in a table against the exact row of the same
stage. ``ds_zeropp_hpz`` is DeepSpeed's ZeRO++ hierarchical partitioning (``zero_hpz_partition_size``
2); its quantised weights and gradients do not run on DeepSpeed's CPU accelerator (lowbit_rows.py
says where they stop).

The ``ds_zero1/2/3`` rows are DeepSpeed's ZeRO (``pip install -e '.[bench]'``): fp32, torch's Adam,
``zero_optimization.stage`` 1, 2, 3, no gradient clipping, on its CPU accelerator
(``DS_ACCELERATOR=cpu``, set here when CUDA is absent). Its first start on a machine compiles
DeepSpeed's shared-memory communication op once (cached under ~/.cache/torch_extensions); the
training steps do not use it.

    python benchmarks/bench.py --profile zero2 --sizes 40m-short   # where a step's time goes
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt import GPT, next_token_loss  # noqa: E402  (examples/gpt.py: the model every job shares)
from peak_memory import DataPeak  # noqa: E402

from accumulation import (  # noqa: E402  (benchmarks/accumulation.py: the invariant mode's rows)
    ACCUMULATION, ACCUMULATION_HEAD, DEFAULT_OF, MICRO_BATCHES_ENV, AccumulatedSteps, accumulation_cells,
    accumulation_rows, build_accumulation, reference_invariant,
)
from lowbit_rows import LOWBIT, ZEROPP, ZEROPP_NAMES, build_lowbit, lowbit_bytes  # noqa: E402  (benchmarks/lowbit_rows.py: issue 39's rows)

IMPLS = {
    "ideal": "ideal: no communication, 1/N step",
    "ddp": "torch DDP + Adam",
    "torch_zero": "torch ZeroRedundancyOptimizer + DDP",
    "fairscale": "fairscale OSS + ShardedDDP",
    "zero1": "sharded OSS + DDP",
    "zero1_overlap": "sharded OSS + DDP, step in backward",
    "zero1_overlap_interleaved": "sharded OSS + DDP, step interleaved",
    "zero2": "sharded OSS + ShardedDDP",
    "zero2_overlap": "sharded OSS + SDP, overlapped broadcast",
    "zero2_static": "sharded OSS + SDP, static graph",
    "zero2_fp16": "sharded OSS + SDP, fp16 on the wire",
    "zero2_compile": "sharded OSS + SDP, torch.compile",
    "zero2_unused": "sharded OSS + SDP, 1 unused parameter",
    "fsdp2": "torch fully_shard (FSDP2)",
    "fsdp2_no_reshard": "torch fully_shard, no reshard after fwd",
    "fsdp1": "torch FSDP1 FULL_SHARD",
    "zero3": "sharded fully_shard (ZeRO-3)",
    "zero3_grad_op": "sharded FSDP SHARD_GRAD_OP",
    "ds_zero1": "DeepSpeed ZeRO-1 + torch Adam",
    "ds_zero2": "DeepSpeed ZeRO-2 + torch Adam",
    "ds_zero3": "DeepSpeed ZeRO-3 + torch Adam",
    "fsdp2_compile": "torch fully_shard, blocks compiled",
    "zero3_compile": "sharded fully_shard, blocks compiled",
    "ddp_muon": "torch DDP + Muon (matrices) / Adam",
    "zero2_muon": "sharded OSS(Muon) + OSS(Adam) + SDP",
    "fsdp2_muon": "torch fully_shard + Muon on shards",
    "zero3_muon": "sharded fully_shard, Owned() + Muon",
    **ACCUMULATION,
    **LOWBIT,
    **ZEROPP_NAMES,
}
SHORT_NAMES = {"ddp": "DDP", "torch_zero": "torch ZeRO\n+ DDP", "fairscale": "fairscale\nOSS + SDP",
               "zero1": "sharded\nOSS + DDP", "zero2": "sharded\nOSS + SDP",
               "zero1_overlap": "sharded OSS + DDP\nstep in backward",
               "zero1_overlap_interleaved": "sharded OSS + DDP\nstep interleaved",
               "zero2_fp16": "sharded SDP\nfp16 wire", "ideal": "ideal", "zero2_overlap": "sharded SDP\noverlap bcast",
               "zero2_static": "sharded SDP\nstatic graph",
               "zero2_compile": "sharded SDP\ncompile", "zero2_unused": "sharded SDP\nunused param",
               "fsdp2": "torch\nFSDP2", "fsdp2_no_reshard": "torch FSDP2\nno reshard",
               "fsdp1": "torch\nFSDP1", "zero3": "sharded\nZeRO-3", "zero3_grad_op": "sharded\nSHARD_GRAD_OP",
               "ds_zero1": "DeepSpeed\nZeRO-1", "ds_zero2": "DeepSpeed\nZeRO-2", "ds_zero3": "DeepSpeed\nZeRO-3",
               "fsdp2_compile": "torch FSDP2\ncompiled", "zero3_compile": "sharded ZeRO-3\ncompiled",
               "ddp_muon": "DDP\nMuon", "zero2_muon": "sharded ZeRO-2\nMuon", "fsdp2_muon": "torch FSDP2\nMuon",
               "zero3_muon": "sharded ZeRO-3\nOwned + Muon",
               **{impl: name.replace(", ", "\n") for impl, name in {**ACCUMULATION, **LOWBIT, **ZEROPP_NAMES}.items()}}
# The Muon rows: torch.optim.Muon over the blocks' matrices, Adam over the rest (embeddings, head,
# norms, biases), each compared with DDP + the same two optimizers
MUON = {"ddp_muon", "zero2_muon", "fsdp2_muon", "zero3_muon"}
MUON_LR = 0.02
# which ZeRO stage each implementation is, for the bytes-per-parameter table
STAGES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
# DeepSpeed's rows (the `bench` extra) and their zero_optimization.stage
DEEPSPEED = {"ds_zero1": 1, "ds_zero2": 2, "ds_zero3": 3, **{impl: 3 for impl in ZEROPP}}
# "-short" sizes run 32 tokens per rank: the step is then optimizer and communication work, as it is
# when an accelerator makes the matrix work cheap, and that is where the implementations differ.
SIZES = {"10m": dict(dim=384, layers=6, batch=8, seq=128), "40m": dict(dim=640, layers=8, batch=4, seq=128),
         "40m-short": dict(dim=640, layers=8, batch=1, seq=32)}
COLLECTIVES = {"all_reduce": 2, "reduce": 1, "broadcast": 1, "all_gather": 1, "all_gather_into_tensor": 1,
               "all_gather_single": 1, "reduce_scatter": 1, "reduce_scatter_tensor": 1, "reduce_scatter_single": 1,
               "all_to_all_single": 1, "gather": 1, "send": None, "recv": None}
# the argument holding the full-size tensor, where it is not the first: a reduce-scatter's input
FULL_SIZE_ARG = {"reduce_scatter": (1, "input_list"), "reduce_scatter_tensor": (1, "input"),
                 "reduce_scatter_single": (1, "input"), "all_to_all_single": (1, "input")}
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
        from sharded._owners.partition import Partition

        mine = Partition.build([list(model.parameters())], dist.get_world_size()).owned_by_group(dist.get_rank())[0]
        opt = torch.optim.Adam(mine, lr=LR)
        return model, opt, True, opt
    if impl in ACCUMULATION:
        return build_accumulation(impl, model, LR)
    if impl in MUON:
        return build_muon(impl, model)
    if impl in LOWBIT:
        return build_lowbit(impl, model, LR)
    if impl == "zero2_unused":  # defined last: the first gradient the initial reduce order expects
        model.unused = nn.Linear(model.head.in_features, model.head.in_features).to(model.head.weight.device)
    if impl.startswith(("fsdp", "zero3")):
        return build_fully_sharded(impl, model)
    if impl in DEEPSPEED:
        return build_deepspeed(impl, model)
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
    if impl.startswith("zero1_overlap"):
        return build_zero1_overlap(impl, model)
    from sharded import OSS, ShardedDataParallel

    fp16_wire = impl == "zero2_fp16"
    opt = OSS(params, torch.optim.Adam, lr=LR, broadcast_fp16=fp16_wire)
    if impl == "zero1":
        return DDP(model), opt, True, opt.optim
    if impl == "zero2_compile":
        model = torch.compile(model)
    overlap, static = impl == "zero2_overlap", impl == "zero2_static"
    wrapped = ShardedDataParallel(model, opt, reduce_fp16=fp16_wire, overlap_param_broadcast=overlap, static_graph=static)
    return wrapped, opt, True, opt.optim


def build_zero1_overlap(impl: str, model: nn.Module):
    """ZeRO-1 whose step runs in DDP's backward, bucket by bucket, over torch's all-reduce hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import sharded

    opt = sharded.OSS(model.parameters(), torch.optim.Adam, lr=LR, overlap_with_ddp=True)
    ddp = DDP(model)
    interleaved = impl == "zero1_overlap_interleaved"
    drive = sharded.hook_with_zero_step_interleaved if interleaved else sharded.hook_with_zero_step
    ddp.register_comm_hook(None, drive(allreduce_hook, ddp, opt))
    return ddp, opt, True, opt.optim


def build_fully_sharded(impl: str, model: nn.Module):
    """Layer 3 and torch's FSDPs, each GPT block a unit and the root the unit for the rest."""
    from gpt import Block

    if impl == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        model = FSDP1(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=device)
    elif impl == "zero3_grad_op":
        from sharded.fsdp import FullyShardedDataParallel, ShardingStrategy

        model = FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, auto_wrap_policy={Block})
    else:
        if impl.startswith("zero3"):
            from sharded import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        if impl.endswith("_compile"):  # FSDP2's recipe: compile each block (inductor), then shard
            for block in model.blocks:
                block.compile()
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=impl != "fsdp2_no_reshard")
        fully_shard(model, reshard_after_forward=impl != "fsdp2_no_reshard")
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    return model, opt, True, opt


def is_block_matrix(name: str, param: torch.Tensor) -> bool:
    """What the Muon rows step with Muon: the transformer blocks' weight matrices."""
    return name.startswith("blocks.") and param.dim() == 2


def build_muon(impl: str, model: nn.Module):
    """Muon over the blocks' matrices and Adam over the rest: DDP; ZeRO-2 (two ``OSS``, the Muon
    one balanced by Newton-Schulz cost, under one ``ShardedDataParallel``); torch's FSDP2 with
    Muon stepping DTensor shards (its matrix products redistribute); ZeRO-3 with the matrices
    placed ``Owned()``, whole on one rank each, every other parameter element-sharded."""
    if impl == "zero2_muon":
        from sharded import OSS, ShardedDataParallel

        named = list(model.named_parameters())
        muon = OSS([p for n, p in named if is_block_matrix(n, p)], torch.optim.Muon, lr=MUON_LR)
        adam = OSS([p for n, p in named if not is_block_matrix(n, p)], torch.optim.Adam, lr=LR)
        return ShardedDataParallel(model, [muon, adam]), Optimizers([muon, adam]), True, Optimizers([muon.optim, adam.optim])
    if impl in ("fsdp2_muon", "zero3_muon"):
        if impl == "zero3_muon":
            from sharded import fully_shard
            from sharded.fsdp import Owned

            matrices = {id(p) for n, p in model.named_parameters() if is_block_matrix(n, p)}
            placement = {"shard_placement_fn": lambda p: Owned() if id(p) in matrices else None}
        else:
            from torch.distributed.fsdp import fully_shard

            placement = {}
        for block in model.blocks:
            fully_shard(block, **placement)
        fully_shard(model, **placement)
    named = list(model.named_parameters())
    opt = Optimizers([torch.optim.Muon([p for n, p in named if is_block_matrix(n, p)], lr=MUON_LR),
                      torch.optim.Adam([p for n, p in named if not is_block_matrix(n, p)], lr=LR)])
    return (DDP(model) if impl == "ddp_muon" else model), opt, True, opt


class Optimizers:
    """Several optimizers over disjoint parameters, stepped as one (what ``train_step`` drives)."""

    def __init__(self, optimizers: list) -> None:
        self.optimizers = optimizers

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    @property
    def state(self) -> dict:
        return {p: s for optimizer in self.optimizers for p, s in optimizer.state.items()}


def build_deepspeed(impl: str, model: nn.Module):
    """DeepSpeed's ZeRO at the stage of ``impl``, as a user runs it beside us: fp32, torch's Adam
    (the optimizer of every other row), the process group bench.py already made. On a machine
    without CUDA, ``main`` sets ``DS_ACCELERATOR=cpu`` before the ranks start (gloo)."""
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # asserted by DeepSpeed; one host here
    # it calls torch's all_gather_into_tensor / reduce_scatter_tensor, deprecated in 2.13, once per bucket
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`")
    zero: dict = {"stage": DEEPSPEED[impl], **ZEROPP.get(impl, {})}
    if zero["stage"] == 3:  # True would replace F.linear process-wide: every row's round-off would change
        zero["memory_efficient_linear"] = False
    # gradient_clipping: DeepSpeed 0.19 clips to norm 1.0 unless told otherwise; no other row clips
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero,
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1}
    adam = torch.optim.Adam(model.parameters(), lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adam, config=config, dist_init_required=False)
    return engine, DeepSpeedSteps(engine), True, engine.optimizer.optimizer


class DeepSpeedSteps:
    """The optimizer interface ``train_step`` drives, for a DeepSpeed engine: backward and step
    must go through the engine (its reduce epilogue, the parameter all-gather after the step)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def grad_bytes(self) -> int:
        """Gradient bytes held after backward: DeepSpeed keeps its reduced partition in
        ``averaged_gradients`` (per group, a list or a dict of tensors); ``p.grad`` stays None."""
        groups = self.engine.optimizer.averaged_gradients
        groups = groups.values() if isinstance(groups, dict) else groups
        return sum(local_nbytes(t) for group in groups for t in (group or []) if torch.is_tensor(t))


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for ``t`` (a DTensor's local shard)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def full_named_params(impl: str, wrapped: nn.Module, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the unwrapped ``model`` in full, by name (collective for the sharded
    implementations)."""
    if impl == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

        with FSDP1.summon_full_params(wrapped):
            return {name: p.detach().clone() for name, p in model.named_parameters()}
    if DEEPSPEED.get(impl) == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {name: p.detach().clone() for name, p in model.named_parameters()}
    if hasattr(wrapped, "wait_for_params"):  # overlapped broadcasts still in flight after the last step
        wrapped.wait_for_params()
    if impl == "zero3_muon":  # owned matrices are whole on their owner only: summon gathers them
        from sharded.fsdp import summon_full_params

        with summon_full_params(model, writeback=False):
            return {name: p.detach().clone() for name, p in model.named_parameters()}
    return {name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for name, p in model.named_parameters()}


def train_step(size, setup, step, rank, device):
    wrapped, opt, set_to_none, _ = setup
    opt.zero_grad(set_to_none=set_to_none)
    if isinstance(opt, AccumulatedSteps):  # M micro-batches, default or invariant
        loss = opt.forward_backward(SIZES[size], VOCAB, step, device, next_token_loss)
        grad_bytes = sum(local_nbytes(p.grad) for p in wrapped.parameters() if p.grad is not None)
        return loss, grad_bytes, optimizer_step_seconds(opt, device)
    loss = next_token_loss(wrapped, tokens_for(size, step, rank, device))
    if isinstance(opt, DeepSpeedSteps):
        opt.backward(loss)
        grad_bytes = opt.grad_bytes()
    else:
        loss.backward()
        grad_bytes = sum(local_nbytes(p.grad) for p in wrapped.parameters() if p.grad is not None)
    return loss.item(), grad_bytes, optimizer_step_seconds(opt, device)


def optimizer_step_seconds(opt, device) -> float:
    """Step ``opt``; the seconds it took."""
    started = time.perf_counter()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


class CollectiveCounter:
    """Counts calls and algorithmic bytes per rank of torch.distributed collectives."""

    def __init__(self) -> None:
        self.calls, self.bytes = 0, 0.0
        self._saved = {}
        self._ds_saved = None
        self._inside_gather = False

    def __enter__(self):
        world = dist.get_world_size()
        for name, factor in COLLECTIVES.items():
            if hasattr(dist, name):  # all_gather_single / reduce_scatter_single: torch >= 2.13
                fn = self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._counting(name, fn, factor, world))
        # sharded's ZeRO-3 gathers start here: one all-gather, though on gloo it is made of one
        # broadcast per rank (not counted again)
        from sharded._common import comm

        self._comm, self._comm_gather = comm, comm.all_gather_into_tensor
        comm.all_gather_into_tensor = self._counting_gather(self._comm_gather, world)
        backend = self._deepspeed_backend()
        if backend is not None:  # it looked its all-gather and reduce-scatter up once, at start
            self._ds_saved = (backend.all_gather_function, backend.reduce_scatter_function)
            backend.all_gather_function = self._counting("all_gather_into_tensor", self._ds_saved[0], 1, world)
            backend.reduce_scatter_function = self._counting("reduce_scatter_tensor", self._ds_saved[1], 1, world)
        return self

    @staticmethod
    def _deepspeed_backend():
        """DeepSpeed's communication backend, if a DeepSpeed row made one in this process."""
        return getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)

    def _counting(self, name, fn, factor, world):
        def counted(*args, **kwargs):
            if self._inside_gather:
                return fn(*args, **kwargs)
            self.calls += 1
            self.bytes += sent_bytes(name, factor, world, args, kwargs)
            return fn(*args, **kwargs)

        return counted

    def _counting_gather(self, fn, world):
        def counted(output, *args, **kwargs):
            self.calls += 1
            self.bytes += output.numel() * output.element_size() * (world - 1) / world
            self._inside_gather = True
            try:
                return fn(output, *args, **kwargs)
            finally:
                self._inside_gather = False

        return counted

    def __exit__(self, *exc):
        self._comm.all_gather_into_tensor = self._comm_gather
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        backend = self._deepspeed_backend()
        if backend is not None and self._ds_saved is not None:
            backend.all_gather_function, backend.reduce_scatter_function = self._ds_saved


def sent_bytes(name: str, factor, world: int, args, kwargs) -> float:
    """Algorithmic bytes this rank sends in one call: ``factor`` x (W-1)/W of the full-size tensor
    (ring model), or all of it for point-to-point (``factor`` None). An all-to-all sends its input
    less the piece it keeps: (W-1)/W of it with equal pieces, exactly so with uneven ones."""
    nbytes = full_size_bytes(name, args, kwargs)
    if name == "all_to_all_single":
        splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
        if splits:
            kept = splits[dist.get_rank(kwargs.get("group", args[4] if len(args) > 4 else None))]
            return nbytes * (1 - kept / sum(splits))
    return nbytes * (factor * (world - 1) / world if factor else 1)


def full_size_bytes(name: str, args, kwargs) -> int:
    """Bytes of the tensor the ring model scales: a reduce-scatter's input, else the first."""
    index, key = FULL_SIZE_ARG.get(name, (0, None))
    found = args[index] if len(args) > index else kwargs.get(key) if key else next(iter(kwargs.values()))
    if not torch.is_tensor(found):  # a list: a reduce-scatter's input chunks or an all-gather's outputs
        return sum(t.numel() * t.element_size() for t in found)
    return found.numel() * found.element_size()


def held_param_bytes(wrapped: nn.Module) -> int:
    """Bytes of parameter storage this rank holds (each storage once: flat buffers, shards)."""
    storages = {}
    for p in wrapped.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        shard = getattr(p, "ds_tensor", None)  # DeepSpeed ZeRO-3: the partition, beside p's (maybe empty) data
        for held in (local, shard) if shard is not None else (local,):
            storages[held.untyped_storage().data_ptr()] = held.untyped_storage().nbytes()
    return sum(storages.values())


def state_bytes(local_optimizer) -> int:
    return sum(local_nbytes(v) for s in local_optimizer.state.values() for v in s.values() if torch.is_tensor(v))


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
        optim_steps = {impl: [] for impl in args.impls}  # timed optimizer steps alone (slowest rank)
        overlaps = {impl: [] for impl in args.impls}
        overlap_bytes = {impl: [] for impl in args.impls}
        phases = {impl: [] for impl in args.impls}  # the accumulation rows' phases (slowest rank each)
        losses, grads = {}, {}
        step_of = {impl: 0 for impl in args.impls}
        rounds = args.warmup + args.steps
        for round_index in range(0, rounds, args.turn):
            for impl in args.impls:
                this_round = []
                for _ in range(min(args.turn, rounds - round_index)):
                    dist.barrier()
                    start = time.perf_counter()
                    losses[impl], grads[impl], optim_s = train_step(size, setups[impl], step_of[impl], rank, device)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    elapsed = max(gather(time.perf_counter() - start, device))
                    if step_of[impl] >= args.warmup:
                        this_round.append(elapsed)
                        optim_steps[impl].append(max(gather(optim_s, device)))
                        if isinstance(setups[impl][1], AccumulatedSteps):
                            phases[impl].append({k: max(gather(v, device)) for k, v in setups[impl][1].phases.items()})
                        stats = getattr(setups[impl][0], "backward_stats", None)
                        if stats is not None:
                            overlaps[impl].append(stats.overlap)
                            overlap_bytes[impl].append(stats.overlap_bytes)
                    step_of[impl] += 1
                if this_round:
                    rounds_of[impl].append(this_round)
        references = {base: dict(models[base].named_parameters()) for base in ("ddp", "ddp_muon") if base in models}
        accumulated = {}  # the accumulation rows' full parameters, compared after the loop
        for impl in args.impls:
            with CollectiveCounter() as counter:
                train_step(size, setups[impl], step_of[impl], rank, device)
            named = full_named_params(impl, setups[impl][0], models[impl])
            if isinstance(setups[impl][1], AccumulatedSteps):
                losses[impl] = setups[impl][1].global_loss()
                accumulated[impl] = named
            reference = references.get("ddp_muon" if impl in MUON else "ddp", {})
            common = [name for name in named if name in reference]
            exact = impl != "ideal" and common
            diff = max((named[n] - reference[n]).abs().max().item() for n in common) if exact else float("nan")
            ddp_bytes = 0.0
            if impl in ("ddp", "torch_zero", "zero1", "ddp_muon", "zero1_accum", "zero1_int8", "zero1_fp8"):  # DDP's C++ all-reduce of every gradient
                ddp_bytes = sum(p.numel() * p.element_size() for p in named.values()) * 2 * (world - 1) / world
            overlap, early_bytes = (statistics.mean(gather(statistics.median(xs[impl]), device)) if xs[impl] else None
                                    for xs in (overlaps, overlap_bytes))
            report.setdefault(size, {})[impl] = {
                "median_step_s": statistics.median(t for r in rounds_of[impl] for t in r),
                "median_optim_step_s": statistics.median(optim_steps[impl]),
                "round_steps_s": rounds_of[impl],
                "overlap": overlap,
                "overlap_bytes": early_bytes,
                "state_bytes": gather(state_bytes(setups[impl][3]), device),
                "grad_bytes": gather(grads[impl], device),
                "comm_calls_python": counter.calls,
                "comm_bytes": counter.bytes + ddp_bytes,
                "final_loss": losses[impl],
                "max_param_diff_vs_ddp": diff,
                "params": sum(p.numel() for p in named.values()),
                "param_bytes": gather(held_param_bytes(setups[impl][0]), device),
                "param_digest": digest(named),
                "lowbit_bytes": lowbit_bytes(setups[impl][0], setups[impl][1]),
                **median_phases(phases[impl]),
            }
        compare_accumulation(report[size], accumulated)
        del setups, models
    if rank == 0:
        Path(results_path).write_text(json.dumps(report))
    finish_rank()


def digest(named: dict[str, torch.Tensor]) -> str:
    """The first 12 hex digits of a SHA-256 over every parameter's bytes, in name order: equal
    digests are the same bits, across rows and across launches (other world sizes)."""
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(name.encode())
        h.update(named[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


def median_phases(steps: list[dict[str, float]]) -> dict[str, float]:
    """The median of each phase an accumulation row timed, over its timed steps."""
    return {f"median_{key}": statistics.median(step[key] for step in steps) for key in (steps[0] if steps else {})}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def compare_accumulation(rows: dict, full: dict[str, dict[str, torch.Tensor]]) -> None:
    """Each accumulation row's largest parameter difference to its stage's default row (invariant
    rows) and to the launch's first invariant row (every row), in place."""
    first = reference_invariant(rows)
    for impl in full:
        default = DEFAULT_OF.get(impl)
        if default in full:
            rows[impl]["max_param_diff_vs_default"] = max_abs_diff(full[impl], full[default])
        if first is not None:
            rows[impl]["max_param_diff_vs_invariant"] = max_abs_diff(full[impl], full[first])


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
    """Each rank's data peak over a few steps of ``impl`` (examples/peak_memory.py): the rise of
    its resident set's high-water mark (VmHWM) over its resident set once the libraries are
    imported, before the model is built, less the file pages of library code mapped meanwhile."""
    device = init_rank(rank, world, store_path)
    import_libraries(impl)
    peak = DataPeak()
    setup = build(impl, make_model(size, device))
    for step in range(3):
        train_step(size, setup, step, rank, device)
    peaks = gather(peak.rise(), device)
    if rank == 0:
        Path(results_path).write_text(json.dumps(peaks))
    finish_rank()


def import_libraries(impl: str) -> None:
    """Import what ``build`` imports for ``impl``, so that library code stays out of its peak."""
    if impl in DEEPSPEED:
        import deepspeed  # noqa: F401
    elif impl in ACCUMULATION:
        import sharded.invariant  # noqa: F401
    elif impl == "fairscale":
        import fairscale.nn  # noqa: F401
        import fairscale.optim  # noqa: F401
    else:
        import sharded  # noqa: F401


def peak_rise(world: int, size: str, impl: str) -> list[float]:
    """Each rank's peak rise over a few steps of ``impl`` alone, in a launch of its own whose ranks
    start with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps every allocation of 64 KiB or more
    and unmaps it when freed, so the high-water mark follows live bytes (with its default, freed
    tensors stay in the heap and every implementation peaks alike). glibc reads the variable when
    a process starts: the spawned ranks inherit it. Empty if the launch fails twice (the timings
    already taken are worth more than this column)."""
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        for attempt in ("retrying", "leaving its peak out"):
            try:
                return launch(memory_rank, world, size, impl)
            except Exception as error:  # a rank crashing at exit must not lose the whole run
                print(f"memory launch of {impl} at {size} failed ({error}); {attempt}", file=sys.stderr)
        return []
    finally:
        if saved is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


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
        ddp_time = (rows.get("ddp") or rows.get("ddp_muon") or {}).get("median_step_s")
        print(f"\n{size} ({rows[next(iter(rows))]['params'] / 1e6:.1f}M params), world {world}")
        print(f"{'implementation':<40}{'step s':>8}{'optim ms':>9}{'vs DDP':>8}{'vs ideal':>10}{'± noise':>9}{'exposed ms':>12}"
              f"{'exposed %':>10}{'overlap':>9}{'ov. bytes':>10}{'vs FSDP2':>9}{'params MiB/rank':>17}{'state MiB/rank':>18}"
              f"{'grads MiB/rank':>18}{'peak MiB (max)':>16}{'MiB sent':>10}{'sent/M':>8}{'calls':>7}{'loss':>8}"
              f"{'max |Δ|':>10}")
        for impl, r in rows.items():
            mib = lambda xs: "/".join(f"{x / 2**20:.1f}" for x in xs)
            ratio = f"{r['median_step_s'] / ddp_time:.2f}" if ddp_time else "-"
            overlap, early_bytes = (f"{r[key]:.2f}" if r.get(key) is not None else "-" for key in ("overlap", "overlap_bytes"))
            ideal = (f"{r['vs_ideal']:>10.2f}{r['ratio_noise']:>9.2f}{r['exposed_ms']:>12.0f}{100 * r['exposed_share']:>9.0f}%"
                     if "vs_ideal" in r else f"{'-':>10}{'-':>9}{'-':>12}{'-':>10}")
            print(f"{IMPLS[impl]:<40}{r['median_step_s']:>8.3f}{1e3 * r['median_optim_step_s']:>9.1f}{ratio:>8}{ideal}{overlap:>9}{early_bytes:>10}{fsdp2_ratio(rows, impl):>9}"
                  f"{mib(r.get('param_bytes', [])):>17}{mib(r['state_bytes']):>18}{mib(r['grad_bytes']):>18}"
                  f"{mib(peak_of(r)):>16}{r['comm_bytes'] / 2**20:>10.1f}{sent_per_model(r, world):>8.2f}"
                  f"{r['comm_calls_python']:>7}{r['final_loss']:>8.4f}{r['max_param_diff_vs_ddp']:>10.2e}")
        if accumulation_rows(rows):
            print_accumulation_table(rows)


def print_accumulation_table(rows: dict) -> None:
    """The invariant mode against the default accumulation, per stage (report.py's table, as text)."""
    table = [ACCUMULATION_HEAD] + [accumulation_cells(impl, rows, IMPLS[impl]) for impl in accumulation_rows(rows)]
    widths = [max(len(cells[i]) for cells in table) for i in range(len(ACCUMULATION_HEAD))]
    print()
    for cells in table:
        print("  ".join(cell.rjust(width) if i else cell.ljust(width) for i, (cell, width) in enumerate(zip(cells, widths))))


def peak_of(row: dict) -> list[float]:
    """The peak rise of the rank that rose most, as a one-element list; empty when not measured."""
    peaks = row.get("peak_rise") or []
    return [max(peaks)] if peaks else []


# the torch FSDP2 run with the same strategy as each layer-3 run
SAME_STRATEGY = {"zero3": "fsdp2", "zero3_grad_op": "fsdp2_no_reshard", "fsdp1": "fsdp2",
                 "zero3_compile": "fsdp2_compile", "zero3_muon": "fsdp2_muon"}


def fsdp2_ratio(rows, impl) -> str:
    other = rows.get(SAME_STRATEGY.get(impl, ""))
    return f"{rows[impl]['median_step_s'] / other['median_step_s']:.2f}" if other else "-"


def sent_per_model(row, world) -> float:
    """Bytes sent per step in units of one ring pass over the fp32 model, (W-1)/W x 4 x params:
    DDP's all-reduce is 2 of them, ZeRO-3 three (gather, gather again, reduce-scatter)."""
    return row["comm_bytes"] / (4 * row["params"] * (world - 1) / world) if world > 1 else 0.0


def zero_formula(stage: str, n: int, mixed: bool) -> float:
    """Bytes per parameter per rank from the ZeRO paper (Adam: K = 12 bytes of fp32 state in
    mixed precision: master, momentum, variance; 8 in fp32, where the parameter is the master)."""
    if mixed:  # 2-byte parameters and gradients + 12 bytes of state
        return {"DDP": 16, "ZeRO-1": 4 + 12 / n, "ZeRO-2": 2 + 14 / n, "ZeRO-3": 16 / n}[stage]
    return {"DDP": 16, "ZeRO-1": 8 + 8 / n, "ZeRO-2": 4 + 12 / n, "ZeRO-3": 16 / n}[stage]


def bytes_rank(rank, world, size, impls, store_path, results_path):
    """Per-rank parameter, gradient and optimizer-state bytes after two steps of each stage."""
    device = init_rank(rank, world, store_path)
    held = {}
    for impl in impls:
        setup = build(impl, make_model(size, device))
        for step in range(2):
            _, grads, _ = train_step(size, setup, step, rank, device)
        held[impl] = {"params": gather(held_param_bytes(setup[0]), device), "grads": gather(grads, device),
                      "state": gather(state_bytes(setup[3]), device)}
        del setup
    if rank == 0:
        Path(results_path).write_text(json.dumps(held))
    finish_rank()


def zero_memory(size: str, worlds: list[int], out: Path) -> dict:
    """DDP, ZeRO-1, -2, -3 bytes per parameter per rank at each world size, beside the formulas."""
    with torch.device("meta"):
        params = sum(p.numel() for p in make_model(size, "meta").parameters())
    table = {world: launch(bytes_rank, world, size, list(STAGES)) for world in worlds}
    print(f"\nbytes per parameter per rank, {size} ({params / 1e6:.1f}M params), fp32 Adam; "
          "formula fp32 (mixed-precision paper formula)")
    print(f"{'stage':<8}" + "".join(f"{'world ' + str(w) + ' measured':>20}{'formula':>16}" for w in worlds))
    for impl, stage in STAGES.items():
        cells = ""
        for world in worlds:
            held = table[world][impl]
            worst = max(sum(part[r] for part in held.values()) for r in range(world)) / params
            cells += f"{worst:>20.2f}{zero_formula(stage, world, False):>8.2f} ({zero_formula(stage, world, True):.2f})"
        print(f"{stage:<8}{cells}")
    plot_zero_memory(table, params, worlds, out / "zero_memory.png")
    return {"size": size, "params": params, "per_rank_bytes": table}


def plot_zero_memory(table, params, worlds, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(worlds)
    for offset, world in enumerate(worlds):
        xs = [i + width * offset for i in range(len(STAGES))]
        parts = {"parameters": "params", "gradients": "grads", "optimizer state": "state"}
        base = [0.0] * len(STAGES)
        for label, key in parts.items():
            heights = [max(table[world][impl][key]) / params for impl in STAGES]
            ax.bar(xs, heights, width=width, bottom=base, label=label if offset == 0 else None,
                   color={"params": "C0", "grads": "C1", "state": "C2"}[key], alpha=1.0 - 0.35 * offset)
            base = [b + h for b, h in zip(base, heights)]
        ax.scatter(xs, [zero_formula(s, world, False) for s in STAGES.values()], marker="_", s=400, color="black",
                   label="ZeRO formula (fp32 Adam)" if offset == 0 else None, zorder=3)
    ticks = [i + width * offset for i in range(len(STAGES)) for offset in range(len(worlds))]
    ax.set_xticks(ticks, [f"{stage}\nN={world}" for stage in STAGES.values() for world in worlds], fontsize=8)
    ax.set_ylabel("bytes per parameter, largest rank")
    ax.set_title("what each rank holds: measured (bars) against the ZeRO paper (lines)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
    parser.add_argument("--no-memory", action="store_true", help="skip the per-implementation peak-memory launches")
    parser.add_argument("--zero-worlds", type=lambda s: [int(w) for w in s.split(",") if w], default=[2, 4],
                        help="world sizes of the DDP / ZeRO-1/2/3 bytes-per-parameter table ('' to skip)")
    parser.add_argument("--profile", metavar="IMPL", help="profile IMPL on the first of --sizes instead")
    parser.add_argument("--micro-batches", type=int, default=8,
                        help="M, the micro-batches of every step's global batch in the accumulation rows")
    args = parser.parse_args()
    os.environ[MICRO_BATCHES_ENV] = str(args.micro_batches)  # read in the ranks (benchmarks/accumulation.py)
    if not torch.cuda.is_available():  # read by DeepSpeed's import in the ranks: its CPU accelerator, gloo
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.profile:
        for rank, text in enumerate(launch(profile_rank, args.world, args.sizes[0], args.profile)):
            print(f"\n--- rank {rank}: {IMPLS[args.profile]}, {args.sizes[0]}, per step ---\n{text}")
        return

    started, load_before = time.time(), os.getloadavg()  # the shared machine's load, before our ranks
    report = launch(timing_rank, args.world, args)
    if not args.no_memory:
        for size, rows in report.items():
            for impl in rows:
                if impl != "ideal":
                    rows[impl]["peak_rise"] = peak_rise(args.world, size, impl)
    print_table(report, args.world)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    zero = zero_memory(args.sizes[0], args.zero_worlds, out) if args.zero_worlds else None
    meta = {"world": args.world, "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "backend": "nccl" if torch.cuda.is_available() else "gloo", "command": " ".join(sys.argv),
            "micro_batches": args.micro_batches, "seconds": round(time.time() - started),
            "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
    (out / "bench.json").write_text(json.dumps({"meta": meta, "results": report, "zero_memory": zero}, indent=1))
    plot(report, out / "bench.png")
    print(f"\n{meta}\nwrote {out / 'bench.json'} and {out / 'bench.png'}")


if __name__ == "__main__":
    main()
