"""Crash-safe saves: write into a hidden directory, publish it with one atomic rename.

``torch.distributed.checkpoint.save`` writes the index (``.metadata``) last, on rank 0, after
every rank's data is written. Here it writes into ``.<name>.partial`` beside the destination;
rank 0 renames that to ``<name>`` only when the save returned on every rank, and fsyncs the
parent directory. A job killed at any moment therefore leaves either the complete new checkpoint
or none under that name, and the earlier checkpoints untouched; :func:`latest_checkpoint` never
returns a partial one.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch.distributed as dist

from .._common.errors import on_rank
from ._fit_checks import CheckpointError
from ._placeholders import without_placeholders
from ._ranks import Ranks
from ._versions import record_writer

__all__ = ["latest_checkpoint", "save"]

_STEP = re.compile(r"(\d+)$")


def save(
    state: Mapping[str, Any],
    checkpoint_id: Union[str, os.PathLike],
    *,
    process_group: Optional[dist.ProcessGroup] = None,
) -> Path:
    """Save ``state`` (e.g. from :func:`get_state_dict`) with DCP as directory ``checkpoint_id``,
    visible only once complete. Collective; returns the directory.

    Every rank writes what it holds, in parallel; rank 0 holds nothing extra. Placeholder
    optimizer state (of an optimizer that has not stepped) is left out: the checkpoint holds
    only state the optimizer has. Works without an
    initialized process group too (one process). Raises ``FileExistsError`` if the directory
    exists: checkpoints are never overwritten in place.
    """
    import torch.distributed.checkpoint as dcp

    ranks = Ranks(process_group)
    ranks.require_numpy()
    final = Path(checkpoint_id)
    partial = final.with_name(f".{final.name}.partial")
    ranks.agree(lambda: _prepare(final, partial, ranks.rank), f"preparing {final}")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                without_placeholders(state),
                storage_writer=dcp.FileSystemWriter(partial),
                process_group=ranks.group,
                no_dist=not ranks.distributed,
            )
    except dcp.api.CheckpointException as error:
        raise CheckpointError(on_rank(
            f"saving {final} failed; earlier checkpoints are untouched, the partial {partial} is ignored. {error}",
            ranks.rank,
        )) from error
    ranks.agree(lambda: _publish(partial, final, ranks.rank), f"publishing {final}")
    return final


def latest_checkpoint(root: Union[str, os.PathLike]) -> Optional[Path]:
    """The complete checkpoint in ``root`` whose name ends in the largest number
    (``step-000300`` after ``step-000200``), or ``None``. Partial saves are never returned."""
    root = Path(root)
    if not root.is_dir():
        return None
    complete = [
        (int(match.group(1)), entry)
        for entry in root.iterdir()
        if not entry.name.startswith(".")
        and (match := _STEP.search(entry.name))
        and (entry / ".metadata").is_file()
    ]
    return max(complete)[1] if complete else None


def _prepare(final: Path, partial: Path, group_rank: int) -> None:
    """Refuse an existing destination; on the group's rank 0, start an empty partial directory (a
    partial left by an earlier, killed save of the same name is discarded)."""
    if final.exists():
        raise FileExistsError(on_rank(f"{final} exists; checkpoints are not overwritten, save under a new name", group_rank))
    if group_rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)


def _publish(partial: Path, final: Path, rank: int) -> None:
    """On rank 0: the one atomic step that makes the checkpoint visible, made durable."""
    if rank != 0:
        return
    record_writer(partial)
    os.rename(partial, final)
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
