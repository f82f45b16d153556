"""Layer 2, ZeRO-2: the module wrapper that shards gradients.

``ShardedDataParallel`` is what users put where ``DistributedDataParallel`` was. It holds the
configuration and the pieces: the parameter ownership comes from the ``OSS`` optimizers'
partitions, gradient routing from :class:`sharded._owners.grad_router.GradRouter`, buffer and model
broadcasts from :mod:`sharded._common.broadcast`. It has no collective code of its own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.utils._pytree import tree_leaves

from ._common import comm
from ._common.broadcast import PendingBroadcasts, plan_broadcasts, start_broadcasts
from ._common.checks import check_dense, check_no_sparse_grad_modules, check_same_across_ranks
from ._common.errors import on_rank
from ._common.flat import DEFAULT_BUCKET_NUMEL
from ._common.lowbit import ErrorFeedback, LowBit, StepTraffic, feed_into
from ._owners.compile_split import graph_splitter, split_bytes_for
from ._owners.grad_router import BackwardStats, GradRouter
from ._owners.join_hooks import ModelJoinHook, before_forward_under_join
from ._owners.lowbit_reduce import LowBitBuckets, lowbit_buckets_for
from ._owners.param_waits import ParamWaits
from ._owners.torch_clip import clip_owner_reduced_, register_owner_reduced
from .oss import OSS

__all__ = ["ShardedDataParallel"]

logger = logging.getLogger(__name__)


class ShardedDataParallel(nn.Module, Joinable):
    """Data parallelism with sharded gradients (ZeRO stage 2), with fairscale's interface.

    Like DDP, every rank runs forward and backward on its own batch. Unlike DDP, each gradient
    is *reduced* (not all-reduced) to the one rank whose ``OSS`` optimizer owns its parameter,
    in size-bounded buckets overlapped with the rest of backward; the other ranks release it.
    After backward the owner holds the averaged gradient, ``OSS.step()`` updates the owned
    shard and broadcasts the new values. A backward run before those gradients are zeroed (a
    second backward before the step, a loop that never zeroes, several optimizers stepping with
    closures) adds to them as on DDP: the owner sets the old average aside, the new gradient is
    reduced alone, and the owner adds the average back (see
    :mod:`sharded._owners.held_averages`).

    Ranks with different numbers of batches train under ``model.join()`` (or
    ``torch.distributed.algorithms.join.Join([model, optimizer])``), as with DDP: a rank out of
    data takes part in the others' buffer broadcasts, reduces and optimizer steps, and the
    parameters are DDP's under its ``join()`` (see :meth:`join`).

    Args:
        module: the model, identical on every rank.
        sharded_optimizer: the ``OSS`` optimizer (or a list of them over disjoint parameters)
            covering every trainable parameter of ``module``.
        process_group: the group to reduce over; must be the optimizers' group.
        broadcast_buffers: broadcast buffers (e.g. BatchNorm statistics) from rank 0 before a
            forward whose previous forward was a synced training one, as DDP does (the first
            micro-step of a :meth:`no_sync` window; the first forward of a ``no_grad`` loop).
        sync_models_at_startup: broadcast parameters and buffers from rank 0 once, now.
        reduce_buffer_size: most elements per gradient bucket; ``0`` reduces each alone.
        auto_refresh_trainable: notice ``requires_grad`` changes at the next forward and
            re-partition (see :meth:`refresh_trainable`).
        reduce_fp16: reduce fp32 gradients as fp16 (half the bytes); bf16 gradients stay bf16.
        warn_on_trainable_params_changed: log once when an automatic refresh happens.
        overlap_param_broadcast: let ``OSS.step()`` return with the new parameter values still
            on their way, and have each module wait for its own just before its next forward
            runs (or ``state_dict()`` reads it), hiding the broadcasts behind the forward.
            Parameters read any other way in between need :meth:`wait_for_params` first
            (``parameters()`` and ``named_parameters()`` of this wrapper wait by themselves),
            and so does a forward that reads another module's parameters without calling it.
        static_graph: DDP's switch, keyword-only: promise that every synced backward produces
            the same gradients (the same parameters used, each as many times, e.g. by reentrant
            activation checkpointing). The first synced backward is learned as without it; from
            then on each backward skips the small all-reduce in which ranks agree on gradients
            that arrived after their bucket left, and the owner no longer reads back which
            gradients some rank produced: one collective per step fewer, and the host syncs
            that read its result and each owned bucket's flags at the end of backward. A
            backward that breaks the promise raises ``RuntimeError`` on the rank that sees it,
            naming the parameter; as with DDP, if only some ranks change their graph, the others
            wait in their next collective until the process group's timeout. On one rank there
            is nothing to reduce and nothing is checked. :meth:`refresh_trainable` starts the
            learning again.
        lowbit: keyword-only; ``sharded.LowBit(grads=...)`` reduces the gradients in that
            format (``int8``, ``int4``, ``fp8_e4m3``, ``fp8_e5m2``) with blockwise scales, summed
            in float32 on the owner, with error feedback unless turned off (see
            ``docs/guides/lowbit.md``, "ZeRO-2"); :attr:`lowbit_traffic` gives each step's
            bytes. ``params`` is refused here (it is ``OSS``'s), and so is ``reduce_fp16``
            beside it. ``None`` (default): exact.
    """

    def __init__(
        self,
        module: nn.Module,
        sharded_optimizer: Union[OSS, Sequence[OSS]],
        process_group: Optional[dist.ProcessGroup] = None,
        broadcast_buffers: bool = True,
        sync_models_at_startup: bool = True,
        reduce_buffer_size: int = DEFAULT_BUCKET_NUMEL,
        auto_refresh_trainable: bool = True,
        reduce_fp16: bool = False,
        warn_on_trainable_params_changed: bool = True,
        overlap_param_broadcast: bool = False,
        *,
        static_graph: bool = False,
        lowbit: Optional[LowBit] = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        self._divide_by_initial_world_size = True  # Join's option (see join())
        self._clip_under_join: Optional[tuple[float, float, bool]] = None  # this rank's last iteration's
        _let_dynamo_skip_forward()
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.sharded_optimizers = _as_optimizer_list(sharded_optimizer, self.process_group)
        self.rank = comm.group_rank(self.process_group)
        self.world_size = comm.group_size(self.process_group)
        self.broadcast_buffers = broadcast_buffers
        self.reduce_buffer_size = reduce_buffer_size
        self.auto_refresh_trainable = auto_refresh_trainable
        self.reduce_fp16 = reduce_fp16
        self.warn_on_trainable_params_changed = warn_on_trainable_params_changed
        self.static_graph = static_graph
        self.lowbit = lowbit
        self._lowbit = lowbit_buckets_for(lowbit, reduce_fp16, self.process_group, {p: n for n, p in module.named_parameters()})
        if self._lowbit is not None:
            for optimizer in self.sharded_optimizers:  # the scaler drops a skipped step's residuals
                feed_into(optimizer, self._lowbit.wire.feedback)
        self._warned_trainability_change = False
        # bytes of parameters per graph when Dynamo compiles the module (see forward)
        self._split_bytes = split_bytes_for(reduce_buffer_size, list(module.parameters()))
        # DDP's switch: False makes the next forward's backward accumulate locally (no_sync).
        self.require_backward_grad_sync = True
        self._sync_buffers_at_next_forward = True  # DDP's require_forward_param_sync

        check_dense(((f"parameter {n}", p) for n, p in module.named_parameters()), "ShardedDataParallel", self.rank)
        check_no_sparse_grad_modules(module.named_modules(), "ShardedDataParallel", self.rank)
        check_same_across_ranks(
            list(module.named_parameters()) + list(module.named_buffers()),
            self.process_group,
            "ShardedDataParallel module parameters and buffers",
        )
        if sync_models_at_startup:
            self._start_broadcast_from(0, list(module.parameters()) + list(module.buffers())).wait()
        self._router = self._build_router()
        self._trainability = self._current_trainability()
        self._param_waits = ParamWaits(module, [o.broadcaster for o in self.sharded_optimizers]) if overlap_param_broadcast else None
        register_owner_reduced(self)  # torch's clip_grad_norm_ over these parameters takes the global norm

    # --------------------------------------------------------------------------- forward

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Refresh after ``requires_grad`` changes, sync buffers, run the wrapped module.

        Dynamo never traces this method itself (as it never traces DDP's; see
        :func:`_let_dynamo_skip_forward`): under
        ``torch.compile`` of the wrapper or of the module, only the module is compiled, split
        into bucket-sized graphs so that reduces overlap the compiled backward (see
        :mod:`sharded._owners.compile_split`).
        """
        if self.auto_refresh_trainable and self._trainability_changed():
            self._warn_trainability_changed_once()
            self.refresh_trainable()
        if self._join_config.enable:
            before_forward_under_join(self)  # syncs the buffers from a rank that still trains
        elif self.broadcast_buffers and self._sync_buffers_at_next_forward:
            self.sync_buffers(blocking=True)
        self._router.before_forward()
        if self._param_waits is not None:
            self._param_waits.before_forward()
        # As with DDP, the forward decides whether its backward reduces: a forward run inside
        # no_sync() accumulates even if backward is called after the context has closed.
        self._router.sync_enabled = self.require_backward_grad_sync
        with graph_splitter()(self._split_bytes):
            outputs = self.module(*inputs, **kwargs)
        self._sync_buffers_at_next_forward = self.require_backward_grad_sync and torch.is_grad_enabled()
        if self._sync_buffers_at_next_forward:
            self._mark_backward_start_on(outputs)
        return outputs

    def wait_for_params(self) -> None:
        """Complete the parameter broadcasts the last step left in flight (with
        ``overlap_param_broadcast``; a no-op otherwise). Local, not collective."""
        for optimizer in self.sharded_optimizers:
            optimizer.wait_for_params()

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """As ``nn.Module``'s, after the parameters' latest values have arrived."""
        self.wait_for_params()
        return super().named_parameters(*args, **kwargs)

    def _mark_backward_start_on(self, outputs: Any) -> None:
        """Hook the outputs, so the end-of-backward flush attaches to the backward through them."""
        on_output_grad = self._router.on_output_grad
        for leaf in tree_leaves(outputs):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(lambda grad: on_output_grad())

    def __getattr__(self, name: str) -> Any:
        """Attributes not found on the wrapper come from the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    # -------------------------------------------------------------------- gradient control

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication at all, for forwards run inside.

        As with DDP's ``no_sync``, the backward of a forward run inside accumulates (wherever
        ``backward()`` is called); the first synced backward after it reduces the sums.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def reduce(self) -> None:
        """Reduce the gradients the parameters hold now to their owners. Collective.

        Only needed when gradients were produced without the automatic reduction, e.g. after
        backward passes that all ran inside :meth:`no_sync`.
        """
        self._router.reduce_current_grads()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the module's gradients by their global norm; return that norm. Collective.

        After a sharded backward each rank holds only its own gradients (the others are
        ``None``); here each rank's share counts once and the result equals torch's function on
        DDP. ``torch.nn.utils.clip_grad_norm_`` over this wrapper's parameters is routed here too
        (see :mod:`sharded._owners.torch_clip`).
        """
        self.remember_clip_for_join(max_norm, norm_type, error_if_nonfinite)
        params = list(self.module.parameters())
        return clip_owner_reduced_(
            params, self.param_to_rank, self.process_group, self.rank, max_norm, norm_type, error_if_nonfinite
        )

    def remember_clip_for_join(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> None:
        """Under :meth:`join`, a rank out of data clips as this iteration does (torch's routed
        ``clip_grad_norm_`` calls this too)."""
        if self._join_config.enable:
            self._clip_under_join = (max_norm, norm_type, error_if_nonfinite)

    @property
    def param_to_rank(self) -> dict[torch.Tensor, int]:
        """Parameter -> the rank its gradient is reduced to, which owns it (over every optimizer)."""
        owner_of: dict[torch.Tensor, int] = {}
        for optimizer in self.sharded_optimizers:
            owner_of.update(optimizer.param_to_rank)
        return owner_of

    @property
    def lowbit_traffic(self) -> Optional[StepTraffic]:
        """The bytes this rank sent in the last synced backward's reduces (or explicit
        :meth:`reduce`) and what the exact reduces would have sent; ``None`` without ``lowbit``
        or before the first. On one rank nothing is reduced, so it stays ``None``."""
        return self._lowbit.last_traffic if self._lowbit is not None else None

    @property
    def lowbit_residuals(self) -> ErrorFeedback:
        """This rank's error-feedback residuals, by bucket message (what ``sharded.checkpoint``
        saves); raises without ``lowbit``."""
        if self._lowbit is None:
            raise ValueError(on_rank("ShardedDataParallel has no low-bit residuals without lowbit=LowBit(grads=...)", self.rank))
        return self._lowbit.wire.feedback

    @property
    def lowbit_buckets(self) -> Optional[LowBitBuckets]:
        """How the buckets travel in low bits (their residuals by message and by parameter,
        which ``sharded.checkpoint`` saves and reshards); ``None`` without ``lowbit``."""
        return self._lowbit

    @property
    def backward_stats(self) -> Optional[BackwardStats]:
        """How the last synced backward's reduction overlapped it (None before the first)."""
        return self._router.last_backward

    # ------------------------------------------------------------------- uneven inputs

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """A context for ranks with different numbers of batches, as DDP's ``join()``: this
        model and its optimizers in one ``torch.distributed.algorithms.join.Join``.

        A rank that has run out of batches runs, for each iteration the others still run, their
        forward's collectives, their backward's reduces (contributing zeros) and their optimizer
        steps, with the gradients it owns; when all are done, every rank takes the buffers of the
        last to finish. Each iteration of the loop must be one forward, one backward and one step
        of each optimizer, in the order they were given here (or a forward and backward inside
        :meth:`no_sync`, without a step), with or without a :meth:`clip_grad_norm_` between
        backward and step: a rank out of data clips as its own last iteration did (the global
        norm needs the gradients it owns), so every iteration must clip alike. Other collectives
        (:meth:`reduce`, ``OSS.clip_grad_norm``, a gradient scaler's inf check, a change of
        ``requires_grad``) are not shadowed: keep them out of a loop with uneven inputs.

        Args:
            divide_by_initial_world_size: divide gradients by the world size, the joined ranks
                contributing zeros (DDP's default), or by the number of ranks still training.
            enable: False turns the context off (every rank must then have the same batches).
            throw_on_early_termination: raise on every rank as soon as one runs out of data.
        """
        return Join(
            [self, *self.sharded_optimizers],
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook ``Join`` runs on a rank out of data (see :meth:`join`); it reads
        ``divide_by_initial_world_size`` (default True) from the keyword arguments. Refused with
        ``lowbit`` (a joined rank's shadow reduces would send its residuals into the others'
        sums; not supported)."""
        if self._lowbit is not None:
            raise ValueError(on_rank("ShardedDataParallel(lowbit=...) under Join: uneven inputs are not supported "
                                     "with low-bit gradients; pass lowbit=None or give every rank the same batches", self.rank))
        return ModelJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """Where ``Join``'s own flags live: the process group's device for small tensors."""
        return comm.comm_device(self.process_group)

    @property
    def join_process_group(self) -> Any:
        """The group ``Join`` counts the ranks still training over."""
        return self.process_group

    # ------------------------------------------------------------------ DDP's attributes

    @property
    def device_type(self) -> str:
        """The device type of the module's parameters, as DDP reports it."""
        return next(self.module.parameters()).device.type

    @property
    def is_multi_device_module(self) -> bool:
        """Whether the module's parameters live on more than one device, as DDP reports it."""
        return len({p.device for p in self.module.parameters()}) > 1

    @property
    def device_ids(self) -> Optional[list[int]]:
        """As DDP: the one accelerator device of a single-device module, else ``None``."""
        if self.device_type == "cpu" or self.is_multi_device_module:
            return None
        return [next(self.module.parameters()).device.index]

    @property
    def output_device(self) -> Optional[int]:
        """As DDP: where outputs are gathered, i.e. ``device_ids[0]``, or ``None``."""
        ids = self.device_ids
        return ids[0] if ids else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or release) the gradients of the wrapped module's parameters."""
        self.module.zero_grad(set_to_none=set_to_none)

    def refresh_trainable(self) -> None:
        """Re-partition and rebuild buckets and hooks after ``requires_grad`` changed. Collective.

        All ranks must change the same parameters; the optimizers move state to the new owners.
        """
        for optimizer in self.sharded_optimizers:
            optimizer.refresh_trainable()
        self._router.remove_hooks()
        old, self._router = self._router, self._build_router()
        self._router.carry_held_from(old)
        if self._lowbit is not None:
            self._lowbit.keep_only(self._router.buckets)  # a rebuilt bucket starts without a residual
        self._trainability = self._current_trainability()

    def remove_hooks(self) -> None:
        """Take this wrapper's hooks off the module and its parameters; the wrapper is done.

        The gradient hooks live on the parameters and hold the wrapper's router only weakly:
        they come off when the wrapper is freed. Call this when done with a wrapper whose module
        lives on (to be trained again, or wrapped anew, as Lightning does after each ``fit``), so
        that they come off at once, whoever still refers to the wrapper; with
        ``overlap_param_broadcast`` it also takes off the modules' waits for broadcasts, which
        only this call removes.
        """
        self._router.remove_hooks()
        if self._param_waits is not None:
            self._param_waits.remove()
            self._param_waits = None

    # --------------------------------------------------------------------- buffers, device

    def sync_buffers(self, blocking: bool = False) -> Optional[PendingBroadcasts]:
        """Broadcast the module's buffers from rank 0. Collective.

        Returns the broadcasts in flight when ``blocking`` is False; call ``wait()`` on them
        before the buffers are read.
        """
        pending = self._start_broadcast_from(0, list(self.module.buffers()))
        if not blocking:
            return pending
        pending.wait()
        return None

    def _sync_buffers_from(self, src: int) -> None:
        """Broadcast the module's buffers from rank ``src`` and wait. Collective."""
        self._start_broadcast_from(src, list(self.module.buffers())).wait()

    def to(  # type: ignore[override]
        self,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
        non_blocking: bool = False,
    ) -> ShardedDataParallel:
        """Move or cast the wrapped module, then rebuild buckets for the new device or dtype."""
        self.wait_for_params()  # cast the new values, not the ones a broadcast is replacing
        self.module.to(device=device, dtype=dtype, non_blocking=non_blocking)
        self.refresh_trainable()
        return self

    # -------------------------------------------------------------------------- internals

    def _build_router(self) -> GradRouter:
        trainable = self._trainable_params_covered_by_optimizers()
        return GradRouter(
            list(reversed(trainable)),  # first guess of the ready order; re-planned after one backward
            self.param_to_rank,
            self.process_group,
            self.reduce_buffer_size,
            self.reduce_fp16,
            names={p: n for n, p in self.module.named_parameters()},
            static_graph=self.static_graph,
            lowbit=self._lowbit,
        )

    def _trainable_params_covered_by_optimizers(self) -> list[torch.Tensor]:
        """The trainable parameters; raise naming any that no optimizer holds."""
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                on_rank(
                    "the module has no trainable parameters; "
                    "ShardedDataParallel has nothing to reduce",
                    self.rank,
                )
            )
        held = {p for optimizer in self.sharded_optimizers for p in optimizer.partition.params}
        missing = [n for n, p in named if p not in held]
        if missing:
            raise ValueError(
                on_rank(
                    f"{len(missing)} trainable parameter(s) are in no sharded "
                    f"optimizer: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. Pass "
                    "every trainable parameter to an OSS optimizer, or freeze it",
                    self.rank,
                )
            )
        return [p for _, p in named]

    def _current_trainability(self) -> tuple[tuple[int, bool], ...]:
        """Which parameters the module holds and whether each trains: a parameter added or
        replaced after wrapping is a change too, so the refresh names it if no optimizer has it.
        (Identities are safe to compare: the optimizers keep the old parameters alive.)"""
        return tuple((id(p), p.requires_grad) for p in self.module.parameters())

    def _trainability_changed(self) -> bool:
        return self._trainability != self._current_trainability()

    def _warn_trainability_changed_once(self) -> None:
        if self.warn_on_trainable_params_changed and not self._warned_trainability_change:
            logger.warning(
                "ShardedDataParallel: requires_grad changed on some parameters; re-partitioning "
                "and rebuilding buckets (silence with warn_on_trainable_params_changed=False)"
            )
            self._warned_trainability_change = True

    def _start_broadcast_from(self, src: int, tensors: list[torch.Tensor]) -> PendingBroadcasts:
        by_src: list[list[torch.Tensor]] = [[] for _ in range(src)] + [tensors]
        return start_broadcasts(plan_broadcasts(by_src, self.reduce_buffer_size), self.process_group)


@functools.cache
def _let_dynamo_skip_forward() -> None:
    """``@torch.compiler.disable(recursive=False)`` on :meth:`ShardedDataParallel.forward`, applied
    when the first wrapper is built rather than at import: the decorator imports Dynamo (and with
    it DTensor and torch's FSDP, seconds of start-up) that ``import sharded`` must not pay for."""
    ShardedDataParallel.forward = torch.compiler.disable(  # type: ignore[method-assign]
        ShardedDataParallel.forward, recursive=False
    )


def _as_optimizer_list(
    sharded_optimizer: Union[OSS, Sequence[OSS]], group: Optional[dist.ProcessGroup]
) -> list[OSS]:
    optimizers: list = list(sharded_optimizer) if isinstance(sharded_optimizer, (list, tuple)) else [sharded_optimizer]
    if not optimizers:
        raise ValueError("ShardedDataParallel needs at least one OSS optimizer")
    for i, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, OSS):
            raise TypeError(
                f"sharded_optimizer[{i}] is a {type(optimizer).__name__}; ShardedDataParallel "
                "needs sharded.OSS optimizers (use DistributedDataParallel for plain ones)"
            )
        if dist.get_process_group_ranks(optimizer.group) != dist.get_process_group_ranks(group):
            raise ValueError(
                f"sharded_optimizer[{i}] shards over ranks {dist.get_process_group_ranks(optimizer.group)} "
                f"but ShardedDataParallel reduces over {dist.get_process_group_ranks(group)}; "
                "pass the same process group to both"
            )
    return optimizers
