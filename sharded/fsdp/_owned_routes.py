"""torch's own functions routed to sharded's once a model places a parameter ``Owned()``:
clipping (:mod:`._torch_clip`), whole tensors (:mod:`._torch_whole`) and full state dicts
(:mod:`._torch_state_dict`). Each wraps the function it finds, so it must be installed once per
process: this module is that once.
"""

from __future__ import annotations

import threading

from ._torch_clip import route_torch_clip_for_owned
from ._torch_state_dict import route_torch_state_dict_for_owned
from ._torch_whole import route_torch_whole_for_owned

__all__ = ["route_torch_for_owned"]

_lock = threading.Lock()
_routed = False


def route_torch_for_owned() -> None:
    """Install every route, once per process (later calls do nothing)."""
    global _routed
    with _lock:
        if _routed:
            return
        route_torch_clip_for_owned()
        route_torch_whole_for_owned()
        route_torch_state_dict_for_owned()
        _routed = True
