"""How sharded words errors: every message starts with the rank that raised it, so that one
rank's failure in a multi-rank log is never mistaken for another's.

:func:`on_rank` is the only producer of that prefix, in every layer. It prints the *global* rank
(the number ``torchrun``'s ``RANK`` and Lightning's ``global_rank`` give the process), so one
process is called the same in every message whichever process group raised it. Layers 1-2 and
the checkpoint engine work in a process group of their own choosing and count owners and peers
in it; they pass their ``group_rank``, which the prefix adds where it differs from the global one.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

__all__ = ["on_rank", "process_rank"]


def process_rank() -> int:
    """This process's global rank (0 in a process without a process group, as
    ``torch.distributed`` and Lightning number a lone process)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def on_rank(message: str, group_rank: Optional[int] = None) -> str:
    """``message`` prefixed with this process's global rank: ``"rank 3: ..."``.

    ``group_rank``: this process's rank in the process group the raising code works in. Where it
    is not the global rank the prefix gives both, ``"rank 3 (rank 1 in its group): ..."``, since
    a message naming an owner or a peer rank counts in that group.
    """
    rank = process_rank()
    if group_rank is None or group_rank == rank:
        return f"rank {rank}: {message}"
    return f"rank {rank} (rank {group_rank} in its group): {message}"
