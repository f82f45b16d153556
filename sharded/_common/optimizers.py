"""What every layer needs to know about a ``torch.optim`` optimizer beyond its public API."""

from __future__ import annotations

import inspect
from typing import Any, Mapping

__all__ = ["constructor_kwargs", "hyperparams"]


def hyperparams(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's settings: everything but its ``params``."""
    return {k: v for k, v in group.items() if k != "params"}


def constructor_kwargs(optimizer_class: type, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` less the keys ``optimizer_class``'s constructor does not take.

    An optimizer's ``defaults`` can hold more than its constructor accepts (torch's ``AdamW``
    records Adam's ``decoupled_weight_decay``); the param groups carry every hyperparameter
    anyway, so rebuilding an optimizer passes only what the constructor knows.
    """
    parameters = inspect.signature(optimizer_class).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(kwargs)
    names = {p.name for p in parameters}
    return {k: v for k, v in kwargs.items() if k in names}
