"""torch's ``ZeroRedundancyOptimizer`` interface on sharded's layer-1 engine.

Code written for ``torch.distributed.optim.ZeroRedundancyOptimizer`` (Lightning and Fabric
consolidating it at a checkpoint, pytorch-ignite's ``Checkpoint`` branching on ``isinstance``,
mmengine's subclass, torch's ``Join``) keeps working when the class is swapped for
:class:`ZeroRedundancyOptimizer`: same constructor, same methods, an instance of torch's class.
Everything it does runs on :class:`sharded.OSS`'s engine (one partition, one broadcaster, one
state-dict path); torch's own constructor never runs, so none of torch's partition, buckets or
state exist beside ours.

Imported on first use of ``sharded.ZeroRedundancyOptimizer``: ``torch.distributed.optim`` brings in
torch's FSDP and functional optimizers, which ``import sharded`` does not pay for.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as _TorchZeroRedundancyOptimizer
from torch.optim import Optimizer

from ._common import comm
from ._common.checks import check_optimizer_class
from ._common.lowbit import LowBit
from ._owners.step_cost import ParamCost
from .oss import OSS

__all__ = ["ZeroRedundancyOptimizer"]


# OSS._overlap_with_ddp is a property that refuses torch's DDP hooks (they read it first); torch's
# class declares it as a plain attribute, hence the override mypy flags.
class ZeroRedundancyOptimizer(OSS, _TorchZeroRedundancyOptimizer):  # type: ignore[override]
    """``torch.distributed.optim.ZeroRedundancyOptimizer``'s interface, with ``OSS`` behind it.

    Swap ``from torch.distributed.optim import ZeroRedundancyOptimizer`` for ``from sharded import
    ZeroRedundancyOptimizer``; nothing else changes. ``isinstance(opt,
    torch.distributed.optim.ZeroRedundancyOptimizer)`` holds, so code that branches on torch's class
    takes the same branch. The results are torch's: the owner of each parameter steps it with the
    plain optimizer and broadcasts it, so parameters after a step equal torch's (and DDP + the plain
    optimizer's) bit for bit, and ``consolidate_state_dict(to)`` then ``state_dict()`` on rank ``to``
    gives the plain optimizer's state dict (loadable by a plain optimizer, and into this one at any
    world size).

    It is an :class:`sharded.OSS` (the class derives from both; ``OSS``'s methods come first), so
    what OSS adds is there: frozen parameters balanced apart from trainable ones,
    :meth:`~sharded.OSS.clip_grad_norm` by the global norm, ``param_cost`` (Newton-Schulz costs
    for Muon by default), :meth:`~sharded.OSS.refresh_trainable`, resharding checkpoints through
    :mod:`sharded.checkpoint`, ``ShardedDataParallel`` for ZeRO-2. Which rank owns which parameter
    differs from torch's sorted-greedy placement; results do not.

    Args:
        params: an iterable of tensors or of param-group dicts.
        optimizer_class: the optimizer to shard, e.g. ``torch.optim.AdamW``.
        process_group: the process group to shard over (default: the whole world).
        parameters_as_bucket_view: ``False`` (torch's default): each parameter keeps its own
            storage (``p.data_ptr()`` is unchanged), and every step packs the parameters that
            share a broadcast bucket into a message and unpacks them; ``True``: the trainable
            parameters become views of the buckets, which are sent as they are (``OSS``'s
            default). ``sharded.estimate_memory`` says what each costs.
        overlap_with_ddp: run each DDP bucket's owned parameters' step as that bucket's
            all-reduce completes, driven by ``sharded.hook_with_zero_step`` (torch's
            ``ddp_zero_hook`` functions refuse this class and name ours; see
            :class:`sharded.OSS`'s ``overlap_with_ddp``).
        param_cost: keyword-only, as :class:`sharded.OSS`'s.
        lowbit: keyword-only, as :class:`sharded.OSS`'s (parameters broadcast in fewer bits);
            never taken for a hyperparameter of ``optimizer_class``.
        **defaults: the optimizer's hyperparameters (``lr``, ``betas``, ...).
    """

    _recipient_argument = "to"

    def __init__(
        self,
        params: Union[Iterable[torch.Tensor], Iterable[dict[str, Any]]],
        optimizer_class: type[Optimizer],
        process_group: Optional[Any] = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        param_cost: Optional[ParamCost] = None,
        lowbit: Optional[LowBit] = None,
        **defaults: Any,
    ) -> None:
        check_optimizer_class(optimizer_class, "optimizer_class")
        OSS.__init__(
            self,
            params,
            optimizer_class,
            group=process_group,
            param_cost=param_cost,
            parameters_as_bucket_view=parameters_as_bucket_view,
            overlap_with_ddp=overlap_with_ddp,
            lowbit=lowbit,
            **defaults,
        )

    def consolidate_state_dict(self, to: int = 0) -> None:  # type: ignore[override]
        """Gather the full optimizer state on rank ``to`` of the process group (``-1``: on
        every rank). Collective: every rank calls it. Afterwards :meth:`state_dict` on that rank
        returns the plain optimizer's state dict, until the next ``step()``."""
        self._consolidate_on(to)

    # What torch's class holds in attributes that its own helpers (its tests' join hooks) and
    # clients read, derived here from OSS's state.

    @property
    def process_group(self) -> Any:
        """The process group the state is sharded over (torch's name for ``OSS.group``)."""
        return self.group

    @property
    def _all_params(self) -> list[torch.Tensor]:
        """Every parameter, in param-group order (torch's tests and join hooks read it)."""
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def _default_device(self) -> torch.device:
        """The device torch's class communicates from: its first parameter's."""
        params = self._all_params
        return params[0].device if params else comm.comm_device(self.group)
