"""Lightning Trainer precision plugins that clip by the global norm and agree on inf checks.

The Trainer clips gradients in its precision plugin, with ``torch.nn.utils.clip_grad_norm_`` over
the optimizer's parameters. Under ZeRO-2 each rank holds only the gradients it owns (the others
are ``None``), and under ZeRO-3 only its shard of each, so that would clip every rank by the norm
of its own part. These plugins clip by the norm over every rank's part instead (it equals
torch's on DDP), and ``"16-mixed"`` scales the loss with a :class:`~sharded.ShardedGradScaler`.

:class:`~sharded.lightning.ShardedDDPStrategy` converts the plugin the Trainer picks for a
``precision=`` flag into the matching one here by itself; build them directly only to pass
options (such as a scaler) through ``Trainer(plugins=[...])``.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer

from ..grad_scaler import ShardedGradScaler
from ._sharding import as_sharded_scaler, clip_optimizer_grads

__all__ = [
    "ShardedDoublePrecision",
    "ShardedHalfPrecision",
    "ShardedMixedPrecision",
    "ShardedPrecision",
    "ShardedPrecisionPlugin",
    "to_sharded_precision",
]


class _GlobalNormClipping:
    """Mixin for a ``Precision`` plugin: clip by the norm over every rank's shard."""

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """Clip the optimizer's gradients by their global norm (collective)."""
        clip_optimizer_grads(optimizer, clip_val)


class ShardedPrecisionPlugin:
    """Mixin for a Trainer strategy: its ``precision_plugin`` is always one that clips by the
    norm over every rank's shards (the plugin given, or the default, made sharded)."""

    _precision_plugin: Optional[Precision]

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else ShardedPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = None if plugin is None else to_sharded_precision(plugin)


class ShardedPrecision(_GlobalNormClipping, Precision):
    """``precision="32-true"`` under a sharded strategy."""


class ShardedDoublePrecision(_GlobalNormClipping, DoublePrecision):
    """``precision="64-true"`` under a sharded strategy."""


class ShardedHalfPrecision(_GlobalNormClipping, HalfPrecision):
    """``precision="16-true"`` or ``"bf16-true"`` under a sharded strategy."""


class ShardedMixedPrecision(_GlobalNormClipping, MixedPrecision):
    """``precision="16-mixed"`` or ``"bf16-mixed"`` under a sharded strategy.

    Args:
        precision: ``"16-mixed"`` (loss scaling with a ``ShardedGradScaler``) or ``"bf16-mixed"``.
        device: the device type for ``torch.autocast``, e.g. ``"cuda"`` or ``"cpu"``.
        scaler: for ``"16-mixed"``, the scaler to start from; a plain ``torch.amp.GradScaler`` is
            replaced by a ``ShardedGradScaler`` with the same settings.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"],
        device: str,
        scaler: Optional[torch.amp.GradScaler] = None,
    ) -> None:
        if scaler is None and precision == "16-mixed":
            scaler = ShardedGradScaler(device=device)
        super().__init__(precision, device, as_sharded_scaler(scaler, device))


# The plugins the Trainer builds for its ``precision=`` flags, and how each becomes a sharded one.
_CONVERSIONS: dict[type, Callable[[Any], Precision]] = {
    Precision: lambda plugin: ShardedPrecision(),
    DoublePrecision: lambda plugin: ShardedDoublePrecision(),
    HalfPrecision: lambda plugin: ShardedHalfPrecision(plugin.precision),
    MixedPrecision: lambda plugin: ShardedMixedPrecision(plugin.precision, plugin.device, plugin.scaler),
}


def to_sharded_precision(plugin: Precision) -> Precision:
    """``plugin`` as the matching sharded plugin; already sharded ones are returned as they are.

    Raises ``TypeError`` for other plugins (a subclass with behaviour of its own, quantisation or
    XLA plugins): their clipping would not see every rank's gradients.
    """
    if isinstance(plugin, _GlobalNormClipping):
        return plugin
    convert = _CONVERSIONS.get(type(plugin))
    if convert is None:
        raise TypeError(
            f"sharded strategies support the precision plugins {', '.join(c.__name__ for c in _CONVERSIONS)} "
            f"(precision='32-true', '64-true', '16-true', 'bf16-true', '16-mixed', 'bf16-mixed'), got "
            f"{type(plugin).__qualname__}; build your plugin on sharded.lightning.precision's classes "
            "(e.g. subclass ShardedMixedPrecision) so that gradient clipping sees every rank's shard"
        )
    return convert(plugin)
