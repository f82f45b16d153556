"""Checks every optimizer step runs first, each installed once per process.

torch's global ``register_optimizer_step_pre_hook`` reaches every optimizer, whoever built it:
the place to refuse a step that would silently train the wrong thing (an optimizer holding
parameters ``fully_shard`` replaced; gradients a ``MicroBatches`` loop left half summed). Each
layer states its check; this module only makes sure it is registered once.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["install_step_check"]

StepCheck = Callable[[Any, Any, Any], None]  # (optimizer, args, kwargs): raises to refuse the step

_lock = threading.Lock()
_installed: set[StepCheck] = set()


def install_step_check(check: StepCheck) -> None:
    """Run ``check(optimizer, args, kwargs)`` before every optimizer step from now on (once,
    however often this is called with the same function)."""
    with _lock:
        if check not in _installed:
            register_optimizer_step_pre_hook(check)
            _installed.add(check)
