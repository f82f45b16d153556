"""How many bytes the busiest rank holds at its worst moment of a training step, per ZeRO stage.

Nothing is allocated: the model may be on the meta device. The placement comes from the planners
the stages really use (:class:`~sharded._owners.partition.Partition` for ZeRO-1/2, the reduce buckets of
:func:`~sharded._owners.reduce_plan.plan_reduce_buckets`, the units ``FullyShardedDataParallel`` would
wrap and their padded shard slots for ZeRO-3); the optimizer state and the step's temporaries
come from stepping the optimizer itself on meta tensors; activations from a trial forward and
backward on fake tensors, when an example input is given.

The high-water mark is the largest of three moments: building and wrapping the model; the worst
moment of a backward once the optimizer state exists (parameters, that state, and, walked
gradient by gradient, the activations still alive beside the gradients and communication buffers
the stage holds by then); and the optimizer step (parameters, gradients, state, the step's
temporaries). The last two add a constant ``runtime_bytes`` for what the process itself has
allocated by then beyond tensors, measured on CPU/gloo (see ``RUNTIME_BYTES``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from .._common.lowbit import LowBit
from .._owners.step_cost import default_param_cost
from .layout import RUNTIME_BYTES, STAGE_NAMES
from .lowbit import LowBitCost, check_stage_policy
from .trial import ActivationProfile, activation_trial, optimizer_trial

__all__ = ["MemoryEstimate", "estimate_memory", "RUNTIME_BYTES", "STAGE_NAMES"]

@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes of one configuration, for its busiest rank.

    ``communication`` is what the stage's collectives hold at the backward's worst moment
    (DDP's gradient buckets; ZeRO-2's reduce buckets in flight; ZeRO-3's gathered units and
    reduce-scatter buffers). ``peak_bytes`` is the high-water mark of everything together.
    ``bytes_sent`` and ``collectives`` are per rank and step; ``largest_share`` is the busiest
    rank's share of the sharded model state (ideal: ``1 / world_size``).
    """

    stage: int
    world_size: int
    parameters: int
    gradients: int
    optimizer_state: int
    communication: int
    activations: int
    optimizer_step: int
    runtime: int
    peak_bytes: int
    bytes_sent: int
    collectives: int
    largest_share: float
    phases: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def name(self) -> str:
        return STAGE_NAMES[self.stage]

    def __str__(self) -> str:
        mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
        parts = ", ".join(
            f"{k} {mib(getattr(self, k))}"
            for k in ("parameters", "gradients", "optimizer_state", "communication", "activations", "optimizer_step", "runtime")
        )
        return f"{self.name} at {self.world_size} ranks: peak {mib(self.peak_bytes)} ({parts})"


