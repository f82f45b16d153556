"""The canonical summation tree: one fixed order of additions over the micro-batches of a global
batch, whatever the number of ranks that compute them.

Floating-point addition is commutative but not associative: ``a + b == b + a`` bit for bit, but
``(a + b) + c`` may differ from ``a + (b + c)``. So a sum is the same wherever it is computed
exactly when the *tree* of additions is the same. Here the tree over ``M = 2**k`` micro-batch
gradients is the balanced binary one, ``((g0 + g1) + (g2 + g3)) + ((g4 + g5) + (g6 + g7))`` for
``M = 8``, and every aligned block of ``2**j`` consecutive leaves is one of its subtrees. A rank
that sums such a block with the same tree, and ranks that combine blocks pairwise up the same
tree, reach the very bits one process summing all ``M`` would reach.

:func:`tree_sum` sums the rows of a tensor up that tree (the rows being subtree sums of equal
size, in leaf order); :class:`TreeAccumulator` does the same as the parts arrive one by one, holding at
most ``log2(count) + 1`` partial sums (a binary counter: two partials of equal size are added as
soon as both exist).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["is_power_of_two", "tree_sum", "TreeAccumulator"]


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def tree_sum(rows: torch.Tensor) -> torch.Tensor:
    """The sum of ``rows`` (dim 0, a power-of-two count, in leaf order) up the balanced binary
    tree: neighbours first, then neighbouring pairs, and so on; one in-place addition per level,
    into the left operand of each pair, so ``rows`` must be a tensor the caller can give up."""
    if not is_power_of_two(rows.shape[0]):
        raise ValueError(f"the canonical tree sums a power-of-two number of parts, got {rows.shape[0]}")
    while rows.shape[0] > 1:
        rows = rows[0::2].add_(rows[1::2])
    return rows[0]


class TreeAccumulator:
    """Sums tensors arriving one at a time, in leaf order, up the balanced binary tree.

    After ``2**k`` additions :meth:`total` is the sum :func:`tree_sum` would give over all of
    them. A partial sum is added into its left neighbour in place once the two cover subtrees
    of the same size, so at most ``log2(count) + 1`` tensors are held at once.
    """

    def __init__(self) -> None:
        self._partials: list[tuple[int, torch.Tensor]] = []  # (leaves covered, their sum), left to right
        self.count = 0

    def add(self, part: torch.Tensor) -> None:
        """Add the next leaf (the accumulator keeps ``part`` and may add into it)."""
        self.count += 1
        size, total = 1, part
        while self._partials and self._partials[-1][0] == size:
            _, left = self._partials.pop()
            total = left.add_(total)
            size *= 2
        self._partials.append((size, total))

    def total(self) -> Optional[torch.Tensor]:
        """The sum so far (``None`` before the first leaf); a power-of-two count of leaves is
        one subtree, and its sum is the canonical one."""
        if not self._partials:
            return None
        if len(self._partials) > 1:
            raise RuntimeError(f"{self.count} parts summed: the canonical tree needs a power-of-two count")
        return self._partials[0][1]
