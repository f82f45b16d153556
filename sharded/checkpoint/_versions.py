"""Which torch wrote a checkpoint, and reading an index that a newer torch wrote.

Every :func:`~sharded.checkpoint.save` records the writer's torch and sharded versions in
``.sharded-versions.json`` beside DCP's files (plain JSON: nothing in it is executed, and DCP's
readers ignore the file). A checkpoint written by ``torch.distributed.checkpoint.save`` itself
has no such record; it loads all the same.

DCP's index (``.metadata``) is a pickle of torch's own dataclasses, so a torch that adds a field
writes an index an older torch's classes cannot rebuild. torch 2.15 added
``TensorProperties.strides`` (the saved tensor's strides): torch 2.13 and 2.14 fail on it with
"too many values to unpack". The strides are information only for :func:`load`: every record is a
whole tensor, read with ``torch.load`` and copied element by element into its target, whatever its
strides. So the index reader rebuilds such properties with the fields this torch knows and drops
the strides; any other field it does not know stops the load with an error naming the writer's and
the reader's torch versions (see :func:`version_note`), never a trace from inside DCP.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import TensorProperties

__all__ = ["VERSIONS_FILE", "index_class", "record_writer", "version_note"]

VERSIONS_FILE = ".sharded-versions.json"
# Fields newer torch versions appended to TensorProperties' pickled state, in order, which a
# reader can drop: they describe the saved tensor, not where its elements go.
_INFORMATIONAL_PROPERTIES = ("strides",)


def record_writer(directory: Path) -> None:
    """Write the versions file into ``directory`` (one rank), durably."""
    from .. import __version__

    path = directory / VERSIONS_FILE
    with open(path, "w") as stream:
        json.dump({"torch": torch.__version__, "sharded": __version__}, stream)
        stream.flush()
        os.fsync(stream.fileno())


def written_by(directory: Path) -> Optional[dict[str, str]]:
    """The versions that wrote ``directory``, or ``None`` where it records none (or a damaged record)."""
    try:
        with open(directory / VERSIONS_FILE) as stream:
            record = json.load(stream)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not all(isinstance(record.get(key), str) for key in ("torch", "sharded")):
        return None
    return {"torch": record["torch"], "sharded": record["sharded"]}


def version_note(directory: Path) -> str:
    """What to say about versions when the index cannot be read: who wrote it and who reads it."""
    record = written_by(directory)
    if record is None:
        return (
            f"the checkpoint does not record the torch that wrote it; it is read under torch "
            f"{torch.__version__}: if another torch wrote it, load it under that one"
        )
    if record["torch"] == torch.__version__:
        return f"written and read under torch {torch.__version__}"
    return (
        f"written under torch {record['torch']} (sharded {record['sharded']}), read under torch "
        f"{torch.__version__}: load it under torch {record['torch']}"
    )


def index_class(found: type) -> type:
    """The class the index unpickler builds for ``found``: ``found`` itself, except torch's
    ``TensorProperties`` where this torch lacks a field newer ones write."""
    if found is TensorProperties and not _knows_all_informational_fields():
        return _TensorPropertiesOfNewerTorch
    return found


def _knows_all_informational_fields() -> bool:
    known = {field.name for field in dataclasses.fields(TensorProperties)}
    return all(name in known for name in _INFORMATIONAL_PROPERTIES)


class _TensorPropertiesOfNewerTorch(TensorProperties):
    """torch's ``TensorProperties``, rebuilt from the state of a newer torch's: the fields this
    torch knows, the informational ones dropped, any other raising."""

    def __setstate__(self, state: Any) -> None:
        own = _own_state_length()
        if isinstance(state, tuple) and len(state) > own:
            extra = len(state) - own
            if extra > len(_INFORMATIONAL_PROPERTIES):
                raise ValueError(
                    f"TensorProperties carries {extra} fields this torch does not know (it knows "
                    f"{', '.join(_INFORMATIONAL_PROPERTIES)} as information only)"
                )
            state = state[:own]
        super().__setstate__(state)


def _own_state_length() -> int:
    """How many values this torch's ``TensorProperties`` pickles."""
    return len(TensorProperties(dtype=torch.float32).__getstate__())
