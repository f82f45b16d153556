"""Asynchronous collectives in flight, and the storages they hold.

A gloo collective reads and writes its tensors' bytes on gloo's own threads until it completes;
a storage freed, resized or swapped before then is written after it was given back, which kills
the rank with SIGSEGV on a thread without a Python frame (issue #36). :class:`TrackWork` watches
for that in program order, so a test fails the same way whether or not gloo had finished:

- every ``torch.distributed`` call made with ``async_op=True`` is recorded, with the address and
  size of each tensor's storage (the library looks those functions up at call time);
- ``Work.wait`` is wrapped on the class (a proxy would fail torch's own ``isinstance`` checks):
  a waited collective is marked, and each storage it held must still have the address and size
  it had when the collective started;
- ``UntypedStorage.resize_``, ``Tensor.set_``, ``Tensor.data = ...`` and
  ``torch.utils.swap_tensors`` on a storage an unwaited collective holds are recorded.

``SHARDED_TEST_TRACK_WORK=1`` makes :func:`tests._harness.run_on_ranks` run every test body under
it and fail a rank that let a storage go in flight: the whole suite checked at once (slower, and
tests/test_memory_given_back.py fails then, since the records keep collectives alive).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["ASYNC_COLLECTIVES", "Started", "TrackWork"]

ASYNC_COLLECTIVES = (
    "broadcast",
    "reduce",
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
)


def _storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    """The address and size in bytes of ``tensor``'s storage (0, 0 where it has none to read)."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # fake and functional tensors under compile
        return 0, 0


def _tensors_in(values) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(_tensors_in(value))
    return found


@dataclass
class Started:
    """One asynchronous collective: its function's name, its ``Work``, the storages it was given."""

    name: str
    work: Any
    held: list[tuple[torch.Tensor, tuple[int, int]]] = field(default_factory=list)
    waited: bool = False

    def holds(self, address: int) -> bool:
        return any(held[0] == address and held[1] > 0 for _, held in self.held)

    def moved(self) -> list[str]:
        """The held tensors whose storage has another address or size now than at the start."""
        moved = []
        for tensor, at_start in self.held:
            now = _storage_of(tensor)
            if now != at_start:
                moved.append(f"a {tuple(tensor.shape)} {tensor.dtype} tensor's storage changed while in flight "
                             f"({at_start[0]:#x}, {at_start[1]} bytes -> {now[0]:#x}, {now[1]} bytes)")
        return moved


class TrackWork:
    """While active, records every asynchronous collective started through torch.distributed
    and every storage let go of while one that holds it is in flight."""

    active: list["TrackWork"] = []  # innermost last (the harness's, under SHARDED_TEST_TRACK_WORK, first)

    @classmethod
    def excuse_all(cls) -> None:
        """Forget what every active tracker saw let go of: for a test that lets go on purpose."""
        for track in cls.active:
            track.released_in_flight.clear()

    def __enter__(self) -> "TrackWork":
        self.started: list[Started] = []
        self.released_in_flight: list[str] = []
        self._by_work: dict[int, Started] = {}
        self._undo: list[Callable[[], None]] = []
        for name in ASYNC_COLLECTIVES:
            if hasattr(dist, name):
                self._replace(dist, name, self._tracking(name, getattr(dist, name)))
        self._replace(dist.Work, "wait", self._waiting(dist.Work.wait))
        self._watch_storages()
        TrackWork.active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        TrackWork.active.remove(self)
        while self._undo:
            self._undo.pop()()

    def assert_none_in_flight(self, after: str) -> None:
        left = [s.name for s in self.started if not s.waited]
        assert not left, f"after {after}, {len(left)} collective(s) never waited for: {left}"
        self.assert_nothing_released(after)

    def assert_nothing_released(self, by: str) -> None:
        assert not self.released_in_flight, f"by {by}: {self.released_in_flight}"

    # ------------------------------------------------------------------ wrapping

    def _replace(self, owner: Any, name: str, replacement: Any) -> None:
        """Set ``owner.name`` and remember how to put back what was there (its own or inherited)."""
        own = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, replacement)
        self._undo.append(lambda: setattr(owner, name, own) if own is not None else delattr(owner, name))

    def _tracking(self, name: str, fn: Callable) -> Callable:
        def tracked(*args, **kwargs):
            work = fn(*args, **kwargs)
            recorded = self._by_work.get(id(work))
            if kwargs.get("async_op") and work is not None and (recorded is None or recorded.work is not work):
                started = Started(name, work, [(t, _storage_of(t)) for t in _tensors_in([*args, *kwargs.values()])])
                self.started.append(started)
                self._by_work[id(work)] = started
            return work

        return tracked

    def _waiting(self, wait: Callable) -> Callable:
        def waiting(work, *args, **kwargs):
            result = wait(work, *args, **kwargs)
            started = self._by_work.pop(id(work), None)
            if started is not None and started.work is work:
                started.waited = True
                self.released_in_flight += [f"{started.name}: {m}" for m in started.moved()]
            return result

        return waiting

    def _watch_storages(self) -> None:
        """Wrap the Python calls that free, resize or swap a storage."""
        resize, set_, swap = torch.UntypedStorage.resize_, torch.Tensor.set_, torch.utils.swap_tensors
        data = vars(torch.Tensor).get("data") or torch._C.TensorBase.data
        released = self._released

        def resize_(storage, size):
            try:
                address = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                address = 0
            released(address, f"UntypedStorage.resize_({size})")
            return resize(storage, size)

        def set_tensor(tensor, *args, **kwargs):
            released(_storage_of(tensor)[0], "Tensor.set_")
            return set_(tensor, *args, **kwargs)

        def set_data(tensor, value):
            released(_storage_of(tensor)[0], "Tensor.data = ...")
            data.__set__(tensor, value)

        def swap_tensors(a, b):
            released(_storage_of(a)[0], "swap_tensors")
            released(_storage_of(b)[0], "swap_tensors")
            return swap(a, b)

        self._replace(torch.UntypedStorage, "resize_", resize_)
        self._replace(torch.Tensor, "set_", set_tensor)
        self._replace(torch.Tensor, "data", property(data.__get__, set_data))
        self._replace(torch.utils, "swap_tensors", swap_tensors)

    def _released(self, address: int, how: str) -> None:
        if not address:
            return
        for started in self._by_work.values():
            if started.holds(address):
                self.released_in_flight.append(f"{how} on a storage that {started.name} still held")
