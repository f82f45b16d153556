"""``fully_shard``'s arguments in torch's spellings, turned into what a unit is built from.

torch's own ``MixedPrecisionPolicy`` / ``OffloadPolicy`` / ``CPUOffloadPolicy`` objects become
ours, field by field (torch's dataclass fields are read, so a field a later torch adds and sharded
does not know raises, naming it, unless it holds its default); ``reshard_after_forward`` may be ``None`` or an ``int`` as in torch 2.13; and
``shard_placement_fn`` is asked about every parameter (the dim to cut it on, or the owner placement). What sharded does not implement raises
``NotImplementedError`` naming the argument, never a silent difference.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

from torch.distributed.tensor import Shard

from .._common.errors import on_rank
from ._placement.owned import Owned
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["as_our_policies", "resolve_reshard_after_forward", "shard_placements"]


def as_our_policies(mp_policy: Any, offload_policy: Any) -> tuple[MixedPrecisionPolicy, Optional[OffloadPolicy]]:
    """``(mp_policy, offload_policy)`` as sharded's dataclasses (torch's are converted)."""
    from torch.distributed import fsdp as torch_fsdp

    if isinstance(mp_policy, torch_fsdp.MixedPrecisionPolicy):
        mp_policy = MixedPrecisionPolicy(**_fields_we_know(mp_policy, MixedPrecisionPolicy))
    elif not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(on_rank(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}"))
    if isinstance(offload_policy, torch_fsdp.CPUOffloadPolicy):
        offload_policy = CPUOffloadPolicy(**_fields_we_know(offload_policy, CPUOffloadPolicy))
    elif isinstance(offload_policy, torch_fsdp.OffloadPolicy):
        _fields_we_know(offload_policy, OffloadPolicy)
        offload_policy = None
    elif offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(on_rank(f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}"))
    return mp_policy, offload_policy


def _fields_we_know(theirs: Any, ours: type) -> dict[str, Any]:
    """The fields of torch's policy object ``theirs`` as keyword arguments for our class
    ``ours``; a field ours lacks raises ``NotImplementedError`` naming it, unless it holds its
    default (it then asks for nothing)."""
    known = {f.name for f in dataclasses.fields(ours)}
    taken = {}
    for f in dataclasses.fields(theirs):
        value = getattr(theirs, f.name)
        if f.name in known:
            taken[f.name] = value
        elif not _is_default(f, value):
            raise NotImplementedError(on_rank(
                f"fully_shard: torch's {type(theirs).__name__}({f.name}={value!r}) is not supported by sharded "
                f"(it knows {sorted(known)}); leave {f.name} at its default or use sharded.fsdp.{ours.__name__}"
            ))
    return taken


def _is_default(f: dataclasses.Field, value: Any) -> bool:
    if f.default is not dataclasses.MISSING:
        return value is f.default or value == f.default
    if f.default_factory is not dataclasses.MISSING:
        return bool(value == f.default_factory())
    return False


def resolve_reshard_after_forward(value: Any, shard_world: int) -> Union[bool, int, None]:
    """``None`` / ``True`` / ``False`` as they are; an ``int`` (the world to reshard to after
    forward) as torch reads it: the shard world is ``True``, 1 is ``False``, and a divisor in
    between stays an ``int`` (ZeRO++'s secondary shard, :mod:`._placement.secondary_shard`)."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(on_rank(f"reshard_after_forward must be True, False, None or an int, got {value!r}"))
    if value < 1 or value > shard_world or shard_world % value:
        raise ValueError(on_rank(
            f"reshard_after_forward={value}: as an int it is the world to reshard to after forward, "
            f"and must divide the shard world size {shard_world}"
        ))
    if value == shard_world:
        return True
    if value == 1:
        return False
    return value


def shard_placements(shard_placement_fn: Optional[Callable[[Any], Any]], taken: Sequence[tuple], shard_world: int) -> list[Union[int, Owned]]:
    """Where each parameter goes: the dim it is cut on, or :class:`Owned` to keep it whole on
    one rank. What ``shard_placement_fn`` returns for it: ``None`` (dim 0), ``Shard(d)`` (``d``
    may be negative), checked as torch checks it (a dim the parameter has; a dim other than 0
    must divide evenly over the ``shard_world`` ranks), or ``Owned(...)``."""
    if shard_placement_fn is None:
        return [0] * len(taken)
    return [_placement(name, param, shard_placement_fn(param), shard_world) for name, param, _ in taken]


def _placement(name: str, param: Any, placement: Any, shard_world: int) -> Union[int, Owned]:
    if placement is None:
        return 0
    if isinstance(placement, Owned):
        return placement
    if type(placement) is not Shard:
        raise NotImplementedError(on_rank(
            f"fully_shard(shard_placement_fn=...) returned {placement!r} for parameter {name}; sharded "
            "supports None, Shard(dim) over the mesh given to fully_shard, or sharded.fsdp.Owned() (the "
            "parameter whole on one rank)"
        ))
    ndim = param.dim()
    dim = placement.dim + ndim if placement.dim < 0 else placement.dim
    if ndim == 0 and dim == 0:
        return 0  # a 0-dim parameter cannot be cut: replicated, as for the default
    if not 0 <= dim < ndim:
        raise ValueError(on_rank(f"fully_shard(shard_placement_fn=...) returned {placement!r} for parameter {name} of shape {tuple(param.shape)}, which has no dim {placement.dim}"))
    if dim and param.shape[dim] % shard_world:
        raise NotImplementedError(on_rank(
            f"fully_shard(shard_placement_fn=...) returned {placement!r} for parameter {name} of shape "
            f"{tuple(param.shape)}: dim {dim} does not divide evenly over {shard_world} ranks (like torch, "
            "sharded cuts dims other than 0 evenly only)"
        ))
    return dim