def estimate_memory(
    model: nn.Module,
    *,
    world_size: int,
    stage: int,
    optimizer: type = torch.optim.Adam,
    optimizer_kwargs: Optional[dict[str, Any]] = None,
    mixed_precision: Any = None,
    wrap: Any = None,
    reshard_after_forward: bool = True,
    keep_unsharded_storage: bool = False,
    example_input: Any = None,
    loss_fn: Optional[Callable[..., torch.Tensor]] = None,
    activation_bytes: Optional[int] = None,
    device: Optional[torch.device] = None,
    built_whole: bool = False,
    runtime_bytes: int = RUNTIME_BYTES,
    parameters_as_bucket_view: bool = True,
    lowbit: Optional[LowBit] = None,
) -> MemoryEstimate:
    """Estimate the memory of one training step for the busiest rank, without allocating it.

    Args:
        model: the model (any device; the meta device costs nothing).
        world_size: ranks the model is trained on.
        stage: the ZeRO stage: 0 (DDP + the optimizer), or the stage sharded's layer of that
            number runs: 1 (DDP + ``OSS``), 2 (``ShardedDataParallel`` + ``OSS``) or 3
            (``FullyShardedDataParallel`` / ``fully_shard``).
        optimizer / optimizer_kwargs: the optimizer class and its arguments; its state is
            measured by stepping it on meta tensors.
        mixed_precision: for stage 3, a ``MixedPrecisionPolicy`` or FSDP1 ``MixedPrecision``
            (``param_dtype`` sets the gathered parameters' dtype).
        wrap: stage 3's units: module classes or a policy, as ``FullyShardedDataParallel``'s
            ``auto_wrap_policy`` takes (the root is always a unit).
        reshard_after_forward: stage 3 only; ``False`` is SHARD_GRAD_OP (units stay gathered
            from forward to backward).
        keep_unsharded_storage: stage 3 only; ``True``: every unit keeps its gathered
            parameters' storage across reshards (``set_keep_unsharded_storage(True)``), held
            through backward and the optimizer step.
        example_input / loss_fn: measure activations with a trial forward and backward of a
            copy of the model on fake tensors: ``loss_fn(model, *example_input)`` (default: the
            sum of the outputs). Or declare them with ``activation_bytes``.
        device: the compute device (default: the first parameter's, CPU for meta models).
        built_whole: the model is built whole on every rank before it is wrapped (as the
            examples do), so stage 3 holds the full parameters once while it shards them;
            ``False`` (deferred init on the meta device): one unit at a time.
        runtime_bytes: the process's own allocations by the optimizer step (``RUNTIME_BYTES``).
        parameters_as_bucket_view: stages 1 and 2, ``OSS``'s option (``True``, its default:
            the parameters are views of the broadcast buckets, which cost nothing more);
            ``False`` (torch ``ZeroRedundancyOptimizer``'s default, and
            ``sharded.ZeroRedundancyOptimizer``'s) adds a ``"broadcast"`` moment after the step
            that holds a packed copy of every broadcast bucket of several parameters. That is
            exact where a buffer costs its size when allocated (an accelerator); on a CPU a
            receive buffer's pages are backed only as data arrives and each is freed once
            unpacked, so the measured peak is lower (the 67M-parameter MLP at world 2 with
            Adam: 1187-1244 MiB measured against 1283 estimated at ZeRO-1, 835 against 898 at
            ZeRO-2; 1059 and 677-679 with bucket views, estimated 1059 and 674).
        lowbit: the stage's ``sharded.LowBit`` policy, as its wrapper takes it: stage 1
            ``OSS(lowbit=LowBit(params=...))`` (each owner keeps an exact master of the
            parameters it owns, and sets their replicas aside during the optimizer step; the
            changes travel encoded after it), stage 2 ``ShardedDataParallel(lowbit=LowBit(grads=...))``
            (each bucket's message and encoding, the owner's ``W`` received messages, and under
            error feedback a float32 residual of every bucket on every rank), stage 3
            ``fully_shard(lowbit=...)`` with either or both (the gathers' and reduce-scatters'
            messages, the rows' encoding, and the residual of every row a rank sends). What the
            stage's wrapper refuses is refused, with a ``ValueError`` naming the field.
            ``bytes_sent`` then counts the codec's messages. Shadow-check steps
            (``check_every``) run an exact collective beside each low-bit one; their buffers
            are not counted.
    """
    if stage not in STAGE_NAMES:
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if keep_unsharded_storage and stage != 3:
        raise ValueError(f"keep_unsharded_storage applies to stage 3 (fully_shard) only, not to stage {stage}")
    if not parameters_as_bucket_view and stage not in (1, 2):
        raise ValueError(f"parameters_as_bucket_view is OSS's option (stages 1 and 2), not {STAGE_NAMES[stage]}'s")
    policy = check_stage_policy(lowbit, stage)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("estimate_memory: the model has no trainable parameters")
    device = device or _compute_device(model)
    kwargs = dict(optimizer_kwargs or {})
    profile = _activation_profile(model, example_input, loss_fn, activation_bytes, device)
    activations = profile.peak if profile is not None else int(activation_bytes or 0)
    wire = LowBitCost(policy, world_size) if policy is not None else None
    if stage == 3:
        from .zero3 import zero3_layout

        layout = zero3_layout(
            model, world_size, wrap, mixed_precision, reshard_after_forward, device, profile, activations, keep_unsharded_storage,
            wire,
        )
    else:
        from .replicated import replicated_layout

        layout = replicated_layout(model, world_size, stage, profile, activations, device, default_param_cost(optimizer),
                                   parameters_as_bucket_view, wire)
    trial = optimizer_trial(optimizer, kwargs, layout.optimizer_shapes)
    # the peak backward is a later step's, by when the process has paid its runtime bytes
    backward = layout.parameters + trial.state_bytes + layout.backward_bytes + runtime_bytes
    step = layout.parameters + layout.gradients + layout.held_in_step + trial.state_bytes + trial.step_bytes + runtime_bytes
    build = layout.build_bytes if built_whole else layout.parameters + layout.largest_unit_bytes
    phases = {"build": build, "backward": backward, "optimizer step": step}
    if layout.broadcast_bytes:  # the step's temporaries are gone; the packed or low-bit messages are in flight
        phases["broadcast"] = step - trial.step_bytes + layout.broadcast_bytes
    return MemoryEstimate(
        stage=stage,
        world_size=world_size,
        parameters=layout.parameters,
        gradients=layout.gradients,
        optimizer_state=trial.state_bytes,
        communication=layout.communication,
        activations=activations,
        optimizer_step=trial.step_bytes,
        runtime=runtime_bytes,
        peak_bytes=max(phases.values()),
        bytes_sent=layout.bytes_sent,
        collectives=layout.collectives,
        largest_share=layout.largest_share,
        phases=phases,
    )


def _compute_device(model: nn.Module) -> torch.device:
    first = next(model.parameters())
    return torch.device("cpu") if first.is_meta else first.device


def _activation_profile(model, example_input, loss_fn, declared, device) -> Optional[ActivationProfile]:
    """The trial's profile of the activations, unless they are declared or there is no input."""
    if declared is not None or example_input is None:
        return None
    return activation_trial(model, example_input, loss_fn, device)
