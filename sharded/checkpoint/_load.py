"""Loading a checkpoint into a sharded-form state dict: validated first, then all or nothing.

The state dict passed in is the template: it says what this rank wants. Its ``model`` keys, its
param groups and any extra entries (a step counter, a scaler's state) must be in the checkpoint;
under ``optim.state`` it lists the parameters whose optimizer state this rank keeps, and each
gets whatever the checkpoint holds for it, whichever rank wrote it and at whatever world size:
that is the resharding. Nothing in the template changes until every rank has read everything:

1. every rank reads the index and checks the data files are whole (agreed: all or none go on);
2. keys and shapes are checked against the index (the same verdict on every rank);
3. DCP reads the non-tensor values; the param groups and optimizer classes are checked;
4. DCP reads the tensors into fresh staging tensors (on the CPU, or DTensors like the model's),
   or straight into the template's placeholder optimizer state, which nothing uses yet;
5. the staged values replace the template's.
"""

from __future__ import annotations

import os
import warnings
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, MutableMapping, Optional, Union

import torch
import torch.distributed as dist

from .._common.dtensors import is_dtensor
from .._common.errors import on_rank
from .._owners.optim_state import check_state_shapes
from ._fit_checks import CheckpointError, check_entries, check_param_groups
from ._paths import KeyPath, covered, leaves, nest, optional, reaches, set_at, value_at
from ._placeholders import is_unfilled, mark_unfilled
from ._ranks import Ranks

if TYPE_CHECKING:
    from ._storage import Index, VerifyingReader

__all__ = ["load"]

_OPTIM_STATE = ("optim", "state")
_OPTIM_DESCRIPTION = (("optim", "param_groups"), ("optim", "classes"))


def load(
    state: MutableMapping[str, Any],
    checkpoint_id: Union[str, os.PathLike],
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    strict: bool = True,
) -> None:
    """Fill ``state`` (from :func:`get_state_dict`, plus any extra entries) from the checkpoint
    in directory ``checkpoint_id``, whatever world size or layer saved it. Collective.

    Then pass ``state`` to :func:`set_state_dict`. A checkpoint that is damaged, incomplete or
    saved for another model or optimizer raises :class:`CheckpointError` naming the file or key
    on every rank, and ``state`` is left as it was. ``strict=False`` treats the model's keys as
    ``module.load_state_dict(strict=False)`` does: those the checkpoint lacks keep their values,
    saved ones the model lacks are skipped (shared keys must still have the same shapes).
    """
    from ._storage import VerifyingReader, read_index

    ranks = Ranks(process_group)
    ranks.require_numpy()
    directory = Path(checkpoint_id)
    source = f"checkpoint {directory}"
    index = ranks.agree(lambda: read_index(directory), f"reading {directory}")
    _check_keys_and_shapes(state, index, source, strict)
    wanted = [key for key, path in index.paths.items() if _wants(state, path)]
    reader = VerifyingReader(directory)
    objects = _read({key: None for key in wanted if key not in index.tensors}, reader, ranks)
    if "optim" in state:
        _check_optimizer(state["optim"], index, objects, source)
    staging = {key: _staging_tensor(state, index, key) for key in wanted if key in index.tensors}
    placeholders = [tensor for tensor in staging.values() if is_unfilled(tensor)]
    try:
        tensors = _read(staging, reader, ranks)
    except BaseException:
        for tensor in placeholders:  # what was read into them is incomplete: still unfilled
            mark_unfilled(tensor)
        raise
    _commit(state, {index.paths[key]: value for key, value in chain(objects.items(), tensors.items())})


def _wants(state: Mapping[str, Any], path: KeyPath) -> bool:
    """Whether this rank loads the entry at ``path``: optimizer state of the parameters it keeps,
    all param groups, and whatever else its template has a place for."""
    if path[:2] == _OPTIM_STATE:
        return len(path) > 2 and path[2] in state.get("optim", {}).get("state", {})
    if path[:2] in _OPTIM_DESCRIPTION:
        return "optim" in state
    return reaches(state, path)


# ----------------------------------------------------------------------------- checking


