"""Trials on tensors that hold no memory, counting the bytes real ones would hold.

:class:`LiveBytes` is a dispatch mode that adds up the storages every operation creates and
takes them off again when they are freed, keeping the high-water mark: run an optimizer step on
meta tensors under it and the peak is the step's temporaries, with no memory spent.
:func:`optimizer_trial` makes an optimizer's state that way (the state's size comes from the
optimizer itself, so SGD, Adam and factored optimizers are all right); :func:`activation_trial`
runs a forward and backward of a model copy on fake tensors of the model's compute device and
profiles the bytes alive between one gradient completing and the next, so each stage can add
what it holds of the gradients at every point of the backward (:class:`ActivationProfile`).
"""

from __future__ import annotations

import copy
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .._common.optimizers import constructor_kwargs

__all__ = ["LiveBytes", "OptimizerTrial", "optimizer_trial", "ActivationProfile", "activation_trial"]

# Distinct primes for the dimensions of a probe parameter: a state tensor's shape then tells
# which of the parameter's dimensions it kept (see _probe_state).
_PROBE_DIMS = (7, 11, 13, 17, 19, 23)


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages created under it that are still alive; ``peak`` is the
    most at once, ``stretch_peak`` the most since the last :meth:`new_stretch`. Storages that
    existed before (parameters, views of them) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.stretch_peak = 0
        self._seen: set[int] = set()

    def new_stretch(self) -> int:
        """End the current stretch: return its peak and start the next one from what is alive."""
        ended, self.stretch_peak = self.stretch_peak, self.live
        return ended

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t, inputs)
        return out

    def _count(self, t: torch.Tensor, inputs: set[int]) -> None:
        """Count ``t``'s storage if the operation made it (not an in-place result or a view)."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._seen or key in inputs:
            return
        nbytes = storage.nbytes()
        self._seen.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.stretch_peak = max(self.stretch_peak, self.live)
        weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


@dataclass(frozen=True)
class OptimizerTrial:
    """Bytes of optimizer state (kept) and of the step's temporaries (freed), for some parameters."""

    state_bytes: int
    step_bytes: int


def optimizer_trial(
    optimizer: type, kwargs: dict[str, Any], shapes: Sequence[tuple[torch.Size, torch.dtype]]
) -> OptimizerTrial:
    """Build ``optimizer`` over meta parameters of ``shapes``, step it with zero gradients and
    measure its state and the step's temporaries.

    An optimizer that reads a value on the host during its step (``.item()``, as Adafactor
    and ASGD do) cannot step meta tensors. Its state is then measured on small real probes,
    one per distinct shape, whose dimensions are distinct primes, and scaled up: every state
    tensor's dimensions are mapped back to the parameter's by their size. That is right for
    state made of the parameter's own dimensions (whole, factored or scalar); the temporaries
    are scaled by the element ratio.
    """
    kwargs = constructor_kwargs(optimizer, kwargs)
    params = [nn.Parameter(torch.empty(shape, dtype=dtype, device="meta")) for shape, dtype in shapes]
    if not params:
        return OptimizerTrial(0, 0)
    try:
        return _meta_step(optimizer, kwargs, params)
    except (RuntimeError, NotImplementedError):
        return _probe_steps(optimizer, kwargs, shapes)


def _meta_step(optimizer: type, kwargs: dict[str, Any], params: list[nn.Parameter]) -> OptimizerTrial:
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = optimizer(params, **kwargs)
    with LiveBytes() as counter:
        opt.step()
    state = _state_bytes(opt)
    return OptimizerTrial(state, max(0, counter.peak - _meta_state_bytes(opt)))


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_nbytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def _meta_state_bytes(opt: torch.optim.Optimizer) -> int:
    """State bytes the counter saw being created (the meta ones; host scalars it did not)."""
    return sum(_nbytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.is_meta)


def _probe_steps(optimizer: type, kwargs: dict[str, Any], shapes: Sequence[tuple[torch.Size, torch.dtype]]) -> OptimizerTrial:
    state, step = 0, 0
    measured: dict[tuple, tuple[int, int]] = {}
    for shape, dtype in shapes:
        key = (tuple(shape), dtype)
        if key not in measured:
            measured[key] = _probe_state(optimizer, kwargs, torch.Size(shape), dtype)
        state += measured[key][0]
        step = max(step, measured[key][1])
    return OptimizerTrial(state, step)


def _probe_state(optimizer: type, kwargs: dict[str, Any], shape: torch.Size, dtype: torch.dtype) -> tuple[int, int]:
    probe_shape = _PROBE_DIMS[: len(shape)]
    probe = nn.Parameter(torch.zeros(probe_shape, dtype=dtype))
    probe.grad = torch.zeros_like(probe)
    opt = optimizer([probe], **kwargs)
    opt.step()
    size_of = dict(zip(probe_shape, shape))
    state = 0
    for value in opt.state[probe].values():
        if isinstance(value, torch.Tensor):
            state += math.prod(size_of.get(d, d) for d in value.shape) * value.element_size()
    scale = math.prod(shape) / max(1, math.prod(probe_shape))
    return state, int(2 * probe.numel() * probe.element_size() * scale)  # two parameter-sized temporaries


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class ActivationProfile:
    """The bytes a trial forward and backward creates, with every parameter's gradient dropped
    as soon as it is complete, so the stages can add back what each of them keeps.

    ``ready_order``: indexes into ``model.parameters()``, in the order their gradients completed.
    ``stretch_peaks[k]``: the most bytes alive while exactly ``k`` gradients were complete (the
    forward is in stretch 0; the gradient being computed counts in its stretch).
    ``live_at_ready[k]``: bytes alive as the ``k``-th gradient (from 0) completed, itself included.
    """

    ready_order: tuple[int, ...]
    stretch_peaks: tuple[int, ...]
    live_at_ready: tuple[int, ...]

    @property
    def peak(self) -> int:
        """The activations' high-water mark: the most alive at once with no gradient kept."""
        return max(self.stretch_peaks)


def activation_trial(
    model: nn.Module,
    example_input: Any,
    loss_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]],
    device: torch.device,
) -> ActivationProfile:
    """Profile a forward and backward of ``model`` on ``example_input``, on fake tensors of
    ``device`` (so the device's own kernels are chosen, e.g. its attention)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    trial = copy.deepcopy(model)
    order: list[int] = []
    stretches: list[int] = []
    at_ready: list[int] = []
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        trial.to_empty(device=device)
        index = {id(p): i for i, p in enumerate(trial.parameters())}
        inputs = [fake.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in _as_args(example_input)]
        with LiveBytes() as counter:

            def on_ready(p: torch.Tensor) -> None:
                order.append(index[id(p)])
                at_ready.append(counter.live)
                p.grad = None  # the stage decides what it keeps
                stretches.append(counter.new_stretch())

            handles = [p.register_post_accumulate_grad_hook(on_ready) for p in trial.parameters() if p.requires_grad]
            loss = loss_fn(trial, *inputs) if loss_fn is not None else _default_loss(trial, inputs)
            loss.backward()
            stretches.append(counter.new_stretch())
    for handle in handles:
        handle.remove()
    return ActivationProfile(tuple(order), tuple(stretches), tuple(at_ready))


def _as_args(example_input: Any) -> list[Any]:
    return list(example_input) if isinstance(example_input, (tuple, list)) else [example_input]


def _default_loss(model: nn.Module, inputs: list[Any]) -> torch.Tensor:
    out = model(*inputs)
    leaves = [t.float().sum() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    return torch.stack(leaves).sum()
