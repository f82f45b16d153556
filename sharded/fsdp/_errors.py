"""How layer 3 words errors: every message starts with the rank that raised it, so that one
rank's failure in a multi-rank log is never mistaken for another's."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["on_rank"]


def on_rank(message: str) -> str:
    """``message`` prefixed with this process's global rank (``rank ?`` before the process group
    exists)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else "?"
    return f"rank {rank}: {message}"
