"""Does a checkpoint fit the model and optimizers it is loaded into? Errors that say why.

Every check here runs before anything is loaded and depends only on data that is the same on
every rank (the checkpoint's index, the replicated model's FQNs and shapes, the param groups),
so all ranks reach the same verdict without talking, and none is left waiting in a collective.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

from .._common.errors import on_rank
from .._owners.optim_state import Shape

__all__ = ["CheckpointError", "check_entries", "check_filled", "check_param_groups"]

_LISTED = 6  # names quoted in one message before "and N more"


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded here: it is damaged, incomplete, or was saved for a
    different model or optimizer. Nothing was loaded."""


def check_entries(expected: Mapping[str, Shape], found: Mapping[str, Shape], what: str, source: str) -> None:
    """Raise unless ``found`` has exactly the keys of ``expected``, tensors of the same shapes.

    ``what`` names the mapping in messages (``"model"``), ``source`` where ``found`` comes from.
    """
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    mis_shaped = [
        f"{k} saved {_shape(found[k])}, here {_shape(expected[k])}"
        for k in expected
        if k in found and found[k] != expected[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing {what} keys {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected {what} keys {_listing(unexpected)}")
    if mis_shaped:
        problems.append(f"{what} shapes differ: {_listing(mis_shaped)}")
    if problems:
        raise CheckpointError(on_rank(
            f"{source} does not fit: {'; '.join(problems)}. It was saved for a different model; nothing was loaded"
        ))


def check_param_groups(saved: Mapping[str, Any], expected: Mapping[str, Any], source: str) -> None:
    """Raise unless the saved optimizer description matches the expected one.

    Both are the ``"optim"`` part of a sharded state dict: ``param_groups`` (hyperparameters and
    parameter FQNs) and, when recorded, ``classes`` (the optimizer class of each group). Groups
    correspond by position; within a group parameters match by FQN, in any order.
    """
    for key in ("param_groups", "state"):
        if key not in saved:
            raise CheckpointError(on_rank(f"{source} has no optimizer '{key}' entry"))
    saved_groups, groups = saved["param_groups"], expected["param_groups"]
    if len(saved_groups) != len(groups):
        raise CheckpointError(on_rank(
            f"{source} has {len(saved_groups)} optimizer param groups, the optimizers here have {len(groups)}"
        ))
    _check_classes(saved.get("classes"), expected.get("classes"), source)
    for g, (saved_group, group) in enumerate(zip(saved_groups, groups)):
        _check_group(g, saved_group, group, check_keys="classes" not in saved, source=source)
    known = {fqn for group in groups for fqn in group["params"]}
    strays = [fqn for fqn in saved["state"] if fqn not in known]
    if strays:
        raise CheckpointError(on_rank(
            f"{source} holds optimizer state for {_listing(strays)}, which no param group here lists; "
            "it was saved for a different model"
        ))


def check_filled(unfilled: Sequence[str], source: str) -> None:
    """Raise if parameters ``unfilled`` still hold the placeholder optimizer state that
    ``get_state_dict`` makes for an optimizer that has not stepped: nothing loaded into them,
    and taking them would silently restart the optimizer."""
    if unfilled:
        raise CheckpointError(on_rank(
            f"{source}: the optimizer state of {_listing(unfilled)} is still the placeholder "
            "get_state_dict made for an optimizer that has not stepped; no checkpoint filled it (the "
            "checkpoint lacks that state, or a partial load skipped it). Fill it with "
            "sharded.checkpoint.load or torch.distributed.checkpoint.load; nothing was loaded"
        ))


def _check_classes(saved: Optional[Sequence[str]], expected: Optional[Sequence[str]], source: str) -> None:
    if saved is None or expected is None:
        return
    for g, (theirs, ours) in enumerate(zip(saved, expected)):
        if theirs != ours:
            raise CheckpointError(on_rank(
                f"{source}: param group {g} was saved by a {theirs} optimizer, it is loaded into a "
                f"{ours}; optimizer state does not carry over between classes"
            ))


def _check_group(g: int, saved: Mapping[str, Any], group: Mapping[str, Any], check_keys: bool, source: str) -> None:
    saved_fqns, fqns = list(saved.get("params", ())), list(group["params"])
    if any(not isinstance(fqn, str) for fqn in saved_fqns):
        raise CheckpointError(on_rank(
            f"{source}: param group {g} lists parameters by position, not by FQN: that is a full "
            "(torch-format) optimizer state dict; load it with optimizer.load_state_dict()"
        ))
    saved_set, expected_set = set(saved_fqns), set(fqns)
    missing = [f for f in fqns if f not in saved_set]
    unexpected = [f for f in saved_fqns if f not in expected_set]
    if missing or unexpected:
        parts = ([f"lacks {_listing(missing)}"] if missing else []) + (
            [f"has {_listing(unexpected)} which the optimizer here does not"] if unexpected else []
        )
        raise CheckpointError(on_rank(
            f"{source}: optimizer param group {g} {' and '.join(parts)}; the model or the param "
            "groups differ from the saved ones"
        ))
    if check_keys and set(saved) != set(group):
        differing = sorted(set(saved) ^ set(group))
        raise CheckpointError(on_rank(
            f"{source}: optimizer param group {g} has hyperparameters {_listing(differing)} on one "
            "side only; it was saved by a different optimizer class"
        ))


def _shape(shape: Shape) -> str:
    return "not a tensor" if shape is None else str(tuple(shape))


def _listing(items: Iterable[str]) -> str:
    items = list(items)
    shown = ", ".join(items[:_LISTED])
    return shown + (f" and {len(items) - _LISTED} more" if len(items) > _LISTED else "")
