"""``torch.nn.utils.clip_grad_norm_`` over ``ShardedDataParallel``'s parameters: DDP's global norm.

After a synced ZeRO-2 backward each rank holds the gradients of the parameters it owns only (the
others' ``.grad`` is ``None``), so torch's function, which takes the norm of the gradients it is
given, would clip each rank by the norm of its own share: other numbers than DDP's, silently.
Once a ``ShardedDataParallel`` over more than one rank is built, torch's names
(``torch.nn.utils.clip_grad_norm_``, and ``torch.nn.utils.clip_grad.clip_grad_norm_`` which the
deprecated ``clip_grad_norm`` calls) are routed here: parameters that include one of a live
wrapper's are clipped by the global norm, each gradient counted by the rank it was reduced to
(a parameter no optimizer owns, replicated, by the group's rank 0), as
:meth:`sharded.ShardedDataParallel.clip_grad_norm_` does; anything else goes to torch's own
function unchanged. The decision reads the parameters and the live wrappers, the same on every
rank, never the gradients, so every rank takes the same path.

``torch.nn.utils.get_total_norm`` takes gradients, not parameters: a rank cannot tell from them
which gradients the others own, so it cannot join their sum. It is routed too, under its public
name and under the module name torch's own ``clip_grad_norm_`` calls it by, and refuses an
owner-reduced gradient with an error naming the parameter and the rank instead of returning this
rank's share alone. That also catches code that bound torch's ``clip_grad_norm_`` by value before
the route was installed (``from torch.nn.utils import clip_grad_norm_`` at the top of a module
imported first): torch's function looks its norm up in its module at every call, so it raises on
each rank that owns a gradient it is given instead of clipping per rank. (A rank that owns none of
them returns; its peers' errors stop the run.) ``clip_grads_with_norm_`` needs no route: given
the global norm, each rank scales its gradients by DDP's factor.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Iterable, Optional, Protocol, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.utils
import torch.nn.utils.clip_grad as torch_clip_grad
from torch import nn

from .._common.errors import on_rank
from .._common.norm import clip_by_global_norm
from .._common.torch_routes import install_route

__all__ = ["OwnerReduced", "register_owner_reduced", "clip_owner_reduced_"]


class OwnerReduced(Protocol):
    """A model whose gradients are reduced to one owner rank each (``ShardedDataParallel``)."""

    module: nn.Module
    process_group: Any
    rank: int
    world_size: int

    @property
    def param_to_rank(self) -> dict[torch.Tensor, int]: ...

    def remember_clip_for_join(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> None: ...


_models: weakref.WeakSet[Any] = weakref.WeakSet()  # the live OwnerReduced models of this process


def register_owner_reduced(model: OwnerReduced) -> None:
    """Route torch's clipping for ``model``'s parameters while it lives (the route once per process)."""
    install_route(_route_torch_clip)
    _models.add(model)


def clip_owner_reduced_(
    params: Sequence[torch.Tensor],
    owner_of: dict[torch.Tensor, int],
    group: Any,
    rank: int,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = False,
) -> torch.Tensor:
    """Clip the gradients of ``params`` by their global norm over ``group``; return the norm.

    Each rank counts the gradients of the parameters ``owner_of`` gives it, and group rank 0 those
    of parameters it does not list (replicated on every rank). Each rank scales what it counted
    and the replicated gradients. Collective.
    """
    held = [(p, p.grad) for p in params if p.grad is not None]
    counted = [g for p, g in held if owner_of.get(p, 0) == rank]
    scaled = [g for p, g in held if owner_of.get(p, 0) == rank or p not in owner_of]
    device = next((p.device for p in params), None)
    return clip_by_global_norm(
        counted, max_norm, norm_type, group, error_if_nonfinite, clip=scaled, result_device=device, foreach=foreach
    )


def _route_torch_clip() -> None:
    routed = _routing(torch_clip_grad.clip_grad_norm_)
    torch_clip_grad.clip_grad_norm_ = routed
    torch.nn.utils.clip_grad_norm_ = routed
    if hasattr(torch.nn.utils, "get_total_norm"):
        torch.nn.utils.get_total_norm = _refusing_owner_reduced(torch.nn.utils.get_total_norm)
    if hasattr(torch_clip_grad, "_get_total_norm"):  # what torch's clip_grad_norm_ calls, by module name
        torch_clip_grad._get_total_norm = _refusing_owner_reduced(torch_clip_grad._get_total_norm)


def _claimed_by(params: Sequence[torch.Tensor]) -> list[OwnerReduced]:
    """The live models over more than one rank that hold one of ``params``."""
    ids = {id(p) for p in params}
    return [m for m in list(_models) if m.world_size > 1 and any(id(p) in ids for p in m.module.parameters())]


def _routing(torch_own: Any) -> Any:
    @functools.wraps(torch_own)
    def clip_grad_norm_(
        parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        models = _claimed_by(params)
        if not models:
            return torch_own(params, max_norm, norm_type, error_if_nonfinite, foreach)
        groups = {tuple(dist.get_process_group_ranks(m.process_group)) for m in models}
        if len(groups) > 1:
            raise ValueError(on_rank(
                "torch.nn.utils.clip_grad_norm_ got parameters of ShardedDataParallel models that reduce over "
                f"different process groups ({', '.join(f'ranks {list(g)}' for g in sorted(groups))}); clip each "
                "model's parameters in a call of their own"))
        owner_of: dict[torch.Tensor, int] = {}
        for model in models:
            owner_of.update(model.param_to_rank)
            model.remember_clip_for_join(max_norm, norm_type, error_if_nonfinite)
        first = models[0]
        return clip_owner_reduced_(
            params, owner_of, first.process_group, first.rank, max_norm, norm_type, error_if_nonfinite, foreach
        )

    return clip_grad_norm_


def _owner_reduced_grad(tensors: Sequence[torch.Tensor]) -> Optional[str]:
    """The name of a parameter whose gradient (reduced to this rank) is among ``tensors``."""
    given = {id(t) for t in tensors}
    for model in list(_models):
        if model.world_size == 1:
            continue
        for name, param in model.module.named_parameters():
            if param.grad is not None and id(param.grad) in given:
                return name
    return None


def _refusing_owner_reduced(torch_own: Any) -> Any:
    @functools.wraps(torch_own)
    def get_total_norm(
        tensors: Union[torch.Tensor, Iterable[torch.Tensor]],
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> torch.Tensor:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        name = _owner_reduced_grad(tensors)
        if name is not None:
            raise RuntimeError(on_rank(
                f"torch.nn.utils.get_total_norm got the gradient of parameter {name}, which a ShardedDataParallel "
                "reduces to its owner rank: from gradients alone it would take the norm of this rank's share, not "
                "the model's. Clip with torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) (routed to the "
                "global norm) or model.clip_grad_norm_(max_norm). If this came from torch's clip_grad_norm_, the "
                "caller holds torch's function bound before sharded routed it (from torch.nn.utils import "
                "clip_grad_norm_ in a module imported before the wrapper was built): call it as "
                "torch.nn.utils.clip_grad_norm_"))
        return torch_own(tensors, norm_type, error_if_nonfinite, foreach)

    return get_total_norm
