"""A wrapper its user drops gives its memory back, at every stage.

A notebook, a hyper-parameter sweep or an evaluation loop builds a model and its wrapper, trains
a little and drops them, again and again. Each cycle here does that (a three-layer MLP, 3 Adam
steps) and keeps only a weak reference to a parameter and to the model; after one
``gc.collect()`` none may be alive, and the resident memory of the ranks must not have grown by
what the models held. ``ShardedDataParallel`` kept every model it had wrapped (its gradient hooks
held it in a reference cycle torch hides from the collector, see ``sharded._common.weak_hooks``);
``fully_shard`` models needed up to three collections. A long run must not leave garbage for the
cyclic collector either: ``fully_shard`` left torch's multi-gradient hooks, a cycle through each
watched input's graph node, about 35 objects a step here, freed only by Python's rare full
collections (the resident set grew about 1 MiB per 1,000 steps between them).
"""

from __future__ import annotations

import ctypes
import gc
import types
import weakref
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._harness import run_on_ranks

CYCLES = 4
STEPS = 3


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))


def _oss_ddp(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    from sharded import OSS

    optimizer = OSS(model.parameters(), torch.optim.Adam, lr=1e-3)
    return DDP(model), optimizer


def _sharded_ddp(model: nn.Module, **options: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    from sharded import OSS, ShardedDataParallel

    optimizer = OSS(model.parameters(), torch.optim.Adam, lr=1e-3)
    return ShardedDataParallel(model, optimizer, **options), optimizer


def _fully_shard(model: nn.Module, owned: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    from sharded import fully_shard
    from sharded.fsdp import Owned

    placement = {"shard_placement_fn": lambda p: Owned() if p.dim() == 2 else None} if owned else {}
    for layer in model.children():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **placement)
    fully_shard(model, **placement)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _fsdp_wrapper(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    from sharded import FullyShardedDataParallel

    wrapped = FullyShardedDataParallel(model)
    return wrapped, torch.optim.Adam(wrapped.parameters(), lr=1e-3)


STAGES: dict[str, Callable[[nn.Module], tuple[nn.Module, torch.optim.Optimizer]]] = {
    "OSS + DDP": _oss_ddp,
    "ShardedDataParallel": _sharded_ddp,
    "ShardedDataParallel(overlap_param_broadcast, static_graph)": lambda m: _sharded_ddp(
        m, overlap_param_broadcast=True, static_graph=True
    ),
    "fully_shard": _fully_shard,
    "fully_shard with Owned()": lambda m: _fully_shard(m, owned=True),
    "FullyShardedDataParallel": _fsdp_wrapper,
}


def _train_and_drop(rank: int, wrap: Callable) -> tuple[weakref.ref, weakref.ref]:
    """Build, train ``STEPS`` steps and return weak references to the model and a parameter."""
    model = _mlp()
    wrapped, optimizer = wrap(model)
    _train(rank, wrapped, optimizer, range(STEPS))
    return weakref.ref(model), weakref.ref(next(model.parameters()))


def _train(rank: int, wrapped: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        torch.manual_seed(rank * 100 + step)
        wrapped(torch.randn(16, 256)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _cyclic_garbage_of_steps(rank: int, wrap: Callable) -> tuple[int, str]:
    """Objects only a cyclic collection frees, left by ``STEPS`` training steps after warm-up,
    and the commonest of their types (to find the cycle by). They survive into the oldest
    generation, whose collections Python runs rarely: a long run's resident set grows between them."""
    wrapped, optimizer = wrap(_mlp())
    _train(rank, wrapped, optimizer, range(2))
    gc.collect()
    gc.disable()
    try:
        _train(rank, wrapped, optimizer, range(2, 2 + STEPS))
        gc.set_debug(gc.DEBUG_SAVEALL)
        found = gc.collect()
        kinds = Counter(type(o).__qualname__ for o in gc.garbage).most_common(8)
        named = [repr(o)[:120] for o in gc.garbage if isinstance(o, (types.FunctionType, types.FrameType, type))][:6]
        return found, f"{kinds}; {named}"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def _anonymous_resident_mib() -> float:
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))
    return kib / 1024


def _return_freed_tensors_to_the_system() -> None:
    """glibc maps blocks of 64 KiB and more from now on and unmaps them on free (the setting
    TESTING.md's memory runs start with), so the resident set follows live tensors."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):
        libc.mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)


def _ddp_with_adam(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    return DDP(model), torch.optim.Adam(model.parameters(), lr=1e-3)


def _check_models_are_freed(rank: int, world: int) -> None:
    _return_freed_tensors_to_the_system()
    params_mib = sum(p.numel() * 4 for p in _mlp().parameters()) / 2**20
    # What DDP + torch's Adam leave themselves: on a CUDA build without a GPU, with Lightning's
    # PYTORCH_NVML_BASED_CUDA_CHECK=1 in the environment (an earlier test's), every Adam step's
    # accelerator check loads NVML through a fresh ctypes.CDLL, a cycle of 6 objects; ours may
    # leave no more than that
    _cyclic_garbage_of_steps(rank, _ddp_with_adam)  # warm-up
    baseline, baseline_kinds = _cyclic_garbage_of_steps(rank, _ddp_with_adam)
    for stage, wrap in STAGES.items():
        _train_and_drop(rank, wrap)  # warm-up: caches, the process group's buffers, imports
        gc.collect()
        before = _anonymous_resident_mib()
        refs = [_train_and_drop(rank, wrap) for _ in range(CYCLES)]
        gc.collect()
        alive = sum(model() is not None or param() is not None for model, param in refs)
        assert alive == 0, f"rank {rank}, {stage}: {alive} of {CYCLES} dropped models still alive after gc.collect()"
        grown = _anonymous_resident_mib() - before
        # each model kept would hold its parameters, gradients and a share of Adam's state: well
        # over its parameters' size; what the cycles leave behind otherwise is allocator noise
        assert grown < params_mib, (
            f"rank {rank}, {stage}: resident memory grew {grown:.1f} MiB over {CYCLES} cycles "
            f"(one model's parameters: {params_mib:.1f} MiB)"
        )
        garbage, kinds = _cyclic_garbage_of_steps(rank, wrap)
        assert garbage <= baseline, (
            f"rank {rank}, {stage}: {STEPS} training steps left {garbage} objects in reference cycles, DDP + Adam "
            f"{baseline}: {kinds} (DDP + Adam: {baseline_kinds})"
        )


def test_dropped_models_are_freed_and_steps_leave_no_cycles_at_every_stage():
    run_on_ranks(_check_models_are_freed, 2, timeout=180)


def test_weak_method_hook_calls_while_its_object_lives_and_holds_it_weakly():
    from sharded._common.weak_hooks import weak_method_hook

    class Counter:
        def __init__(self) -> None:
            self.calls: list[int] = []

        def note(self, index: int) -> None:
            self.calls.append(index)

    counter = Counter()
    param = nn.Parameter(torch.ones(3))
    param.register_post_accumulate_grad_hook(weak_method_hook(counter.note, 7))
    param.sum().backward()
    assert counter.calls == [7], "the hook is called with its bound arguments only"
    calls, dropped = counter.calls, weakref.ref(counter)
    del counter  # the test's only reference: the hook must not be another
    assert dropped() is None, "the hook keeps its object alive"
    param.sum().backward()  # the object is gone: the hook does nothing
    assert calls == [7] and torch.equal(param.grad, torch.full((3,), 2.0))
