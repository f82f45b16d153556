"""Wait for each module's updated parameters just before the module needs them.

With ``ShardedDataParallel(overlap_param_broadcast=True)``, ``OSS.step()`` starts the broadcasts
of the new parameter values and returns; they complete while the next forward runs. A forward
pre-hook on every module that holds parameters waits only for the broadcast buckets holding
*its* parameters, so the first layers compute while the last ones are still arriving. A state
dict pre-hook on the same modules makes ``state_dict()`` (and so checkpoints) wait too, and so does a
``load_state_dict()`` pre-hook, so that a broadcast still in flight cannot overwrite what it loads.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from .broadcaster import ParamBroadcaster

__all__ = ["ParamWaits"]


class ParamWaits:
    """The hooks that complete the deferred broadcasts of ``broadcasters`` on use (one per optimizer)."""

    def __init__(self, module: nn.Module, broadcasters: Sequence[ParamBroadcaster]) -> None:
        self._broadcasters = tuple(broadcasters)
        self._handles: list[Any] = []
        # A compiled module runs its submodules inside one graph: a wait there would break it,
        # so the whole module waits for everything before it runs instead.
        self._wait_all_first = isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
        if not self._wait_all_first:
            for sub in module.modules():
                own = tuple(sub.parameters(recurse=False))
                if own:
                    self._hook(sub, own)
        for broadcaster in self._broadcasters:
            broadcaster.defer_waits = True

    def _hook(self, sub: nn.Module, own: tuple[torch.Tensor, ...]) -> None:
        @torch.compiler.disable
        def wait_for_own(*_: Any) -> None:
            for broadcaster in self._broadcasters:
                broadcaster.wait_for(own)

        self._handles.append(sub.register_forward_pre_hook(lambda m, args: wait_for_own()))
        self._handles.append(sub.register_state_dict_pre_hook(lambda m, prefix, keep_vars: wait_for_own()))
        # A load must land after the broadcast, or the broadcast would overwrite what it loaded.
        self._handles.append(sub.register_load_state_dict_pre_hook(lambda m, *args: wait_for_own()))

    def before_forward(self) -> None:
        """Called by the wrapper before the module runs (waits for all only when compiled)."""
        if self._wait_all_first:
            self.wait_all()

    def wait_all(self) -> None:
        for broadcaster in self._broadcasters:
            broadcaster.wait()

    def remove(self) -> None:
        """Complete what is in flight and go back to waiting at the end of each step."""
        self.wait_all()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for broadcaster in self._broadcasters:
            broadcaster.defer_waits = False
