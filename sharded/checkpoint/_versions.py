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
strides. So the index reader (``_storage``, which imports DCP; this module does not, as ``save``
imports it) rebuilds such properties with the fields this torch knows and drops the strides; any
other field it does not know stops the load with an error naming the writer's and the reader's
torch versions (see :func:`version_note`), never a trace from inside DCP.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["VERSIONS_FILE", "record_writer", "version_note", "written_by"]

VERSIONS_FILE = ".sharded-versions.json"


def record_writer(directory: Path) -> None:
    """Write the versions file into ``directory`` (one rank), durably."""
    # the package is loaded (this module is part of it); read its version without importing it
    # from a layer below the package's __init__
    version = getattr(sys.modules["sharded"], "__version__", "unknown")
    path = directory / VERSIONS_FILE
    with open(path, "w") as stream:
        json.dump({"torch": torch.__version__, "sharded": version}, stream)
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
