"""The one place the multi-rank tests take their device and process-group backend from.

``SHARDED_TEST_DEVICE=cpu|cuda`` (default ``cpu``) picks the device on which the device-agnostic
test modules (those marked ``pytestmark = DEVICE_AGNOSTIC``) build their models and batches:
:func:`on_test_device` moves them, and leaves them alone on the CPU, so a CPU run is exactly what
it was before this file existed. The harness starts every rank with :func:`backend_for` and,
on CUDA, the rank's CUDA device set to :data:`CUDA_DEVICE`.

* ``cpu``: gloo at every world size.
* ``cuda`` (one GPU is enough): world 1 runs on NCCL. Worlds 2 and 3 share the one GPU, which
  NCCL refuses (one rank per device), so they run on gloo with CUDA tensors: gloo stages them
  through pinned host memory for the collectives it has a CUDA path for, and has none for those
  in :data:`GLOO_CUDA_UNSUPPORTED`. On CUDA with gloo the harness installs
  :func:`install_gloo_cuda_guard`, so a test reaching one of those fails with the collective's
  name instead of gloo handing a device pointer to its host transport.

Which collectives gloo carries CUDA tensors through was read in torch's source,
``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp`` and ``ProcessGroupGlooCuda.cpp`` (torch
2.15.0a0, the development tree right after 2.14): broadcast, all_reduce, reduce, all_gather
(and all_gather_into_tensor, built on it), gather, scatter and all_to_all_single have CUDA work
classes; reduce_scatter and reduce_scatter_tensor are built on all_reduce. torch's documentation
table (``docs/source/distributed.md``) still marks reduce, all_gather, gather, scatter,
reduce_scatter and all_to_all as CPU-only for gloo: it predates those paths.
tests/test_device_suite.py runs each collective said to work on the test device, so the first
run on a GPU checks this list.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, TypeVar

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = [
    "ENV_VAR",
    "CUDA_DEVICE",
    "DEVICE_AGNOSTIC",
    "GLOO_CUDA_SUPPORTED",
    "GLOO_CUDA_UNSUPPORTED",
    "LAYER3_OVER_GLOO_ON_CUDA",
    "GlooDeviceUnsupported",
    "backend_for",
    "collective_device",
    "cpu_only",
    "device_type_under_test",
    "device_under_test",
    "install_gloo_cuda_guard",
    "on_test_device",
    "skip_gloo_on_cuda",
    "world_sizes",
]

ENV_VAR = "SHARDED_TEST_DEVICE"
DEVICE_TYPES = ("cpu", "cuda")
CUDA_DEVICE = torch.device("cuda", 0)  # every rank of a test shares the first GPU

DEVICE_AGNOSTIC = pytest.mark.device_agnostic  # a module whose tests run on the device under test

# Collectives gloo runs with CUDA tensors (staged through pinned host memory).
GLOO_CUDA_SUPPORTED = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single",
)

# Those it does not, and what happens instead. The guard intercepts the ones marked with a
# torch.distributed function name; PREMUL_SUM and all_reduce_coalesced fail in gloo itself.
GLOO_CUDA_UNSUPPORTED = {
    "send": "no CUDA path: gloo's unbound buffer is given the tensor's data pointer for its host transport",
    "recv": "no CUDA path: as send",
    "isend": "as send",
    "irecv": "as recv",
    "batch_isend_irecv": "as send/recv",
    "all_gather_coalesced": "no device check and no CUDA path: the device pointers go to gloo's host all-gather",
    "all_gather_into_tensor_coalesced": "built on all_gather_coalesced",
    "all_reduce_coalesced": "CPU only: gloo raises 'unsupported device type cuda'",
    "PREMUL_SUM": "no such op in gloo on any device (torch builds it for NCCL only)",
}
_GUARDED = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "all_gather_coalesced", "all_gather_into_tensor_coalesced")

# Measured on the first GPU run (docs/gpu.md: H200, torch 2.11.0+cu130): with the default mesh on
# CUDA, as torch's, these tests train at worlds 2-3 over gloo, then every rank dies with SIGSEGV in
# torch's DTensor.full_tensor() (functional all_gather_tensor -> wait_tensor over gloo with CUDA
# tensors) when the test gathers the parameters to compare; test_default_mesh_is_torchs, which
# gathers nothing, passes there. The path is torch's alone: the functional all-gather is
# ``c10d::allgather_into_tensor_coalesced_`` (profiled on the CPU, torch 2.13-2.15), which gloo builds on
# all_gather_coalesced, the collective GLOO_CUDA_UNSUPPORTED above lists as having no CUDA path.
# No change in sharded lifts this skip: a DTensor of torch's own fully_shard takes the same path
# (it is not the rare CPU SIGSEGV of issue #36, where every tensor is in host memory).
# Real multi-GPU runs use NCCL, where this path does not arise.
LAYER3_OVER_GLOO_ON_CUDA = (
    "layer 3 over gloo on CUDA: torch's DTensor.full_tensor() (functional all-gather) died with SIGSEGV over gloo "
    "with CUDA tensors on the first GPU run (torch 2.11.0+cu130); on one GPU, worlds 2 and 3 need gloo"
)


class GlooDeviceUnsupported(RuntimeError):
    """A test handed gloo a tensor outside host memory for a collective that has no path for
    one (:data:`GLOO_CUDA_UNSUPPORTED`)."""


def device_type_under_test() -> str:
    """``SHARDED_TEST_DEVICE``, checked: ``"cpu"`` (the default) or ``"cuda"``."""
    chosen = os.environ.get(ENV_VAR, "cpu").strip().lower() or "cpu"
    if chosen not in DEVICE_TYPES:
        raise ValueError(f"{ENV_VAR}={chosen!r}: the tests run on one of {', '.join(DEVICE_TYPES)}")
    if chosen == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{ENV_VAR}=cuda but torch.cuda.is_available() is False on this machine (torch {torch.__version__})")
    return chosen


def device_under_test() -> torch.device:
    """The device the device-agnostic tests build their models and batches on."""
    return CUDA_DEVICE if device_type_under_test() == "cuda" else torch.device("cpu")


def backend_for(world_size: int, device_type: str = "") -> str:
    """The process-group backend a launch of ``world_size`` ranks uses on ``device_type``
    (default: the device under test): NCCL for one CUDA rank, gloo otherwise."""
    device_type = device_type or device_type_under_test()
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"no backend for device type {device_type!r}: the tests run on one of {', '.join(DEVICE_TYPES)}")
    return "nccl" if device_type == "cuda" and world_size == 1 else "gloo"


Movable = TypeVar("Movable", torch.nn.Module, torch.Tensor)


def on_test_device(thing: Movable) -> Movable:
    """``thing`` (a module, moved in place, or a tensor) on the device under test; on the CPU,
    ``thing`` itself, untouched."""
    device = device_under_test()
    return thing if device.type == "cpu" else thing.to(device)


def collective_device() -> torch.device:
    """Inside a rank: where a test's own small tensors must be for a collective over the
    default group (NCCL: the rank's GPU; gloo: the CPU, where every gloo collective works)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def skip_gloo_on_cuda(world_size: int, reason: str) -> pytest.MarkDecorator:
    """Skip a test of ``world_size`` ranks, with ``reason``, where it would run on gloo with CUDA
    tensors: a test that cannot run there, and why."""
    on_cuda = device_type_under_test() == "cuda"
    return pytest.mark.skipif(on_cuda and backend_for(world_size) == "gloo", reason=reason)


def world_sizes(*sizes: int, gloo_on_cuda: str = "") -> list[Any]:
    """``sizes`` for ``pytest.mark.parametrize("world_size", ...)``; with ``gloo_on_cuda`` (the
    reason), each marked with :func:`skip_gloo_on_cuda`."""
    if not gloo_on_cuda:
        return list(sizes)
    return [pytest.param(size, marks=skip_gloo_on_cuda(size, gloo_on_cuda)) for size in sizes]


def cpu_only(reason: str) -> pytest.MarkDecorator:
    """Mark a test (or, as ``pytestmark``, a module) that measures something only the CPU has."""
    return pytest.mark.skipif(device_type_under_test() != "cpu", reason=f"CPU only: {reason}")


# --------------------------------------------------------------------------- rank side


def enter_rank(device_type: str) -> None:
    """Make a rank agree with the launching process on the device (the forkserver's environment
    is the one it started with) and, on CUDA, use :data:`CUDA_DEVICE`."""
    os.environ[ENV_VAR] = device_type
    if device_type == "cuda":
        torch.cuda.set_device(CUDA_DEVICE)


def install_gloo_cuda_guard() -> None:
    """In a rank whose groups are gloo: make the torch.distributed functions gloo has no CUDA
    path for raise :class:`GlooDeviceUnsupported` when given a tensor that is not in host memory,
    before gloo sees it. Idempotent.

    Each is replaced in ``torch.distributed`` and in ``distributed_c10d``, where torch's own
    callers (``send_object_list``, ``P2POp``'s check of its op) look it up."""
    for name in _GUARDED:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "_gloo_cuda_guard", False):
            continue
        guarded = _guarded(name, fn)
        setattr(c10d, name, guarded)
        setattr(dist, name, guarded)


def _guarded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        off_host = [t for t in _tensors_in((args, kwargs)) if t.device.type != "cpu"]
        if off_host:
            raise GlooDeviceUnsupported(
                f"torch.distributed.{name} got a {off_host[0].device.type} tensor on gloo: "
                f"{GLOO_CUDA_UNSUPPORTED[name]} (tests/_device.py)"
            )
        return fn(*args, **kwargs)

    guarded._gloo_cuda_guard = True  # type: ignore[attr-defined]
    return guarded


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``, looking through lists, tuples, dicts and P2POp-like objects."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    if isinstance(value, dict):
        return _tensors_in(list(value.values()))
    tensor = getattr(value, "tensor", None)
    return [tensor] if isinstance(tensor, torch.Tensor) else []
