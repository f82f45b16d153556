"""What one ZeRO stage places on its busiest rank, and the constants every stage's walk shares.

The stage walks (:mod:`.replicated` for DDP and ZeRO-1/2, :mod:`.zero3`) each return a
:class:`Layout`; :mod:`.estimate` adds the optimizer state and activations to it. Kept apart from
both so that neither side imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DDP_BUCKET_BYTES", "Layout", "RUNTIME_BYTES", "STAGE_NAMES"]

# RUNTIME_BYTES: what a CPU rank's data grows by over its first training steps beyond the
# tensors (malloc's small-object heaps, thread stacks, autograd and gloo bookkeeping). Measured on
# CPU, gloo, torch 2.13, ranks started with MALLOC_MMAP_THRESHOLD_=65536, as the rise of VmHWM
# less the rise of RssFile (file pages of torch's own code, which vary with the machine) over the
# resident set after the imports and init_process_group, minus the tensors alive at the peak:
# 1.8-2.3 MiB for DDP and ZeRO-1 on the 67M-parameter MLP of tests/test_memory_estimate.py at
# world 2 and 3, where the peak is the optimizer step. On CUDA, where max_memory_allocated
# counts tensors only, pass runtime_bytes=0.
RUNTIME_BYTES = 2 * 2**20

STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb


@dataclass(frozen=True)
class Layout:
    """What one stage places on its busiest rank, before the optimizer and activations.

    ``backward_bytes``: activations, gradients and communication buffers held at backward's
    worst moment;
    ``held_in_step``: communication buffers still held during the optimizer step (DDP's
    buckets; with ``lowbit``, ZeRO-1's masters and the replicas set aside, the error-feedback
    residuals); ``build_bytes``: the most held while the model is built and wrapped;
    ``broadcast_bytes``: the owners' broadcast messages alive after the step (ZeRO-1/2 with
    ``parameters_as_bucket_view=False``: a packed copy of every bucket of several parameters;
    ZeRO-1 with ``lowbit``: the changes, messages and their encoding and decoding).
    """

    parameters: int
    gradients: int
    communication: int
    backward_bytes: int
    held_in_step: int
    build_bytes: int
    largest_unit_bytes: int
    optimizer_shapes: list[tuple[torch.Size, torch.dtype]]
    bytes_sent: int
    collectives: int
    largest_share: float
    broadcast_bytes: int = 0
