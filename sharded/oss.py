"""Layer 1, ZeRO-1: optimizer state sharding.

Every rank computes gradients for the whole model (with DDP or ShardedDataParallel), but keeps
optimizer state only for the parameters it owns: with Adam that is two copies of the model fewer
per rank, spread evenly. ``step()`` updates the owned shard with the user's optimizer, then the
owners broadcast the new values so all replicas stay identical.
"""

from __future__ import annotations

import inspect
import logging
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from ._common import comm
from ._common.checks import as_param_groups, check_optimizer_class, check_param_list, check_same_across_ranks, param_list
from ._common.errors import on_rank
from ._common.flat import DEFAULT_BUCKET_NUMEL
from ._common.lowbit import LowBit, StepTraffic
from ._common.norm import clip_by_global_norm
from ._common.optimizers import hyperparams
from ._owners.broadcaster import ParamBroadcaster
from ._owners.ddp_overlap import PARTITION_CHANGED_UNDER_HOOK, TORCH_HOOKS_REFUSED, BucketSteps, step_only
from ._owners.join_hooks import OptimizerJoinHook
from ._owners.lowbit_params import MASTER_KEY, LowBitParams, refuse_unsupported
from ._owners.optim_state import consolidated_state_dict, restore_state, snapshot_shard, states_by_param
from ._owners.partition import Balance, Partition
from ._owners.step_cost import ParamCost, bytes_cost, default_param_cost, param_costs

__all__ = ["OSS", "Balance", "imbalance"]

logger = logging.getLogger(__name__)

IMBALANCE_WARNING = 1.25  # busiest rank's trainable bytes (or step cost) over an even share


def imbalance(partition: Partition) -> float:
    """The largest rank's trainable bytes over an even share (1.0: perfectly even)."""
    return partition.balance().bytes


