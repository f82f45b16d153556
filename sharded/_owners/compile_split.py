"""Layer 2 under ``torch.compile``: have Dynamo cut the compiled graph where reduce buckets end.

AOTAutograd runs a compiled graph's backward as one autograd node, so every gradient it
computes becomes ready, and every post-accumulate-grad hook fires, only when that node ends:
with the whole model compiled as one graph, all reduces would leave after the whole backward.
DDP keeps its overlap because Dynamo's ``DDPOptimizer`` splits the graph, in reverse graph order,
into pieces of about one gradient bucket each and compiles each piece on its own: each piece's
backward is then a node of its own, and a bucket's gradients are ready when its piece is done.

Dynamo applies that split to any frame it compiles while
``DistributedDataParallel._get_active_ddp_module()`` returns something, reading only its
``bucket_bytes_cap``. DDP sets it around its inner module's forward; torch's composable
``replicate`` sets it from forward hooks. Torch offers no public way to ask for the split, so
:func:`graph_splitter` does what ``replicate`` does, with a stand-in that carries only the
bucket size. Should a future torch drop the attribute, the context does nothing: the results stay
the same and only the overlap is lost.

The first piece is small whatever the bucket size: DDPOptimizer cuts it at DDP's first-bucket
size (``_DEFAULT_FIRST_BUCKET_BYTES``; Dynamo passes it no other, so the stand-in has nothing more
to carry), and the reduce plan's first bucket is no larger
(:data:`sharded._owners.reduce_plan.FIRST_BUCKET_BYTES`), so it leaves as soon as that piece's backward
is done.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["graph_splitter", "split_bytes_for"]

# DDPOptimizer cuts its first piece at this many bytes (DDP's small first bucket) and refuses a
# bucket cap below it.
_FIRST_PIECE_BYTES: int = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024)
_SUPPORTED = hasattr(DistributedDataParallel, "_active_ddp_module") and hasattr(
    DistributedDataParallel, "_get_active_ddp_module"
)


class _BucketCap:
    """What Dynamo reads of the "active DDP module": the bytes of gradient per graph piece."""

    def __init__(self, bucket_bytes_cap: int) -> None:
        self.bucket_bytes_cap = bucket_bytes_cap


def split_bytes_for(bucket_numel: int, params: list[torch.Tensor]) -> int:
    """Bytes of parameters per compiled piece for reduce buckets of ``bucket_numel`` elements.

    The pieces are as large as the buckets (each bucket then waits for at most two pieces), but
    never below the first piece, which DDPOptimizer requires; ``bucket_numel <= 0`` (every
    gradient reduced alone) gives the smallest pieces allowed.
    """
    itemsize = max((p.element_size() for p in params), default=4)
    return max(bucket_numel * itemsize, _FIRST_PIECE_BYTES)


@functools.cache
def graph_splitter() -> Callable[[int], ContextManager[None]]:
    """:func:`_split_compiled_graphs`, which Dynamo must not trace, as a context manager.

    Built on first use, not at import: ``torch.compiler.disable`` imports Dynamo (and with it
    DTensor and torch's FSDP, seconds of start-up) that ``import sharded`` must not pay for.
    """
    return contextlib.contextmanager(torch.compiler.disable(_split_compiled_graphs, recursive=False))


def _split_compiled_graphs(bucket_bytes: int) -> Iterator[None]:
    """Inside, frames Dynamo compiles for the first time are split into bucket-sized graphs.

    Only compilation is affected: a graph compiled earlier outside the context is reused as it
    is. Nested uses restore the outer one (as DDP does for a DDP inside a DDP).
    """
    if not _SUPPORTED:
        yield
        return
    previous = DistributedDataParallel._active_ddp_module
    DistributedDataParallel._active_ddp_module = _BucketCap(bucket_bytes)  # type: ignore[assignment]
    try:
        yield
    finally:
        DistributedDataParallel._active_ddp_module = previous
