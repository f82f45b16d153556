"""The same bits at any number of ranks: gradient accumulation over a fixed global batch of
micro-batches whose sums do not depend on how many ranks computed them (``docs/invariance.md``).

- :mod:`.micro_batches`: ``MicroBatches``, the loop helper (which micro-batches this rank
  computes; the mean gradient, the global norm and the mean loss, each the same at any world
  size).
- :mod:`._tree`: the canonical summation tree and its accumulator; :mod:`._exchange`: its upper
  levels across ranks (an exchange, then the tree, in place of a reduction);
  :mod:`._norm`: a global gradient norm summed in one order.
- :mod:`._stage` (what a stage answers), :mod:`._replicated` (DDP, ``OSS`` + DDP,
  ``ShardedDataParallel``: blocks of micro-batches, one exchange after the last) and
  :mod:`._sharded` (``fully_shard``: interleaved micro-batches, each unit exchanged as its
  backward ends): how each stage's gradients reach the sum and where the mean lands;
  :mod:`._stages` picks a model's stage.
"""

from __future__ import annotations

from .micro_batches import MicroBatches

__all__ = ["MicroBatches"]
