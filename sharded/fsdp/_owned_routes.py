"""torch's own functions routed to sharded's once a model places a parameter ``Owned()``:
clipping (:mod:`._torch_clip`), whole tensors (:mod:`._torch_whole`) and full state dicts
(:mod:`._torch_state_dict`). Each wraps the function it finds, so it must be installed once per
process (:func:`sharded._common.torch_routes.install_route`).
"""

from __future__ import annotations

from .._common.torch_routes import install_route
from ._torch_clip import route_torch_clip_for_owned
from ._torch_state_dict import route_torch_state_dict_for_owned
from ._torch_whole import route_torch_whole_for_owned

__all__ = ["route_torch_for_owned"]


def route_torch_for_owned() -> None:
    """Install every route, once per process (later calls do nothing)."""
    install_route(_install_every_route)


def _install_every_route() -> None:
    route_torch_clip_for_owned()
    route_torch_whole_for_owned()
    route_torch_state_dict_for_owned()
