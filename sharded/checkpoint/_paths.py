"""Nested state dicts addressed by paths, as DCP flattens them.

DCP saves a nested state dict as flat entries and records for each the path it came from: dict
keys (as strings) and list indices, e.g. ``("optim", "param_groups", 0, "lr")``. These helpers
walk, list and build nested dicts and lists by such paths.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, MutableMapping, Union

import torch

__all__ = ["KeyPath", "LoadIfSaved", "covered", "leaves", "lookup", "nest", "optional", "reaches", "set_at", "value_at"]

KeyPath = tuple[Union[str, int], ...]
_MISSING = object()


class LoadIfSaved(dict):
    """A template entry the checkpoint may lack: whatever was saved below it is loaded into it,
    and nothing below it is required (state that exists only for some runs or world sizes, such
    as low-bit error-feedback residuals, one entry per rank)."""


def optional(root: Any, path: KeyPath) -> bool:
    """Whether ``path`` runs through a :class:`LoadIfSaved` entry of ``root``."""
    node = root
    for part in path:
        if isinstance(node, LoadIfSaved):
            return True
        node = lookup(node, part)
        if node is _MISSING:
            return False
    return False


def lookup(node: Any, part: Union[str, int]) -> Any:
    """``node``'s child at ``part``, or ``_MISSING``. Dict keys match as strings, as DCP saves them."""
    if isinstance(node, Mapping):
        if part in node:
            return node[part]
        return next((value for key, value in node.items() if str(key) == str(part)), _MISSING)
    if isinstance(node, (list, tuple)) and isinstance(part, int) and part < len(node):
        return node[part]
    return _MISSING


def reaches(root: Any, path: KeyPath) -> bool:
    """Whether ``root`` has a place for the value at ``path``: every step exists, or the walk
    ends early at a plain value (which the saved, more detailed entries will replace)."""
    node = root
    for part in path:
        if not isinstance(node, (Mapping, list, tuple)) or isinstance(node, LoadIfSaved):
            return True
        node = lookup(node, part)
        if node is _MISSING:
            return False
    return True


def value_at(root: Any, path: KeyPath) -> Any:
    """The value at ``path`` below ``root``, or ``None`` where there is none."""
    node = root
    for part in path:
        node = lookup(node, part)
        if node is _MISSING:
            return None
    return node


def leaves(node: Any, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """The values DCP saves as separate entries: inside dicts, and inside lists that hold
    containers or tensors (other lists, and tuples, are saved whole)."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from leaves(value, path + (str(key),))
    elif isinstance(node, list) and any(isinstance(v, (Mapping, list, torch.Tensor)) for v in node):
        for index, value in enumerate(node):
            yield from leaves(value, path + (index,))
    elif path:
        yield path, node


def covered(leaf: KeyPath, saved: Iterable[KeyPath]) -> bool:
    """Whether a saved path holds ``leaf``: the same path, one above it, or ones below it."""
    return any(leaf[: len(p)] == p or p[: len(leaf)] == leaf for p in saved)


def set_at(root: MutableMapping[str, Any], path: KeyPath, value: Any) -> None:
    """Set ``value`` at ``path`` below ``root``, making the dicts and lists on the way."""
    node: Any = root
    for part, following in zip(path, path[1:]):
        child = lookup(node, part)
        if not isinstance(child, (MutableMapping, list)):
            child = [] if isinstance(following, int) else {}
            _put(node, part, child)
        node = child
    _put(node, path[-1], value)


def nest(values: Mapping[KeyPath, Any]) -> dict[str, Any]:
    """A nested dict holding ``values`` at their paths."""
    nested: dict[str, Any] = {}
    for path, value in values.items():
        set_at(nested, path, value)
    return nested


def _put(node: Any, part: Union[str, int], value: Any) -> None:
    if isinstance(node, MutableMapping):
        key = next((k for k in node if str(k) == str(part)), part) if part not in node else part
        node[key] = value
    else:
        index = int(part)
        node.extend([None] * (index + 1 - len(node)))
        node[index] = value