class OSS(Optimizer, Joinable):
    """Wraps any ``torch.optim.Optimizer`` class so that each rank keeps only its shard of
    the optimizer state (ZeRO stage 1), with fairscale's ``OSS`` interface.

    The parameters are split into per-rank partitions, balanced by their step cost (costliest
    first onto the least-loaded rank; frozen parameters are balanced apart so they never skew
    it). The cost is a parameter's bytes, which both an element-wise optimizer's state and its
    step time scale with, unless ``param_cost`` says otherwise; for ``torch.optim.Muon`` it is
    the Newton-Schulz cost of each matrix (:func:`sharded.newton_schulz_cost`), so that the
    ranks share the orthogonalisations evenly. Each parameter is stepped whole by its owner, so
    optimizers that need whole matrices (Muon, Adafactor's factored moments, one's own) give
    DDP's results. Each rank builds the wrapped optimizer over its own partition only, so
    optimizer state memory per rank is about ``1 / world_size`` of the total (:attr:`balance`
    says how close the busiest rank is to an even share). As with any torch optimizer, a
    parameter is stepped iff it has a gradient, whatever its ``requires_grad`` (a frozen
    parameter whose gradient was zeroed with ``set_to_none=False`` still moves under momentum or
    weight decay); parameters that cannot have one, such as integer tables, are carried along
    and never stepped.

    After every ``step()`` the owners broadcast the updated parameters in flat buckets. By
    default the trainable parameters live in those buckets (their ``.data`` is a view of one), so
    nothing is copied to send or receive them; a tensor taken from ``param.data`` before ``OSS``
    was built is then a stale copy. ``parameters_as_bucket_view=False`` leaves each parameter's
    storage where it is (``p.data_ptr()`` never changes), at the price of packing each bucket
    into a message and unpacking it at every step. Frozen parameters that were stepped travel in extra buckets, agreed on with
    one small all-reduce per step that only models with frozen parameters pay.

    ``OSS`` is itself a ``torch.optim.Optimizer``: ``param_groups`` lists every parameter and is
    kept in sync with the wrapped optimizer in both directions, so lr schedulers, gradient
    scalers and code that edits hyperparameters work unchanged. ``state_dict()`` returns the
    standard torch format after :meth:`consolidate_state_dict`, loadable by a plain optimizer.

    ``OSS`` is a ``torch.distributed.algorithms.join.Joinable``, as torch's
    ``ZeroRedundancyOptimizer`` is: under ``Join([model, optimizer])`` a rank that ran out of
    data still steps its shard and sends its broadcasts while the others train (see
    :mod:`sharded._owners.join_hooks`).

    Args:
        params: an iterable of tensors or of param-group dicts, as for any torch optimizer.
        optim: the optimizer class to shard, e.g. ``torch.optim.AdamW``.
        group: the process group to shard over (default: the whole world).
        broadcast_buffer_size: parameters are packed into broadcast buckets of at most this
            many elements; larger parameters are sent alone, uncopied.
        broadcast_fp16: send floating-point parameters wider than fp16 as fp16 (half the bytes;
            non-owners see values rounded to fp16, owners keep the exact ones).
        force_broadcast_object: accepted for fairscale compatibility and has no effect: state
            always travels as tensors here.
        param_cost: keyword-only: the cost of stepping a parameter, a finite number >= 0 that
            the partition balances across ranks, e.g. ``lambda p: sharded.newton_schulz_cost(p.shape)``.
            It must give every rank the same numbers (compute it from shapes, not values).
            Default: Newton-Schulz cost if ``optim`` is (a subclass of) ``torch.optim.Muon``,
            else the parameter's bytes.
        overlap_with_ddp: keyword-only: step each DDP bucket's owned parameters during the
            backward, as soon as that bucket's all-reduce has finished, and send them while the
            backward goes on (torch's ``ZeroRedundancyOptimizer`` option). Register the hook that
            drives it on the DDP model: ``ddp.register_comm_hook(None,
            sharded.hook_with_zero_step(allreduce_hook, ddp, optimizer))``. ``step()`` then steps
            only what no bucket held (frozen parameters with a gradient) and returns; without a
            hook, or after a backward under ``no_sync()``, it is the usual step. Results are those
            of DDP with the same hook and the plain optimizer from the first step on. The wrapped
            optimizer must step each parameter on its own (torch's optimizers but LBFGS do), and
            clipping or gradient scaling cannot run between the backward and this step.
        parameters_as_bucket_view: keyword-only: ``True`` (fairscale's behaviour) makes the
            trainable parameters views of the broadcast buckets; ``False`` (torch
            ``ZeroRedundancyOptimizer``'s default) leaves their storage alone, and each step
            holds a packed copy of every bucket of several parameters while the broadcasts
            are in flight (``sharded.estimate_memory(..., parameters_as_bucket_view=False)``).
        lowbit: keyword-only: a :class:`sharded.LowBit` whose ``params`` format (``"int8"``,
            ``"fp8_e4m3"``, ``"fp8_e5m2"``) the updated parameters travel in. Each owner keeps an
            exact master of the parameters it owns (its partition once more in memory) and
            sends the change of each bucket, ``encode(master - replica)``; every rank, the
            owner too, adds the decoded change to the parameters it computes with, so all
            ranks hold the same values, within one rounding of one step's change of the
            masters: ``|replica - master| <= error_bound(master - previous replica)``.
            :attr:`lowbit_traffic` gives the bytes of the last step. ``LowBit(grads=...)`` is
            refused (gradients are reduced by DDP or ``ShardedDataParallel(lowbit=)``), as are
            ``broadcast_fp16=True`` and ``overlap_with_ddp=True`` beside it.
        **defaults: hyperparameters for ``optim`` (``lr``, ``momentum``, ...).
    """

    _partition: Partition  # set once Optimizer.__init__ has added the initial groups
    # consolidate_state_dict's argument, as errors name it (torch's ZeroRedundancyOptimizer: "to")
    _recipient_argument = "recipient_rank"

    def __init__(
        self,
        params: Union[Iterable[torch.Tensor], Iterable[dict[str, Any]]],
        optim: type[Optimizer] = torch.optim.SGD,
        group: Optional[dist.ProcessGroup] = None,
        broadcast_buffer_size: int = DEFAULT_BUCKET_NUMEL,
        broadcast_fp16: bool = False,
        force_broadcast_object: bool = False,
        *,
        param_cost: Optional[ParamCost] = None,
        overlap_with_ddp: bool = False,
        parameters_as_bucket_view: bool = True,
        lowbit: Optional[LowBit] = None,
        **defaults: Any,
    ) -> None:
        check_optimizer_class(optim)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "OSS needs torch.distributed: call torch.distributed.init_process_group() first"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.rank = comm.group_rank(self.group)
        self.world_size = comm.group_size(self.group)
        self.global_rank = comm.global_rank(self.group, self.rank)
        refuse_unsupported(lowbit, self.rank, broadcast_fp16=broadcast_fp16, overlap_with_ddp=overlap_with_ddp)
        self._lowbit = LowBitParams(lowbit, self.group) if lowbit is not None else None
        # The owners' broadcasts after each step (ShardedDataParallel's overlap waits on them).
        self.broadcaster = ParamBroadcaster(
            self.group, broadcast_buffer_size, broadcast_fp16, resident=bool(parameters_as_bucket_view), lowbit=self._lowbit
        )
        self.force_broadcast_object = force_broadcast_object
        self._consolidated: Optional[dict[int, Any]] = None  # global index -> state, on recipients
        self._warned_trainability_change = False
        if param_cost is not None and not callable(param_cost):
            raise TypeError(on_rank(f"param_cost must be a function of a parameter, got {param_cost!r:.80}", self.rank))
        # What the partition balances (see the class docstring); also used by add_param_group.
        self.param_cost: ParamCost = param_cost if param_cost is not None else default_param_cost(optim)
        # The steps a DDP comm hook runs bucket by bucket (sharded.hook_with_zero_step), if asked.
        self._bucket_steps = self._bucket_steps_for() if overlap_with_ddp else None

        # Optimizer's own constructor, named: a subclass may list another optimizer class after
        # OSS (sharded.ZeroRedundancyOptimizer derives from torch's too), whose __init__ must not run.
        Optimizer.__init__(self, as_param_groups(params, self.rank), defaults)
        Joinable.__init__(self)
        self._check_same_params_on_all_ranks()
        partition = self._build_partition()
        owned = partition.owned_by_group(self.rank)
        self.optim = optim(
            [{**hyperparams(g), "params": mine} for g, mine in zip(self.param_groups, owned)],
            **defaults,
        )
        self.state = self.optim.state
        self._inner_step_takes_closure = "closure" in inspect.signature(self.optim.step).parameters
        self._install(partition)
        self._pull_hyperparams()

    # ------------------------------------------------------------------ partition views

    @property
    def partition(self) -> Partition:
        """The current assignment of parameters to ranks (read-only)."""
        return self._partition

    @property
    def balance(self) -> Balance:
        """How far the busiest rank is from an even share, of the trainable parameters' bytes
        (optimizer state) and of their step cost (see ``param_cost``): each the busiest rank's
        share times ``world_size``, 1.00 being even."""
        return self._partition.balance()

    def partition_parameters(self) -> list[list[dict[str, Any]]]:
        """For each rank, the param groups its optimizer steps (groups may be empty)."""
        return [
            [
                {**hyperparams(group), "params": mine}
                for group, mine in zip(self.param_groups, self._partition.owned_by_group(rank))
            ]
            for rank in range(self.world_size)
        ]

    @property
    def param_to_rank(self) -> dict[torch.Tensor, int]:
        """Parameter -> the rank that owns it (and keeps its optimizer state)."""
        return self._partition.owner_of()

    @property
    def per_device_params(self) -> dict[torch.device, list[list[torch.Tensor]]]:
        """Device -> for each rank, the parameters it owns on that device."""
        by_device: dict[torch.device, list[list[torch.Tensor]]] = defaultdict(
            lambda: [[] for _ in range(self.world_size)]
        )
        for p, owner in zip(self._partition.params, self._partition.owners):
            by_device[p.device][owner].append(p)
        return dict(by_device)

    # ----------------------------------------------------------------------- broadcasts

    @property
    def broadcast_buffer_size(self) -> int:
        """The most elements one broadcast bucket holds (fairscale's option, settable)."""
        return self.broadcaster.bucket_numel

    @broadcast_buffer_size.setter
    def broadcast_buffer_size(self, numel: int) -> None:
        self.broadcaster.bucket_numel = numel

    @property
    def parameters_as_bucket_view(self) -> bool:
        """Whether the trainable parameters are views of the broadcast buckets (settable: the
        buckets are planned again, and parameters leaving them get storage of their own)."""
        return self.broadcaster.resident

    @parameters_as_bucket_view.setter
    def parameters_as_bucket_view(self, enabled: bool) -> None:
        self.broadcaster.resident = bool(enabled)
        self.broadcaster.plan(self._partition)

    @property
    def broadcast_fp16(self) -> bool:
        """Whether parameters travel as fp16 (fairscale's option, settable)."""
        return self.broadcaster.wire_fp16

    @broadcast_fp16.setter
    def broadcast_fp16(self, enabled: bool) -> None:
        refuse_unsupported(self.lowbit, self.rank, broadcast_fp16=enabled)
        self.broadcaster.wire_fp16 = enabled

    @property
    def lowbit(self) -> Optional[LowBit]:
        """The low-bit policy the parameter broadcasts follow (``None``: they are exact)."""
        return self._lowbit.wire.policy if self._lowbit is not None else None

    @property
    def lowbit_traffic(self) -> Optional[StepTraffic]:
        """With ``lowbit``: the bytes this rank sent in the last step's parameter broadcasts and
        what exact broadcasts would have sent (read-only; ``None`` without ``lowbit`` or before
        the first step's broadcasts completed)."""
        return self._lowbit.traffic if self._lowbit is not None else None

    # ------------------------------------------------------------------------ stepping

    def step(self, closure: Optional[Callable[[], Any]] = None, *args: Any, **kwargs: Any) -> Any:
        """Step the local shard, then bring every rank's parameters up to date.

        Collective: every rank must call it. Extra arguments go to the wrapped ``step()``.
        With ``overlap_with_ddp=True``, after a backward whose DDP hook stepped the buckets, only
        the parameters no bucket held are stepped (a closure is evaluated first: its backward
        is the one that counts).
        """
        Join.notify_join_context(self)
        if self._bucket_steps is not None:
            return self._step_after_overlapped_backward(self._bucket_steps, closure, *args, **kwargs)
        return self._step_and_broadcast(closure, *args, **kwargs)

    def _step_and_broadcast(self, closure: Optional[Callable[[], Any]], *args: Any, **kwargs: Any) -> Any:
        self.wait_for_params()
        if not self._partition.is_current():
            self._warn_trainability_changed_once()
            self.refresh_trainable()
        self._consolidated = None
        self._push_hyperparams()
        if self._lowbit is not None:  # the optimizer steps the owners' masters, not the replicas
            with self._lowbit.master_values(self.broadcaster.buckets):
                loss = self._step_local_shard(closure, *args, **kwargs)
        else:
            loss = self._step_local_shard(closure, *args, **kwargs)
        self._pull_hyperparams()
        self.broadcaster.start()
        return loss

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a ``Join`` context runs on a rank that ran out of data: it steps this rank's
        shard with the gradients the rank holds and sends the owners' broadcasts, as torch's
        ``ZeroRedundancyOptimizer``'s does; with ``ShardedDataParallel`` in the same ``Join``,
        the model's hook steps it instead, after handing over this rank's averaged gradients.
        Keyword arguments are for the other joinables (``Join`` passes them to all) and unused.
        Refused with ``overlap_with_ddp=True``: DDP's join hook runs the comm hook (which steps
        the buckets) on a rank out of data, and this hook would step that rank a second time.
        """
        if self._bucket_steps is not None:
            raise NotImplementedError(on_rank(
                "OSS(overlap_with_ddp=True) under torch's Join: a rank out of data would be stepped by DDP's "
                "join hook (through the comm hook) and by the optimizer's; use overlap_with_ddp=False for uneven inputs",
                self.rank,
            ))
        return OptimizerJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """Where ``Join``'s own flags live: the process group's device for small tensors."""
        return comm.comm_device(self.group)

    @property
    def join_process_group(self) -> Any:
        """The group ``Join`` counts the ranks still training over: the one sharded over."""
        return self.group

    def wait_for_params(self) -> None:
        """Complete the parameter broadcasts that the last ``step()`` left in flight.

        Only ``ShardedDataParallel(overlap_param_broadcast=True)`` leaves them in flight (its
        forward waits for each module's parameters just before the module runs); call this
        before reading parameters any other way between ``step()`` and the next forward.
        Local (no collective); a no-op when nothing is in flight.
        """
        self.broadcaster.wait()

    def _step_local_shard(self, closure: Optional[Callable[[], Any]], *args: Any, **kwargs: Any) -> Any:
        if self._inner_step_takes_closure:
            return self.optim.step(closure, *args, **kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.optim.step(*args, **kwargs)
        return loss

    # ------------------------------------------------------------- overlap with DDP

    def _bucket_steps_for(self) -> BucketSteps:
        return BucketSteps(
            self.group,
            self._step_with,
            bucket_numel=lambda: self.broadcaster.bucket_numel,
            wire_dtype=lambda: torch.float16 if self.broadcaster.wire_fp16 else None,
        )

    def _step_after_overlapped_backward(
        self, steps: BucketSteps, closure: Optional[Callable[[], Any]], *args: Any, **kwargs: Any
    ) -> Any:
        """``step()`` with ``overlap_with_ddp=True``: the usual step unless the backward's DDP
        hook stepped the buckets, in which case only the parameters no bucket held are left."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not steps.take_stepped_backward():
            steps.warn_if_unhooked_once()
            self._step_and_broadcast(None, *args, **kwargs)
            return loss
        if args or kwargs:
            raise TypeError(
                on_rank(
                    f"step() arguments {list(args) + sorted(kwargs)} cannot reach {type(self.optim).__name__}: "
                    "its step ran during the backward (overlap_with_ddp=True)",
                    self.rank,
                )
            )
        steps.step_the_rest()
        return loss

    def _step_with(self, grads: dict[torch.Tensor, torch.Tensor]) -> None:
        """Step only the owned parameters in ``grads``, each with the gradient given there."""
        if grads and not self._partition.is_current():
            raise RuntimeError(on_rank(PARTITION_CHANGED_UNDER_HOOK, self.rank))
        if grads:
            self._consolidated = None
            self._push_hyperparams()
            step_only(self.optim, grads)
            self._pull_hyperparams()

    @property
    def _overlap_with_ddp(self) -> bool:
        """What torch's ``ddp_zero_hook`` functions read first: they drive torch's class through
        its private state, so they are refused here, with a message naming ours."""
        raise AttributeError(TORCH_HOOKS_REFUSED)

    def clip_grad_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        filter_params_fn: Optional[Callable[[Any], Any]] = None,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Clip gradients by their global norm across all shards; return that norm.

        Equals ``torch.nn.utils.clip_grad_norm_`` over the full model's gradients, but each rank
        only reads (and scales) the gradients of the parameters it owns. Collective.
        ``filter_params_fn`` narrows the rank's parameter list the norm is taken over (as in
        fairscale, e.g. to count model-parallel copies once); every owned gradient is still
        clipped by that norm. ``error_if_nonfinite`` raises, before scaling, if the norm is inf
        or NaN (as torch's).
        """
        if self._bucket_steps is not None and self._bucket_steps.stepped_backward:
            raise RuntimeError(
                on_rank(
                    "the last backward already stepped the parameters (overlap_with_ddp=True): "
                    "clipping their gradients now would change nothing",
                    self.rank,
                )
            )
        params = [self._partition.params[i] for i in self._partition.owned_indices(self.rank)]
        grads = [p.grad for p in params if p.grad is not None]
        device = self._partition.params[0].device if self._partition.params else None
        if filter_params_fn is None:
            return clip_by_global_norm(grads, max_norm, norm_type, self.group, error_if_nonfinite, result_device=device)
        counted = [p.grad for p in filter_params_fn(params) if p.grad is not None]
        return clip_by_global_norm(counted, max_norm, norm_type, self.group, error_if_nonfinite, clip=grads, result_device=device)

    # ------------------------------------------------------------- changing the partition

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; existing parameters keep their owner. Collective after construction."""
        params = param_list(param_group)
        self._check_new_group(params)
        param_group = {**param_group, "params": params}
        Optimizer.add_param_group(self, param_group)
        if not hasattr(self, "_partition"):  # Optimizer.__init__ adding the initial groups
            return
        self._check_same_params_on_all_ranks()
        new_params = self.param_groups[-1]["params"]
        costs = param_costs([new_params], self.param_cost, self.rank, first_group=len(self.param_groups) - 1)
        partition = self._partition.with_group(new_params, costs)
        mine = partition.owned_by_group(self.rank)[-1]
        self.optim.add_param_group({**hyperparams(self.param_groups[-1]), "params": mine})
        self._install(partition)
        self._pull_hyperparams()

    def refresh_trainable(self) -> None:
        """Re-partition after ``requires_grad`` changed on some parameters. Collective.

        Trainable parameters are balanced afresh; optimizer state follows each parameter to its
        new owner (a frozen parameter keeps its state for when it trains again), so all replicas
        stay identical. ``step()`` calls this itself when it sees a change.
        """
        self._check_same_params_on_all_ranks()
        new = self._build_partition()
        self._move_state_to_owners(new)
        self._install(new)

    def _build_partition(self) -> Partition:
        """Every param group placed afresh, by ``param_cost``."""
        groups = [g["params"] for g in self.param_groups]
        return Partition.build(groups, self.world_size, param_costs(groups, self.param_cost, self.rank))

    def _install(self, partition: Partition) -> None:
        """Make ``partition`` current: the inner optimizer's param lists and the broadcast plan."""
        self._partition = partition
        self._warn_if_imbalanced_once(partition)
        if self._bucket_steps is not None:
            self._bucket_steps.plan(partition)
        for inner, mine in zip(self.optim.param_groups, partition.owned_by_group(self.rank)):
            inner["params"] = mine
        self.broadcaster.plan(partition)
        if self._lowbit is not None:
            self._lowbit.keep_only([p for b in self.broadcaster.buckets if b.src == self.rank for p in b.tensors])

    def _warn_if_imbalanced_once(self, partition: Partition) -> None:
        """Whole parameters cannot be split: a large one (an embedding) can leave one rank far
        above an even share of the optimizer state, or of the step's work (a large square matrix
        under Muon), however many ranks there are."""
        if getattr(self, "_warned_imbalance", False):
            return
        balance = partition.balance()
        by_bytes = self.param_cost is bytes_cost
        off = _uneven_bytes(balance, self.world_size, by_bytes) + ([] if by_bytes else _uneven_cost(balance))
        if off:
            self._warned_imbalance = True
            logger.warning("OSS: %s", "; ".join(off))

    def _move_state_to_owners(self, new: Partition) -> None:
        """Send what this rank keeps for parameters that ``new`` gives to another rank: their
        optimizer state, and their gradient, which under ZeRO-2 only the old owner holds and
        which decides whether the new owner steps the parameter."""
        owner = new.owner_of()
        states: dict[int, dict[torch.Tensor, dict[str, Any]]] = defaultdict(dict)
        grads: dict[int, dict[torch.Tensor, dict[str, Any]]] = defaultdict(dict)
        for p, state in self.held_states().items():
            if owner[p] != self.rank:
                self.optim.state.pop(p, None)
                states[owner[p]][p] = state
        for p, old_owner in zip(self._partition.params, self._partition.owners):
            if old_owner == self.rank and owner[p] != self.rank and p.grad is not None:
                grads[owner[p]][p] = {"grad": p.grad}
        outgoing = {
            dst: (snapshot_shard(states[dst], new), snapshot_shard(grads[dst], new))
            for dst in set(states) | set(grads)
        }
        for state_shard, grad_shard in comm.exchange_objects(outgoing, self.group).values():
            self._adopt({new.params[index]: state for index, state in state_shard.items()})
            for index, held in grad_shard.items():
                param = new.params[index]
                if param.grad is None:
                    param.grad = held["grad"].to(param.device, param.dtype)

    def _adopt(self, states: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Take copies of ``states`` as the inner optimizer's state of their (owned) parameters;
        a saved master (``lowbit``) becomes this rank's master of its parameter."""
        group_of = {p: group for group in self.param_groups for p in group["params"]}
        for param, state in states.items():
            restored = restore_state(state, param, group_of[param])
            master = restored.pop(MASTER_KEY, None)
            if master is not None:
                self._adopt_master(param, master)
            self.optim.state[param] = restored

    def _adopt_master(self, param: torch.Tensor, master: torch.Tensor) -> None:
        if self._lowbit is not None:
            self._lowbit.masters[param] = master
        elif not getattr(self, "_warned_masters_dropped", False):
            self._warned_masters_dropped = True
            logger.warning("%s", on_rank(
                "OSS: the state loaded holds low-bit masters (saved with lowbit); without lowbit the "
                "parameters keep the values loaded into the model, within one rounding of those masters", self.rank))

    def held_states(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Parameter -> the optimizer state this rank keeps for it: the wrapped optimizer's, with
        the exact master under ``"lowbit_master"`` where ``lowbit`` keeps one (the owner's
        state, saved and moved with the rest; the model holds the replica every rank computes with)."""
        states = {p: dict(state) for p, state in self.optim.state.items()}
        for p, master in (self._lowbit.masters.items() if self._lowbit is not None else ()):
            states.setdefault(p, {})[MASTER_KEY] = master
        return states

    # ------------------------------------------------------------------------ state dicts

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather the full optimizer state on ``recipient_rank`` (``-1``: on every rank).

        Collective. Afterwards ``state_dict()`` on the recipient returns it, until the next step.
        """
        self._consolidate_on(recipient_rank)

    def _consolidate_on(self, recipient_rank: int) -> None:
        """The consolidation itself, under a name subclasses leave alone (torch's class calls
        the public method's argument ``to``)."""
        if not -1 <= recipient_rank < self.world_size:
            raise ValueError(
                on_rank(
                    f"{self._recipient_argument} {recipient_rank} is outside 0..{self.world_size - 1} (or -1)",
                    self.rank,
                )
            )
        mine = snapshot_shard(self.held_states(), self._partition)
        recipients = range(self.world_size) if recipient_rank == -1 else [recipient_rank]
        received = comm.exchange_objects({r: mine for r in recipients if r != self.rank}, self.group)
        if self.rank not in recipients:
            self._consolidated = None
            return
        merged = dict(mine)
        for shard in received.values():
            merged.update(shard)
        self._consolidated = merged

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """The full optimizer state in torch's format, as last consolidated on this rank.

        With ``all_ranks=True`` it consolidates on every rank first (collective). The param
        groups are read now, as torch's and fairscale's are: hyperparameters a scheduler or the
        user changed after the consolidation are saved as they are. Each call returns new dicts.
        """
        if all_ranks:
            self._consolidate_on(-1)
        if self._consolidated is None:
            raise RuntimeError(
                on_rank(
                    "no consolidated optimizer state on this rank since the last "
                    f"step; call consolidate_state_dict({self._recipient_argument}={self.rank}) on all ranks "
                    "first, or state_dict(all_ranks=True)",
                    self.rank,
                )
            )
        states = {index: dict(state) for index, state in self._consolidated.items()}
        return consolidated_state_dict(states, self.param_groups)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full torch-format state dict (from OSS or a plain optimizer, any world size).

        Every rank passes the same full dict and keeps the state of the parameters it owns,
        moved to their device. Hyperparameters of each group are restored too.
        """
        states = states_by_param(state_dict, self._partition, self.rank)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(hyperparams(saved))
        self._push_hyperparams()
        self.optim.state.clear()
        if self._lowbit is not None:
            self._lowbit.masters.clear()
        owner = self._partition.owner_of()
        self._adopt({param: state for param, state in states.items() if owner[param] == self.rank})
        self._upgrade_loaded_state()
        self._consolidated = None

    def _upgrade_loaded_state(self) -> None:
        """Let the wrapped optimizer upgrade the state just loaded, as the last step of torch's
        own ``load_state_dict`` does: its ``__setstate__`` turns a state dict saved by older torch
        into the current format (Adam's float ``step`` becomes the tensor its step requires) and
        fills param-group keys missing from it. Only the objects already held are passed, so
        nothing is replaced."""
        self.optim.__setstate__({"state": self.optim.state, "param_groups": self.optim.param_groups})
        self._pull_hyperparams()

    # ------------------------------------------------------------------------- internals

    def _push_hyperparams(self) -> None:
        """Copy hyperparameters set on ``self.param_groups`` (by users, schedulers) inward."""
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update(hyperparams(outer))

    def _pull_hyperparams(self) -> None:
        """Copy hyperparameters the wrapped optimizer set or added outward."""
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            outer.update(hyperparams(inner))

    def _check_new_group(self, params: list[Any]) -> None:
        """Raise unless ``params`` are valid parameters that no existing group holds."""
        where = f"param group {len(self.param_groups)}"
        check_param_list(params, where, self.rank)
        group_of = {p: g for g, group in enumerate(self.param_groups) for p in group["params"]}
        for i, p in enumerate(params):
            if p in group_of:
                raise ValueError(
                    on_rank(
                        f"{where}, parameter {i} (shape {tuple(p.shape)}) is "
                        f"already in param group {group_of[p]}; a parameter may be in one group only",
                        self.rank,
                    )
                )

    def _check_same_params_on_all_ranks(self) -> None:
        named = [
            (f"param group {g}, parameter {i}", p)
            for g, group in enumerate(self.param_groups)
            for i, p in enumerate(group["params"])
        ]
        check_same_across_ranks(named, self.group, "OSS parameters")

    def _warn_trainability_changed_once(self) -> None:
        if not self._warned_trainability_change:
            logger.warning(
                "OSS: requires_grad changed on some parameters; re-partitioning. Call "
                "refresh_trainable() after changing requires_grad to do this explicitly."
            )
            self._warned_trainability_change = True


def _uneven_bytes(balance: Balance, world_size: int, by_bytes: bool) -> list[str]:
    """The warning's words on the optimizer state's bytes, if they are over the threshold."""
    if balance.bytes <= IMBALANCE_WARNING:
        return []
    share = f"the busiest rank holds {balance.bytes:.2f}x an even share of the optimizer state"
    if not by_bytes:
        return [f"{share} (the partition balances step costs, not bytes)"]
    return [
        f"{share} (its largest parameters cannot be split across {world_size} ranks); "
        "FullyShardedDataParallel with ShardingStrategy.SHARD_GRAD_OP shards every parameter element-wise"
    ]


def _uneven_cost(balance: Balance) -> list[str]:
    """The warning's words on the step cost (``param_cost``), if it is over the threshold."""
    if balance.cost <= IMBALANCE_WARNING:
        return []
    return [
        f"the busiest rank's step costs {balance.cost:.2f}x an even share (param_cost; each "
        "parameter is stepped whole by one rank, so the costliest ones set the step's time)"
    ]
