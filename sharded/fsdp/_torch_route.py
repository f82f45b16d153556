"""Route torch's ``fully_shard`` to ``sharded.fully_shard``, and back.

Frameworks do not take an FSDP implementation as an argument: they call torch's
``fully_shard`` by name. Accelerate imports it from ``torch.distributed.fsdp`` inside the
function that wraps the model, at call time; Megatron-Core and torchtitan import it into their own
module when they are imported, and call that module attribute. Replacing the attribute wherever
such a call looks it up makes those frameworks shard with ours, and putting the original back
makes them torch's again. :func:`use_for_torch_fsdp` does that for torch's public paths (and any
client modules named), and its handle, :class:`TorchFSDPRoute`, undoes exactly what it did.

Only ``fully_shard`` is routed. ``FSDPModule`` needs nothing: the modules ours returns are
instances of torch's ``FSDPModule``, so ``isinstance`` checks and torch's
``register_fsdp_forward_method`` work on them. Torch's FSDP1 class ``FullyShardedDataParallel``
is not routed: torch's own checkpoint and state-dict code checks ``isinstance`` against it and
calls its class-level API (``state_dict_type``, ``optim_state_dict``, ``fsdp_modules``...), which
``sharded.FullyShardedDataParallel`` (a wrapper on ``fully_shard``, not a subclass of torch's)
does not offer; code written for FSDP1 should construct ``sharded.FullyShardedDataParallel``
itself.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any, Iterable, Optional, Union

from .._common.errors import on_rank
from .api import fully_shard

__all__ = ["use_for_torch_fsdp", "TorchFSDPRoute", "TORCH_PATHS"]

TORCH_PATHS = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
"""Torch's modules whose ``fully_shard`` attribute is routed (those of them this torch has)."""

# Where torch's fully_shard is defined. It is left alone: torch's function looks itself up there
# on every call (``fully_shard.state(module)``), so replacing it would break torch's own
# fully_shard for any caller that kept it.
_TORCH_DEFINITION = "torch.distributed.fsdp._fully_shard._fully_shard"
_torch_fully_shard = importlib.import_module(_TORCH_DEFINITION).fully_shard

_routes: list[TorchFSDPRoute] = []  # the routes in place, innermost last
_lock = threading.Lock()


@dataclass(frozen=True)
class _Swap:
    """One module attribute replaced by ours, and what it held before."""

    module: ModuleType
    previous: Any

    @property
    def path(self) -> str:
        return f"{self.module.__name__}.fully_shard"


