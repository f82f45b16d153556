"""torch's own functions routed to sharded's, each route installed once per process.

A layer that must make a torch function right over its parameters (``clip_grad_norm_`` over
``ShardedDataParallel``'s owner-reduced gradients, or over ``fully_shard``'s owner-placed ones)
replaces torch's module attribute by a wrapper around the function it finds there. Installing a
wrapper twice would wrap it twice, so every route goes through :func:`install_route`; two layers'
routes of the same function stack, each handing what it does not claim to the one beneath.
"""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["install_route"]

_lock = threading.Lock()
_installed: set[Callable[[], None]] = set()


def install_route(install: Callable[[], None]) -> None:
    """Call ``install()`` the first time this function is called with it; later calls do nothing."""
    with _lock:
        if install not in _installed:
            install()
            _installed.add(install)
