"""Low-bit communication in ``fully_shard`` (issue #39): what a unit's ``LowBit`` policy may be
combined with, the one :class:`~sharded._common.lowbit.LowBitWire` a model's units share per
(policy, shard group), and the bytes they report.

A unit makes its own wire when ``fully_shard`` gives it a policy (so a gather before the model's
first forward already goes through it); the root, once it knows the whole model, makes every unit
with the same policy over the same group share the outermost one's (:func:`share_wires`), so one
wire counts one step's bytes, sends one fallback report and runs one shadow schedule. The root
closes the step (:func:`end_step`) at the end of a backward after which no unit holds gradients
unsent: gradient accumulation (``no_sync``) is one step, its every micro-batch's gathers in it.

The policy is honoured on the plain path: a 1-D mesh of plain (not DTensor) element-sharded
parameters, kept on the compute device. Everything else is refused by :func:`check_scope`, naming
the module, the parameter where one is at fault, and the rank.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .._common.errors import on_rank
from .._common.lowbit import LowBit, LowBitWire, StepTraffic, feed_from

__all__ = ["check_scope", "new_wire", "share_wires", "end_step", "traffic_of"]


def check_scope(lowbit: Any, where: str, info: Any, params: Sequence[Any], offloads: bool, secondary_shard: bool) -> Optional[LowBit]:
    """``lowbit`` as ``fully_shard(lowbit=...)`` may take it, or a ``ValueError`` naming what it
    cannot be combined with. ``where`` names the call (``fully_shard(Block)``)."""
    if lowbit is None:
        return None
    if not isinstance(lowbit, LowBit):
        raise TypeError(on_rank(f"{where}: lowbit must be a sharded.LowBit or None, got {type(lowbit).__name__}"))
    if not lowbit.active:
        raise ValueError(on_rank(f"{where}: lowbit={lowbit!r} sends nothing in fewer bits; set params and/or grads, or pass lowbit=None"))
    if lowbit.grads is None and not lowbit.error_feedback:
        raise ValueError(on_rank(f"{where}: lowbit={lowbit!r}: error_feedback=False has no effect without grads "
                                 "(the parameters' gathers keep no residual); leave it at its default"))
    refused = [why for why, asked in (
        ("on a 2-D mesh (hybrid sharding); low-bit gathers and reductions run on a 1-D mesh", info.mesh.ndim != 1),
        ("on an SPMD mesh (dp_mesh_dims)", info.spmd is not None),
        ("with CPU offloading (offload_policy=CPUOffloadPolicy())", offloads),
        ("with reshard_after_forward=k (a secondary shard): the backward would gather the decoded values again",
         secondary_shard and lowbit.params is not None),
    ) if asked]
    refused += [f"for parameter {sp.fqn}: {why}" for sp in params for why, asked in (
        ("it is placed Owned() (broadcast whole from its owner)", sp.owner is not None),
        ("its tensor has the all-gather extension (fsdp_pre_all_gather), which decides its own wire format", sp.gather_extension),
        ("it is a DTensor (tensor parallelism)", sp.layout is not None),
    ) if asked]
    if refused:
        raise ValueError(on_rank(f"{where}: lowbit={lowbit!r} is not supported {refused[0]}; "
                                 "pass lowbit=None for this module, or apply fully_shard without it"))
    return lowbit


def new_wire(lowbit: Optional[LowBit], info: Any) -> Optional[LowBitWire]:
    """A unit's own wire over its shard group (``None`` when ``lowbit`` is)."""
    return None if lowbit is None else LowBitWire(lowbit, info.shard_group)


def share_wires(units: Sequence[Any]) -> None:
    """Give every unit with the same policy over the same group the first such unit's wire
    (``units`` outermost first: the root's where it has one)."""
    shared: list[LowBitWire] = []
    for unit in units:
        wire = unit.lowbit_wire
        if wire is None:
            continue
        # compared, not hashed: a policy's on_check may be unhashable (a list's append)
        same = [w for w in shared if w.policy == wire.policy and w.group == wire.group]
        unit.lowbit_wire = same[0] if same else wire
        if not same:
            shared.append(wire)
        if wire.policy.grads is not None and wire.policy.error_feedback:
            # a gradient scaler stepping these parameters drops or rescales the rows' residuals
            feed_from([sp.sharded for sp in unit.params], unit.lowbit_wire.feedback)


def wires_of(units: Sequence[Any]) -> list[LowBitWire]:
    """The distinct wires of ``units``, in their order."""
    found = {id(u.lowbit_wire): u.lowbit_wire for u in units if u.lowbit_wire is not None}
    return list(found.values())


def end_step(units: Sequence[Any]) -> None:
    """Close the step of every wire of ``units``: fallbacks reported, shadow checks reported,
    the step's bytes kept as the wire's last."""
    for wire in wires_of(units):
        wire.end_step()


def traffic_of(units: Sequence[Any]) -> Optional[StepTraffic]:
    """The last closed step's bytes over the wires of ``units``, summed per collective (``None``
    when none has a wire, or before the first step ends)."""
    wires = wires_of(units)
    steps = [wire.traffic.last for wire in wires if wire.traffic.last is not None]
    if not steps or len(steps) < len(wires):
        return None
    if len(steps) == 1:
        return steps[0]
    total = StepTraffic(max(step.step for step in steps))
    for step in steps:
        for collective, sent in step.sent.items():
            total.sent[collective] = total.sent.get(collective, 0) + sent
        for collective, exact in step.exact.items():
            total.exact[collective] = total.exact.get(collective, 0) + exact
    return total