class TorchFSDPRoute:
    """Torch's ``fully_shard`` names routed to ``sharded.fully_shard``, until :meth:`restore`.

    Returned by :func:`use_for_torch_fsdp`. Use it as a context manager, or call
    :meth:`restore`. Routes nest: each restores what was there when it was made, so they must be
    restored innermost first (a ``with`` block inside another does that by itself).
    """

    def __init__(self, swaps: tuple[_Swap, ...]) -> None:
        self._swaps = swaps
        self._active = True

    @property
    def paths(self) -> tuple[str, ...]:
        """The attributes this route replaced, e.g. ``"torch.distributed.fsdp.fully_shard"``."""
        return tuple(swap.path for swap in self._swaps)

    @property
    def active(self) -> bool:
        """Whether the attributes still hold ``sharded.fully_shard`` through this route."""
        return self._active

    def restore(self) -> None:
        """Put back what every replaced attribute held when this route was made.

        Restoring a route a second time does nothing (so ``restore()`` inside its own ``with``
        block is fine). Raises ``RuntimeError``, changing nothing, if a route made after this one
        is still in place (restore that first), or if a replaced attribute no longer holds ours
        (something else replaced it since; putting torch's back would discard that).
        """
        with _lock:
            if not self._active:
                return
            if _routes[-1] is not self:
                later = len(_routes) - 1 - _routes.index(self)
                raise RuntimeError(on_rank(
                    f"use_for_torch_fsdp: a route is restored while {later} route(s) made after it "
                    "are still in place; restore those first (innermost first, as nested `with` "
                    "blocks do)"))
            for swap in self._swaps:
                now = getattr(swap.module, "fully_shard", None)
                if now is not fully_shard:
                    raise RuntimeError(on_rank(
                        f"use_for_torch_fsdp: {swap.path} is {_describe(now)} now, no longer "
                        "sharded.fully_shard: something replaced it after the route was made, and "
                        "restoring would discard that; put sharded.fully_shard back there first"))
            for swap in reversed(self._swaps):
                setattr(swap.module, "fully_shard", swap.previous)
            _routes.pop()
            self._active = False

    def __enter__(self) -> TorchFSDPRoute:
        if not self._active:
            raise RuntimeError(on_rank("use_for_torch_fsdp: this route was restored already; "
                                       "call use_for_torch_fsdp() again for a new one"))
        return self

    def __exit__(self, kind: Optional[type[BaseException]], error: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "active" if self._active else "restored"
        return f"TorchFSDPRoute({state}: {', '.join(self.paths)})"


def use_for_torch_fsdp(also_in: Iterable[Union[ModuleType, str]] = ()) -> TorchFSDPRoute:
    """Make code that calls torch's ``fully_shard`` by name call ``sharded.fully_shard``.

    Replaces the ``fully_shard`` attribute of ``torch.distributed.fsdp``,
    ``torch.distributed.fsdp._fully_shard``, ``torch.distributed._composable.fsdp`` and
    ``torch.distributed._composable.fsdp.fully_shard`` (those this torch has) by ours, in this
    process: call it on every rank before the framework wraps the model. Code that looks the name
    up afterwards (``from torch.distributed.fsdp import fully_shard`` inside a function, as
    Accelerate does) gets ours. A module that imported the name *before* (Megatron-Core's
    ``megatron.core.distributed.torch_fully_sharded_data_parallel``, torchtitan's
    ``torchtitan.distributed.fsdp``) holds its own reference to torch's function and keeps it,
    unless it is named in ``also_in``.

    The modules ours returns are instances of torch's ``FSDPModule`` already, so that name is not
    replaced; nor is torch's FSDP1 ``FullyShardedDataParallel`` (a class torch's own checkpoint
    code checks for and calls into; build ``sharded.FullyShardedDataParallel`` instead). Torch's
    ``fully_shard`` stays callable where it was imported before, and in
    ``torch.distributed.fsdp._fully_shard._fully_shard`` where torch defines it (and finds it).

    Returns a :class:`TorchFSDPRoute` that puts back exactly what was there: use it as a context
    manager, ``with sharded.use_for_torch_fsdp(): ...``, or call ``route.restore()``.

    Args:
        also_in: client modules (or their dotted names, imported here) whose ``fully_shard``
            attribute is torch's function, bound when they imported it; it is replaced too, and
            restored with the rest. ``ValueError`` if such a module has no ``fully_shard`` or it
            holds something other than torch's (or, under an outer route, ours).
    """
    torch_modules = _torch_modules()
    clients = [_client_module(entry) for entry in _as_entries(also_in)]
    with _lock:
        for module in torch_modules:
            _check_torch_module(module)
        for module in clients:
            _check_client_module(module)
        unique = {id(module): module for module in torch_modules + clients}.values()
        swaps = tuple(_Swap(module, module.fully_shard) for module in unique)
        for swap in swaps:
            setattr(swap.module, "fully_shard", fully_shard)
        route = TorchFSDPRoute(swaps)
        _routes.append(route)
    return route


def _torch_modules() -> list[ModuleType]:
    """Those of torch's :data:`TORCH_PATHS` this torch has, imported here (code that imports one
    later must find ours there)."""
    found = []
    for path in TORCH_PATHS:
        try:
            found.append(importlib.import_module(path))
        except ModuleNotFoundError:
            continue
    return [module for module in found if hasattr(module, "fully_shard")]


def _as_entries(also_in: Iterable[Union[ModuleType, str]]) -> list[Union[ModuleType, str]]:
    if isinstance(also_in, (str, ModuleType)):  # one module where a sequence of them belongs
        return [also_in]
    return list(also_in)


def _client_module(entry: Union[ModuleType, str]) -> ModuleType:
    """The module an ``also_in`` entry names (imported if given by name)."""
    if isinstance(entry, str):
        try:
            entry = importlib.import_module(entry)
        except ModuleNotFoundError as error:
            raise ValueError(on_rank(f"use_for_torch_fsdp(also_in=...): cannot import {entry!r}: {error}")) from error
    if not isinstance(entry, ModuleType):
        raise TypeError(on_rank(f"use_for_torch_fsdp(also_in=...): {entry!r} (a {type(entry).__name__}) is "
                                "neither a module nor a module's dotted name"))
    if entry.__name__ == _TORCH_DEFINITION:
        raise ValueError(on_rank(
            f"use_for_torch_fsdp(also_in=...): {_TORCH_DEFINITION} is where torch defines fully_shard, "
            "and torch's function looks itself up there on every call; replacing it would break "
            "torch's fully_shard wherever it is still called. Its public paths are routed already"))
    return entry


def _replaceable(value: Any) -> bool:
    """Only torch's ``fully_shard`` is replaced (or ours, under an outer route): anything else
    is someone's own function, which routing would silently discard."""
    return value is _torch_fully_shard or value is fully_shard


def _check_torch_module(module: ModuleType) -> None:
    if not _replaceable(module.fully_shard):
        raise RuntimeError(on_rank(
            f"use_for_torch_fsdp: {module.__name__}.fully_shard is {_describe(module.fully_shard)}, "
            "not torch's fully_shard: another tool replaced it; restore torch's first"))


def _check_client_module(module: ModuleType) -> None:
    if not hasattr(module, "fully_shard"):
        raise ValueError(on_rank(f"use_for_torch_fsdp(also_in=...): module {module.__name__} has no "
                                 "attribute fully_shard to replace"))
    if not _replaceable(module.fully_shard):
        raise ValueError(on_rank(
            f"use_for_torch_fsdp(also_in=...): {module.__name__}.fully_shard is "
            f"{_describe(module.fully_shard)}, not torch's fully_shard; only torch's is replaced"))


def _describe(value: Any) -> str:
    name = getattr(value, "__qualname__", None)
    where = getattr(value, "__module__", None)
    return f"{where}.{name}" if name and where else repr(value)
