"""How sharded words errors: every message starts with the rank that raised it, so that one
rank's failure in a multi-rank log is never mistaken for another's."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["on_rank", "process_rank"]


def process_rank() -> int:
    """This process's global rank (0 in a process without a process group, as
    ``torch.distributed`` and Lightning number a lone process)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def on_rank(message: str) -> str:
    """``message`` prefixed with this process's global rank."""
    return f"rank {process_rank()}: {message}"
