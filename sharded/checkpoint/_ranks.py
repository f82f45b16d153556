"""The ranks a save or load runs on, and how they agree that a step succeeded everywhere.

A step that can fail on one rank only (a file it cannot read, a directory it cannot create)
is followed by a tiny all-gather of success flags: either every rank goes on, or every rank
raises. Without it, the ranks that succeeded would wait in the next collective for one that
has given up, until the process group's timeout.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch.distributed as dist

from .._common import comm
from .._common.errors import on_rank
from ._fit_checks import CheckpointError

__all__ = ["Ranks"]

T = TypeVar("T")


class Ranks:
    """The process group of one save or load; a single process when none is initialized.

    ``rank`` counts in that group (rank 0 of the group publishes a save); error messages give
    the global rank, and this one beside it where it differs.
    """

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None or not self.distributed else dist.group.WORLD
        self.rank = comm.group_rank(self.group) if self.distributed else 0
        self.size = comm.group_size(self.group) if self.distributed else 1

    def require_numpy(self) -> None:
        """Raise (on every rank alike) if DCP's object collectives cannot work here.

        DCP exchanges its plans with ``gather_object`` and friends, which need numpy on this
        torch; without it one rank fails mid-collective and the others wait for it.
        """
        if self.size == 1:
            return
        try:
            import numpy  # noqa: F401
        except ImportError:
            raise ImportError(on_rank(
                "torch.distributed.checkpoint needs numpy to save or load on more than one rank "
                "(its object collectives use it); pip install numpy",
                self.rank,
            )) from None

    def agree(self, step: Callable[[], T], what: str) -> T:
        """Run ``step`` here; raise on every rank if it raised on any (collective)."""
        try:
            result = step()
        except Exception:
            self._vote(succeeded=False, what=what)
            raise
        self._vote(succeeded=True, what=what)
        return result

    def _vote(self, succeeded: bool, what: str) -> None:
        """Share this rank's outcome; raise here if this rank succeeded but another did not."""
        if self.size == 1:
            return
        flags = comm.all_gather_lengths(int(succeeded), self.group)
        failed = [comm.global_rank(self.group, r) for r, ok in enumerate(flags) if not ok]
        if succeeded and failed:
            raise CheckpointError(on_rank(f"{what} failed on rank(s) {failed}; see their errors", self.rank))