def _check_keys_and_shapes(state: Mapping[str, Any], index: Index, source: str, strict: bool) -> None:
    """From the index alone: the model's keys (all, or the shared ones unless ``strict``) and
    shapes, the shapes of the optimizer state, and that every other entry of the template was
    saved, with its shape."""
    shapes = {path: index.tensors[key][0] if key in index.tensors else None for key, path in index.paths.items()}
    model = state.get("model")
    if model is not None:
        saved = {str(p[1]): shape if len(p) == 2 else None for p, shape in shapes.items() if p[0] == "model" and len(p) > 1}
        expected = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in model.items()}
        if not strict:
            saved, expected = {k: s for k, s in saved.items() if k in expected}, {k: s for k, s in expected.items() if k in saved}
        check_entries(expected, saved, "model", source)
        for path, shape in shapes.items():
            param = model.get(path[2]) if path[:2] == _OPTIM_STATE and len(path) == 4 else None
            if isinstance(param, torch.Tensor):
                check_state_shapes({str(path[3]): shape}, tuple(param.shape), str(path[2]), source, CheckpointError)
    extras = [(path, value) for path, value in leaves(state) if path[0] not in ("model", "optim") and not optional(state, path)]
    missing = [".".join(map(str, path)) for path, _ in extras if not covered(path, shapes)]
    if missing:
        raise CheckpointError(on_rank(f"{source} lacks {', '.join(missing)}; nothing was loaded"))
    for path, value in extras:
        if isinstance(value, torch.Tensor) and shapes.get(path, tuple(value.shape)) != tuple(value.shape):
            raise CheckpointError(on_rank(
                f"{source}: '{'.'.join(map(str, path))}' was saved with shape {shapes[path]}, here it "
                f"has {tuple(value.shape)}; nothing was loaded"
            ))


def _check_optimizer(expected: Mapping[str, Any], index: Index, objects: Mapping[str, Any], source: str) -> None:
    """The saved param groups and optimizer classes against the template's."""
    saved = nest({index.paths[key][1:]: value for key, value in objects.items() if index.paths[key][0] == "optim"})
    saved["state"] = {path[2]: None for path in index.paths.values() if path[:2] == _OPTIM_STATE and len(path) > 2}
    check_param_groups(saved, expected, source)


# ------------------------------------------------------------------------------ reading


def _staging_tensor(state: Mapping[str, Any], index: Index, key: str) -> torch.Tensor:
    """A tensor to read ``key`` into: the template's placeholder for it when it has one of the
    saved shape and dtype (no second copy of the optimizer state), else a fresh one: a DTensor
    laid out like the model's own when that is one (each rank then reads only its shard), or a
    CPU tensor of the saved shape."""
    shape, dtype = index.tensors[key]
    path = index.paths[key]
    placeholder = value_at(state, path)
    if is_unfilled(placeholder) and tuple(placeholder.shape) == shape and placeholder.dtype == dtype:
        return placeholder
    fqn = path[2] if path[:2] == _OPTIM_STATE else path[-1]
    like = state.get("model", {}).get(fqn) if path[0] in ("model", "optim") else None
    if isinstance(like, torch.Tensor) and is_dtensor(like) and tuple(like.shape) == shape:
        return torch.empty_like(like, dtype=dtype)
    return torch.empty(shape, dtype=dtype)


def _read(flat: dict[str, Any], reader: VerifyingReader, ranks: Ranks) -> dict[str, Any]:
    """DCP reads ``flat`` in place (collective: every rank takes part, even with nothing to read)."""
    import torch.distributed.checkpoint as dcp

    from ._storage import DataOnlyPlanner

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(flat, storage_reader=reader, planner=DataOnlyPlanner(), process_group=ranks.group, no_dist=not ranks.distributed)
    except dcp.CheckpointException as error:
        raise CheckpointError(_describe_failures(error, ranks.rank)) from None
    return flat


def _describe_failures(error: BaseException, group_rank: int) -> str:
    """One line per failed rank (numbered in the checkpoint's process group, as DCP collects
    them), from DCP's collected exceptions (ours already name file and key)."""
    failures = getattr(error, "failures", None) or {}
    lines = [
        str(wrapped[0]) if isinstance(wrapped[0], CheckpointError) else f"rank {r}: {wrapped[0]!r}"
        for r, wrapped in sorted(failures.items())
    ]
    return on_rank("reading the checkpoint failed, nothing was loaded: " + "; ".join(lines or [str(error)]), group_rank)


def _commit(state: MutableMapping[str, Any], values: Mapping[KeyPath, Any]) -> None:
    """Put the loaded values into ``state``; the optimizer's entries are replaced wholesale."""
    optim = state.get("optim")
    if isinstance(optim, MutableMapping):
        optim["state"] = {fqn: {} for fqn in optim.get("state", {})}
        optim["param_groups"] = []
        optim.pop("classes", None)
    for path, value in values.items():
        set_at(state, path, value)
