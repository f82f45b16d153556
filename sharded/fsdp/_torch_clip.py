"""``torch.nn.utils.clip_grad_norm_`` over owner-placed parameters, counted as sharded counts them.

torch's function takes the norm through DTensor ops: an owner-placed gradient (``Owned``) lives
on its owner's mesh alone, so on a rank that also holds element-sharded gradients torch refuses
to stack norms from two meshes, and on a rank whose gradients are all its own owned ones it
would clip by the norm of those alone, silently, while the other ranks clip by theirs. Once a
model places a parameter ``Owned()``, torch's name (``torch.nn.utils.clip_grad_norm_``, and
``torch.nn.utils.clip_grad.clip_grad_norm_`` which its deprecated alias calls) is routed here:
parameters that include an owner-placed one go to :func:`sharded.fsdp.clip_grad_norm_` (the
global norm, each owned gradient once), everything else to torch's own function unchanged. The
decision reads the parameters, which are the same on every rank, never the gradients, so every
rank takes the same path. Code that imported the function by value before the first ``Owned``
placement keeps torch's; call ``sharded.fsdp.clip_grad_norm_`` there.

``torch.nn.utils.get_total_norm`` (torchtitan's clipping calls it, then
``clip_grads_with_norm_``) takes gradients, not parameters: a rank cannot tell from them which
owned gradients other ranks hold, so it cannot join their sum. Routed too, it refuses owned
gradients with an error naming the rank instead of returning this rank's norm alone.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Optional, Union

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as torch_clip_grad

from .._common.dtensors import whole_on_group
from .._common.errors import on_rank
from ._grad_norm import clip_grad_norm_ as sharded_clip_grad_norm_

__all__ = ["route_torch_clip_for_owned"]

def route_torch_clip_for_owned() -> None:
    """Route torch's ``clip_grad_norm_`` as the module docstring says (call it once per process:
    :func:`._owned_routes.route_torch_for_owned`)."""
    routed = _routing(torch_clip_grad.clip_grad_norm_)
    torch_clip_grad.clip_grad_norm_ = routed
    torch.nn.utils.clip_grad_norm_ = routed
    torch.nn.utils.get_total_norm = _refusing_owned(torch.nn.utils.get_total_norm)


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
        if any(whole_on_group(p) is not None for p in params):
            return sharded_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return torch_own(params, max_norm, norm_type, error_if_nonfinite, foreach)

    return clip_grad_norm_


def _refusing_owned(torch_own: Any) -> Any:
    @functools.wraps(torch_own)
    def get_total_norm(
        tensors: Union[torch.Tensor, Iterable[torch.Tensor]],
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> torch.Tensor:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        owned = next((t for t in tensors if whole_on_group(t) is not None), None)
        if owned is not None:
            raise NotImplementedError(on_rank(
                f"torch.nn.utils.get_total_norm got the gradient (shape {tuple(owned.shape)}) of an owner-placed "
                "parameter (sharded.fsdp.Owned): from gradients alone it would take the norm of this rank's owned ones, "
                "not the model's; take the norm over the parameters with sharded.fsdp.clip_grad_norm_(parameters, "
                "max_norm), or torch.nn.utils.clip_grad_norm_, which is routed to it"
            ))
        return torch_own(tensors, norm_type, error_if_nonfinite, foreach)

    return get_total_norm
