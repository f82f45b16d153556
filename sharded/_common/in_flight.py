"""How much communication a rank keeps in flight during backward before it waits for the oldest.

Layer 2 sends each bucket of another owner's gradients as soon as it is full, and layer 3 starts
each unit's reduce-scatter as soon as its gradients are packed; a backward that outruns the link
would otherwise hold more and more send buffers. Both bound them the same way: past a limit, the
oldest send is finished (waited for, its buffer freed) before more is held. The memory planner
replays that rule to find the peak. The limits and the rule live here, below the mechanism and
the planner alike, so that both read one definition of each.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Iterator, TypeVar

__all__ = ["InFlight", "MAX_REDUCTIONS_IN_FLIGHT", "MAX_SENDS_IN_FLIGHT"]

T = TypeVar("T")

# Layer 2: reduces of other owners' buckets a rank keeps in flight during backward before it
# waits for the oldest: bounds the buffers held when the backward outruns the communication (a
# starved gloo thread), which otherwise grow with every bucket sent. The next bucket fills beside
# them, so a rank holds at most this many plus one buckets of other owners' gradients.
MAX_SENDS_IN_FLIGHT = 1

# Layer 3: unit reductions allowed in flight before the oldest is waited for (before the next
# unit packs its gradients): bounds the memory their buffers hold while still letting a
# reduce-scatter overlap the next unit's backward. 1, as FSDP2's default input buffers: with 2, a
# backward that outran the link held more buffers, and the peak depended on timing (+27 MiB on
# the 67M-parameter MLP at world 3 on a loaded machine).
MAX_REDUCTIONS_IN_FLIGHT = 1


class InFlight(Generic[T]):
    """Work started and not yet finished, oldest first.

    The owner adds each piece of work as it starts and, to respect a limit, finishes what
    :meth:`beyond` hands back: the oldest pieces past the newest ``limit``.
    """

    def __init__(self) -> None:
        self._items: deque[T] = deque()

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: T) -> None:
        """``item`` has started."""
        self._items.append(item)

    def beyond(self, limit: int) -> list[T]:
        """Take out and return, oldest first, what is in flight beyond the newest ``limit``
        (everything for 0): the caller finishes them."""
        oldest = []
        while len(self._items) > max(limit, 0):
            oldest.append(self._items.popleft())
        return oldest
