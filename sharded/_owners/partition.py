"""Which rank owns which parameter: a pure, deterministic, immutable assignment.

Every rank computes the same :class:`Partition` from the same inputs (parameter sizes, their
order and their ``requires_grad`` flags), so no communication is needed to agree on it.

Placement is sorted greedy ("longest processing time first"): parameters are visited largest
first and each goes to the rank with the smallest load so far. This keeps the largest rank's
optimizer state within one parameter of the mean, and close to optimal in practice; an unsorted
greedy can end up a whole large parameter over. Trainable and frozen parameters are balanced
separately: frozen parameters carry no optimizer state while frozen, so they must not skew where
trainable ones go, but they still need a keeper for state they may have from earlier steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Partition"]


@dataclass(frozen=True)
class Partition:
    """Assignment of parameters to owner ranks.

    Attributes:
        params: every parameter, in global order (param group by param group, as a torch
            optimizer numbers them in its state dict).
        group_sizes: how many of ``params`` belong to each param group, in order.
        owners: ``owners[i]`` is the rank that owns ``params[i]``.
        trainable: ``trainable[i]`` is ``params[i].requires_grad`` when the partition was made.
        world_size: number of ranks.
    """

    params: tuple[torch.Tensor, ...]
    group_sizes: tuple[int, ...]
    owners: tuple[int, ...]
    trainable: tuple[bool, ...]
    world_size: int

    @classmethod
    def build(cls, param_groups: Sequence[Sequence[torch.Tensor]], world_size: int) -> Partition:
        """Place every parameter of ``param_groups`` from scratch."""
        empty = cls(params=(), group_sizes=(), owners=(), trainable=(), world_size=world_size)
        flat = [p for group in param_groups for p in group]
        placed = empty._place(flat)
        return cls(
            params=tuple(flat),
            group_sizes=tuple(len(g) for g in param_groups),
            owners=placed,
            trainable=tuple(p.requires_grad for p in flat),
            world_size=world_size,
        )

    def with_group(self, new_params: Sequence[torch.Tensor]) -> Partition:
        """A partition with one more param group; parameters already placed keep their owner."""
        return Partition(
            params=self.params + tuple(new_params),
            group_sizes=self.group_sizes + (len(new_params),),
            owners=self.owners + self._place(new_params),
            trainable=self.trainable + tuple(p.requires_grad for p in new_params),
            world_size=self.world_size,
        )

    def _place(self, new_params: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """Owners for ``new_params``, placed greedily on top of the current loads."""
        owners = [0] * len(new_params)
        for requires_grad in (True, False):
            loads = self._loads(trainable=requires_grad)
            candidates = [i for i, p in enumerate(new_params) if p.requires_grad == requires_grad]
            candidates.sort(key=lambda i: (-_nbytes(new_params[i]), i))
            for i in candidates:
                rank = min(range(self.world_size), key=loads.__getitem__)
                owners[i] = rank
                loads[rank] += _nbytes(new_params[i])
        return tuple(owners)

    def _loads(self, trainable: bool) -> list[int]:
        loads = [0] * self.world_size
        for p, owner, is_trainable in zip(self.params, self.owners, self.trainable):
            if is_trainable == trainable:
                loads[owner] += _nbytes(p)
        return loads

    # ----------------------------------------------------------------- derived views

    @property
    def group_slices(self) -> tuple[slice, ...]:
        """For each param group, the slice of ``params`` it occupies."""
        slices, start = [], 0
        for size in self.group_sizes:
            slices.append(slice(start, start + size))
            start += size
        return tuple(slices)

    def owner_of(self) -> dict[torch.Tensor, int]:
        """Parameter -> owner rank (tensors hash by identity)."""
        return dict(zip(self.params, self.owners))

    def owned_indices(self, rank: int, trainable_only: bool = False) -> list[int]:
        """Global indices of the parameters ``rank`` owns, in global order."""
        return [
            i
            for i, (owner, is_trainable) in enumerate(zip(self.owners, self.trainable))
            if owner == rank and (is_trainable or not trainable_only)
        ]

    def owned_by_group(self, rank: int) -> list[list[torch.Tensor]]:
        """The parameters ``rank`` owns, split by param group (a group may be empty).

        Its optimizer holds all of them and, as any torch optimizer, steps those that have a
        gradient: a frozen parameter still holding one is stepped too.
        """
        return [
            [p for p, owner in zip(self.params[s], self.owners[s]) if owner == rank]
            for s in self.group_slices
        ]

    def frozen_indices(self) -> list[int]:
        """Global indices of the parameters that were frozen when the partition was made."""
        return [i for i, is_trainable in enumerate(self.trainable) if not is_trainable]

    def trainable_bytes_per_rank(self) -> list[int]:
        """Bytes of trainable parameters each rank owns: what its optimizer state scales with."""
        return self._loads(trainable=True)

    def is_current(self) -> bool:
        """Whether every parameter's ``requires_grad`` still matches this partition."""
        return all(p.requires_grad == t for p, t in zip(self.params, self.trainable))


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()
