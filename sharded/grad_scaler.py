"""``ShardedGradScaler``: mixed-precision loss scaling that agrees across shards.

A plain ``GradScaler`` decides to skip a step when *its* gradients hold an inf or NaN. With
sharded gradients each rank sees only its own shard, so ranks would disagree: some step (and
join the parameter broadcast), others skip, and training desynchronises or hangs. This scaler
takes the maximum of the found-inf flags over the process group, so every rank skips together.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ._common import comm

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` whose inf/NaN check is agreed across ranks.

    Use it exactly like ``torch.amp.GradScaler`` with ``OSS`` (with or without
    ``ShardedDataParallel``): ``scale(loss).backward()``, ``step(optimizer)``, ``update()``.

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as for
            ``torch.amp.GradScaler``.
        process_group: the group the optimizer shards over (default: the whole world).
        device: the device type of the gradients, ``"cuda"`` or ``"cpu"`` (default: ``"cuda"``
            when CUDA is available, else ``"cpu"``).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
        device: Optional[str] = None,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale this rank's gradients, then make every rank's found-inf flags the global max."""
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        return _agree_on_found_inf(per_device, self.process_group)


def _agree_on_found_inf(
    per_device: dict[torch.device, torch.Tensor], group: Optional[dist.ProcessGroup]
) -> dict[torch.device, torch.Tensor]:
    """Set every flag to the max over all devices and ranks (one collective, on every rank).

    A rank that holds no gradient (it owns nothing, or its shard got none) still joins the
    collective and records the agreed flag on the communication device.
    """
    device = comm.comm_device(group)
    agreed = torch.zeros((), dtype=torch.float32, device=device)
    for flag in per_device.values():
        agreed = torch.maximum(agreed, flag.to(device, torch.float32))
    comm.all_reduce(agreed, group, dist.ReduceOp.MAX)
    for flag in per_device.values():
        flag.copy_(agreed)
    return per_device or {device: agreed}
