"""``FSDPModule``: the methods a module gains from ``fully_shard``, on sharded's mechanism.

It subclasses torch's ``torch.distributed.fsdp.FSDPModule``, so code that asks
``isinstance(m, FSDPModule)`` (torchtitan, pipelining, Lightning) treats our modules as FSDP2
modules; and it overrides every member of torch's class, because torch's implementations read
torch's private FSDP state, which our modules do not have. A member that cannot apply here
raises ``NotImplementedError`` naming itself. ``tests/test_fsdp2_api.py`` checks that none is
inherited.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Literal, Optional, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle

from .._common import comm
from .._common.errors import on_rank
from .._common.lowbit import StepTraffic
from ._finalization import GradientReductionHandle
from ._grad_dtypes import restore_grad_dtype, saved_grad_dtype
from ._lowbit import traffic_of
from ._state import state_of
from ._unit import Unit, unit_of, units_under

__all__ = ["FSDPModule", "GradientReductionHandle", "UnshardHandle", "register_fsdp_forward_method"]


class UnshardHandle(TorchUnshardHandle):
    """Returned by ``module.unshard(async_op=True)``: ``wait()`` finishes the all-gather (the
    module's next forward also waits for it)."""

    def __init__(self, unit: Unit) -> None:
        self._unit: Optional[Unit] = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.wait_for_unshard()
            self._unit = None


class DeepcopyRefused(AssertionError):
    """``copy.deepcopy`` of a sharded module (torch raises ``AssertionError`` too)."""


def _unsupported(member: str, why: str) -> NotImplementedError:
    return NotImplementedError(on_rank(f"FSDPModule.{member} is not supported by sharded.fully_shard: {why}"))


class FSDPModule(TorchFSDPModule):
    """Methods a module gains from ``fully_shard`` (mixed into its class, ahead of it)."""

    # [FSDP<Orig>, sharded's FSDPModule, torch's FSDPModule, Orig, ...]
    _orig_cls_mro_index: int = 3

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Constructing the class again (e.g. ``nn.Sequential`` slicing, ``type(m)(...)``) builds
        the original, unsharded class, as torch's does."""
        orig = next(c for c in cls.__mro__ if not issubclass(c, TorchFSDPModule))
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)  # type: ignore[misc]
        return self

    # ------------------------------------------------------------------ helpers

    def _fsdp_unit(self) -> Unit:
        return unit_of(self)  # type: ignore[arg-type,return-value]

    def _fsdp_units(self, recurse: bool) -> list[Unit]:
        return units_under(self) if recurse else [self._fsdp_unit()]  # type: ignore[arg-type]

    def _get_fsdp_state(self) -> Any:  # torch's helpers (register_fsdp_forward_method) call it
        return state_of(self)  # type: ignore[arg-type]

    def __deepcopy__(self, memo: Any) -> Any:
        raise DeepcopyRefused(on_rank(
            f"FSDP does not support deepcopy of {self._fsdp_unit().module_name}: "
            "its parameters are shards bound to this process group. Copy the state_dict() instead (or "
            "deepcopy the model before fully_shard)"
        ))

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``module.to(...)`` and friends: reshard first (the module then holds its shards),
        then the original class's ``_apply``; the unit repacks its shards at the next gather.
        A ``grad_dtype`` set on a shard is given to the tensor that replaces it, as torch does."""
        unit = self._fsdp_unit()
        unit.reshard()
        saved = [(sp, saved_grad_dtype(sp.held_by_module())) for sp in unit.params]
        applied = super(TorchFSDPModule, self)._apply(*args, **kwargs)  # type: ignore[misc]
        for sp, grad_dtype in saved:
            restore_grad_dtype(sp.held_by_module(), grad_dtype)
        return applied

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """For this module's units and those below: ``True`` (sharded's default) issues a unit's
        forward all-gather asynchronously, then its prefetches, and waits before the forward
        computes; ``False`` waits for the all-gather before issuing any prefetch, as torch's
        default does. The numbers are the same; only the overlap differs."""
        for unit in self._fsdp_units(recurse=True):
            unit.settings.unshard_async_op = bool(async_op)

    # ---------------------------------------------------------- gather and free

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:  # type: ignore[override]
        """All-gather this module's own unit now (e.g. to prefetch by hand); with ``async_op``
        return a handle whose ``wait()`` finishes it. Its next forward then gathers nothing."""
        unit = self._fsdp_unit()
        unit.unshard(async_op=async_op)
        return UnshardHandle(unit) if async_op else None

    def reshard(self) -> None:
        """Free this module's gathered parameters (its unit only), unless
        :meth:`set_keep_unsharded_storage` keeps their storage."""
        self._fsdp_unit().reshard()

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """``True``: resharding keeps the gathered parameters' storage, so the unsharded
        parameters keep their data pointers across reshard and the next all-gather (what CUDA
        graph capture needs), at the cost of holding every such unit's gathered parameters all
        the time (``sharded.estimate_memory(..., keep_unsharded_storage=True)`` counts them).
        ``False`` (default): freed at each reshard. ``recurse``: also the units below."""
        for unit in self._fsdp_units(recurse):
            unit.settings.keep_unsharded_storage = bool(keep)

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: wait for the collectives in flight, drop the
        failed step's unreduced gradients, free gathered parameters, return every unit to rest.
        A pending :class:`GradientReductionHandle` is invalidated (its ``wait()`` raises). Call
        it on the root (the module ``fully_shard`` was applied to last)."""
        unit, root = self._fsdp_unit(), self._get_fsdp_state().root
        if root is None:
            for u in units_under(self):  # type: ignore[arg-type]
                u.reset()
            return
        if root.unit is not unit:
            raise RuntimeError(on_rank(
                f"reset_iter_state must be called on the root module ({root.unit.module_name}), "
                f"not on {unit.module_name}"
            ))
        root.reset()

    # ------------------------------------------------------------ step settings

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """``True``: the end of each backward leaves the gradients not yet sent on this rank (as
        with sync off) and the reductions in flight, until :meth:`finalize_backward`; supersedes
        :meth:`set_is_last_backward`. For schedules whose gradient reduction is a step of its own
        (torch's pipelining calls it on every stage). While it is on, the gradient sync setting
        in force when a unit's backward is done decides for it, as in torch (pipelining turns sync
        off between a microbatch's forward and backward); otherwise the one at its forward, as
        DDP's ``no_sync``. On the root, before the backward: the mode cannot change inside a
        backward, nor after one started until it is finalized or reset."""
        unit, root = self._fsdp_unit(), self._get_fsdp_state().root
        if root is not None and root.unit is not unit:
            raise RuntimeError(on_rank(
                f"set_manual_backward_finalization must be called on the root module ({root.unit.module_name}), "
                f"not on {unit.module_name}"
            ))
        unit.context.finalization.set(enabled)

    @overload
    def finalize_backward(self, *, async_op: Literal[False] = False) -> None: ...

    @overload
    def finalize_backward(self, *, async_op: Literal[True]) -> GradientReductionHandle: ...

    @overload
    def finalize_backward(self, *, async_op: bool) -> Optional[GradientReductionHandle]: ...

    def finalize_backward(self, *, async_op: bool = False) -> Optional[GradientReductionHandle]:
        """With manual finalization, after the last backward of a logical backward (and before
        reading or clearing gradients): send the gradients each unit kept, for units whose
        gradient sync is on now, reshard the units set to reshard after backward, and wait for
        every reduction, now or, with ``async_op=True``, at the returned handle's ``wait()``
        (call it before the model's next forward). A no-op before the model's first forward;
        safe after a backward that reached no unit, or none. On the root only."""
        root = self._get_fsdp_state().root
        if root is None:
            return GradientReductionHandle() if async_op else None
        return root.finalize_backward(self._fsdp_unit(), async_op)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """``False``: the next backward may leave its newest gradient reductions in flight
        (microbatching, pipelining); they land at the latest at the end of a backward with
        ``True``, which waits for all. Shared by the whole model, as in torch."""
        self._fsdp_unit().context.is_last_backward = bool(is_last_backward)

    def set_post_optim_event(self, event: Any) -> None:
        """The root's next forward orders its all-gathers after ``event`` (recorded after the
        optimizer step). On the CPU there are no streams and nothing to order."""
        self._fsdp_unit().context.post_optim_event = event

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backward accumulates full gradients locally with no communication (gradient
        accumulation); the next backward with ``True`` reduce-scatters the sum. As with DDP's
        ``no_sync``, the setting in force at a forward decides for its backward. For hybrid
        sharding this covers the all-reduce across replicas too."""
        for unit in self._fsdp_units(recurse):
            unit.settings.requires_gradient_sync = requires_gradient_sync
            unit.settings.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Hybrid sharding: ``False`` reduce-scatters within the shard group now and keeps the
        result, deferring the all-reduce across replicas to the next backward with ``True``
        (gradients land in ``.grad`` then). No effect on a 1-D mesh."""
        units = self._fsdp_units(recurse)
        if not requires_all_reduce:
            _refuse_for_owned([u for u in units if u.mesh_info.replicate_group is not None], "set_requires_all_reduce(False)")
        for unit in units:
            unit.settings.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free gathered parameters after forward (``True``, also for the root) or keep them for
        backward (``False``)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(on_rank(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}"))
        for unit in self._fsdp_units(recurse):
            unit.settings.set_reshard_after_forward(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps parameters gathered after backward (saves the next forward's
        all-gather while accumulating gradients, at the cost of memory)."""
        for unit in self._fsdp_units(recurse):
            unit.settings.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[Any]) -> None:
        """Gather these sharded modules while this one computes its forward (replaces the
        default: the module that ran next in the previous forward)."""
        self._fsdp_unit().settings.forward_prefetch = _checked_prefetch_targets(modules)

    def set_modules_to_backward_prefetch(self, modules: list[Any]) -> None:
        """Gather these sharded modules when this one's backward starts (replaces the default:
        the module that ran before it in forward)."""
        self._fsdp_unit().settings.backward_prefetch = _checked_prefetch_targets(modules)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: backward does not gather this unit's parameters (for units whose backward
        needs none of them, e.g. an embedding whose input needs no gradient)."""
        self._fsdp_unit().settings.unshard_in_backward = unshard_in_backward

    # ---------------------------------------------------------- gradient reduction

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Sum this unit's gradients over every data-parallel rank, then divide by ``factor``
        (``1.0``: a plain sum) instead of averaging. This module's unit only, as in torch."""
        if not factor > 0:
            raise ValueError(on_rank(f"set_gradient_divide_factor needs a positive factor, got {factor!r}"))
        self._fsdp_unit().settings.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of :meth:`set_gradient_divide_factor`."""
        warnings.warn("Use `set_gradient_divide_factor` instead", FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Only ``SUM`` in the collectives: the division by the factor (default: the number of
        data-parallel ranks) happens on the reduced shard (for float16, half before)."""
        self._fsdp_unit().settings.force_sum_reduction = bool(enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Whatever this says, a parameter one rank did not use is reduce-scattered with zeros
        (ranks never disagree on the collective). ``True``: a parameter no rank used gets a zero
        ``.grad``, as in torch; ``False`` (default): it keeps ``grad = None``, as with DDP."""
        for unit in self._fsdp_units(recurse):
            unit.settings.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many units' gradient reductions (and their send buffers) may be in flight before
        the oldest is waited for: memory against overlap. The largest value any unit of a model
        asks for applies to the model."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(on_rank(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"))
        if max_input_buffers < 1:
            raise ValueError(on_rank(f"max_input_buffers must be a positive int, got {max_input_buffers}"))
        for unit in self._fsdp_units(recurse):
            unit.settings.max_reductions_in_flight = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Reduce-scatter over a process group of its own (same ranks as the shard group), so it
        can overlap all-gathers on the wire. Collective over the shard ranks, like torch's."""
        created: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for unit in self._fsdp_units(recurse):
            if not enable:
                unit.settings.reduce_scatter_group = None
                continue
            ranks = tuple(dist.get_process_group_ranks(unit.mesh_info.shard_group))
            if ranks not in created:
                created[ranks] = comm.new_group_of_this_rank([ranks], use_local_synchronization=True)
            unit.settings.reduce_scatter_group = created[ranks]

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Optional[Any] = None) -> None:
        """Call ``hook(reduced)`` on this unit's reduced gradient shard (after the all-reduce
        across replicas with hybrid sharding, else after the reduce-scatter), before it lands.

        ``stream`` (not with hybrid sharding, whose all-reduce has its own): run the hook on it,
        ordered after the reduction and before the gradient lands. On the CPU a stream orders
        nothing (``torch.cpu.Stream``), so the hook simply runs there, as in torch."""
        unit = self._fsdp_unit()
        _refuse_for_owned([unit], "set_all_reduce_hook")
        if stream is not None and unit.mesh_info.replicate_group is not None:
            raise ValueError(on_rank("stream cannot be set when using native HSDP"))
        unit.settings.all_reduce_hook = hook
        unit.settings.all_reduce_hook_stream = stream

    def set_custom_all_gather(self, comm: Any) -> None:
        """Gather this unit's parameters with ``comm`` (a ``torch.distributed.fsdp.AllGather``:
        ``allocate`` for the output buffer, then the collective). Refused for a unit whose
        ``lowbit`` policy gathers its parameters in fewer bits (the wire runs that gather)."""
        unit = self._fsdp_unit()
        _refuse_for_owned([unit], "set_custom_all_gather")
        if comm is not None and unit.settings.lowbit is not None and unit.settings.lowbit.params is not None:
            raise ValueError(on_rank(
                f"set_custom_all_gather on fully_shard({unit.module_name}): its lowbit={unit.settings.lowbit!r} "
                "gathers the parameters in low bits through its own collective; apply fully_shard with "
                "LowBit(params=None) to use a custom all-gather"
            ))
        self._fsdp_unit().settings.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce-scatter this unit's gradients with ``comm`` (a
        ``torch.distributed.fsdp.ReduceScatter``)."""
        _refuse_for_owned([self._fsdp_unit()], "set_custom_reduce_scatter")
        self._fsdp_unit().settings.custom_reduce_scatter = comm

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """``False`` is what sharded always does; ``True`` raises."""
        if enable:
            raise _unsupported("set_allocate_memory_from_process_group_for_comm", "communication "
                               "buffers come from torch's allocator (a process group's own allocator, "
                               "NCCL's zero-copy buffers, is not wired in)")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        raise _unsupported("set_symm_mem_for_comm", f"symmetric-memory ({backend}) all-gathers need "
                           "NCCL on CUDA and torch's staging buffers, which sharded does not use")

    # ------------------------------------------------------------- sharded's extras

    @property
    def lowbit_traffic(self) -> Optional[StepTraffic]:
        """The bytes this rank sent in the last step through the ``lowbit`` collectives of this
        module's unit and the units below it (``sent``, per collective) and what the same
        collectives send exact (``exact``); ``None`` when no unit has a ``lowbit`` policy, or
        before the first step ends. A step ends with the backward after which no gradient waits
        unsent (gradient accumulation's micro-batches are one step). Read-only."""
        return traffic_of(self._fsdp_units(recurse=True))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context for DDP habits: forwards inside it accumulate gradients without communication
        (``set_requires_gradient_sync(False)`` for the module's units, restored on exit)."""
        units = self._fsdp_units(recurse=True)
        previous = [(u.settings.requires_gradient_sync, u.settings.requires_all_reduce) for u in units]
        for unit in units:
            unit.settings.requires_gradient_sync = False
        try:
            yield
        finally:
            for unit, (sync, all_reduce) in zip(units, previous):
                unit.settings.requires_gradient_sync, unit.settings.requires_all_reduce = sync, all_reduce


def _refuse_for_owned(units: list[Unit], what: str) -> None:
    """``what`` acts on the reduce-scatter and all-gather of element-sharded parameters; a unit
    with owner-placed ones (``Owned``) broadcasts those from their owner and reduces onto it."""
    owned = [sp.fqn for unit in units for sp in unit.params if sp.owner is not None]
    if owned:
        raise NotImplementedError(on_rank(
            f"{what}: parameter {owned[0]} is owner-placed (sharded.fsdp.Owned): it is broadcast from its owner and "
            "its gradient reduced onto it, which this setting does not apply to; sharded refuses it for such units"
        ))


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) gather and free the module's unit as its
    ``forward`` does. A no-op for a module ``fully_shard`` was not applied to."""
    if not isinstance(module, TorchFSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(on_rank(f"{type(module)} does not have a method {method_name}"))
    original = getattr(module, method_name)
    state = module._get_fsdp_state()

    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(self, args, kwargs)
        return state._post_forward(self, args, original(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def _checked_prefetch_targets(modules: list[Any]) -> list[nn.Module]:
    missing = [type(m).__name__ for m in modules if not isinstance(m, nn.Module) or unit_of(m) is None]
    if missing:
        raise ValueError(on_rank(f"prefetch targets must be modules fully_shard was applied to; {missing[0]} is not"))
    return list(modules)
