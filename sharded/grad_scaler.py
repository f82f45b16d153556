"""``ShardedGradScaler``: mixed-precision loss scaling that agrees across shards.

A plain ``GradScaler`` decides to skip a step when *its* gradients hold an inf or NaN. With
sharded gradients each rank sees only its own shard, so ranks would disagree: some step (and
join the parameter broadcast), others skip, and training desynchronises or hangs. This scaler
takes the maximum of the found-inf flags over the process group, so every rank skips together.

It stands where fairscale's ``ShardedGradScaler`` stood, so it is what fairscale's was: an instance
of ``torch.cuda.amp.GradScaler`` (trainers annotate and check their scaler as that class), which
by default scales on CUDA and, where there is no CUDA, disables itself with torch's warning
(``is_enabled()`` False, scale 1.0). Scaling fp16 gradients on the CPU is an explicit choice,
``device="cpu"``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from ._common import comm
from ._common.lowbit import ErrorFeedback, feedbacks_into

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.cuda.amp.GradScaler):
    """A ``torch.cuda.amp.GradScaler`` whose inf/NaN check is agreed across ranks.

    Use it exactly like torch's scaler with ``OSS`` (with or without ``ShardedDataParallel``) or
    ``fully_shard``: ``scale(loss).backward()``, ``step(optimizer)``, ``update()``. It is an
    instance of ``torch.cuda.amp.GradScaler``, as fairscale's scaler was, and so of
    ``torch.amp.GradScaler`` too; building it gives no deprecation warning (that warning is on
    ``torch.cuda.amp.GradScaler``'s own constructor, which is not called).

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as for
            ``torch.amp.GradScaler``.
        process_group: the group the optimizer shards over (default: the whole world).
        device: the device type of the gradients (default ``"cuda"``). As with torch's CUDA
            scaler, ``"cuda"`` where CUDA is not available warns and disables the scaler
            (``is_enabled()`` False, ``scale(loss)`` returns the loss, ``get_scale()`` 1.0);
            pass ``device="cpu"`` to scale float16 gradients on the CPU.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
        device: str = "cuda",
    ) -> None:
        if not isinstance(device, str):
            raise TypeError(f"ShardedGradScaler(device=...) takes a device type such as 'cuda' or 'cpu', got {device!r}")
        # torch.amp.GradScaler's constructor, not torch.cuda.amp.GradScaler's: that one only
        # fixes the device to "cuda" and warns that it is deprecated.
        torch.amp.GradScaler.__init__(
            self,
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group
        self._lowbit_feeds: list[ErrorFeedback] = []  # residuals of this step's low-bit gradients

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale this rank's gradients, then make every rank's found-inf flags the global max."""
        per_device = _agree_on_found_inf(super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16), self.process_group)
        feeds = feedbacks_into(optimizer)
        if feeds:
            self._lowbit_feeds += feeds
            if any(float(flag) > 0 for flag in per_device.values()):  # the step is skipped
                for feedback in feeds:
                    feedback.clear()
        return per_device

    def update(self, new_scale: Optional[Union[float, torch.Tensor]] = None) -> None:
        """As torch's; the low-bit residuals of gradients that were unscaled this step follow a
        change of scale, since they are added to gradients scaled by the new one."""
        feeds, self._lowbit_feeds = self._lowbit_feeds, []
        if not feeds or not self.is_enabled():
            return super().update(new_scale)
        before = self.get_scale()
        super().update(new_scale)
        after = self.get_scale()
        if before > 0 and after != before:
            for feedback in {id(f): f for f in feeds}.values():
                feedback.rescale(after / before)


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
