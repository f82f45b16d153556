"""Error feedback: each rank's rounding residual of what it sent, added to what it sends next.

With a residual ``e`` kept per message, a rank sends ``q = Q(g + e)`` and keeps
``e' = g + e - decode(q)``. Over ``T`` steps the values sent add up to the values meant minus the
last residual (``sum decode(q_t) = sum g_t - e_T``), so the rounding never accumulates: the
optimizer sees a sum of gradients whose error stays within one step's rounding, where rounding
afresh every step lets biased rounding (small values that always round to zero) add up. This is
the scheme of 1-bit Adam and of ZeRO++'s gradient path. Residuals are per rank and per message,
float32, the size of what the rank sends: kept where the wrapper keeps its gradients and saved
with its state (``state_dict`` below).

A residual can also wait *per parameter*, in no message yet (:meth:`ErrorFeedback.carry`): what
a checkpoint saved at another world size reshards to, or what a message the wrapper no longer
sends (its buckets were re-planned) held. The stage folds it into the next message that holds
the parameter (:meth:`ErrorFeedback.take_carried`, :meth:`ErrorFeedback.add`), so the rounding
owed is paid at the next step instead of dropped.
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .codecs import Codec

__all__ = ["ErrorFeedback", "feed_from", "feed_into", "feedbacks_into"]


class ErrorFeedback:
    """Residuals keyed by message name (a bucket, a unit's gradient chunk), and residuals
    carried per parameter until a message takes them (keyed by what the stage names a
    parameter by: its tensor, its :class:`~sharded.fsdp._param.ShardedParam`); float32."""

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}
        self._carried: dict[object, torch.Tensor] = {}
        self._non_finite: Optional[torch.Tensor] = None  # this step's: did any message arrive non-finite?

    def encode(self, key: str, x: torch.Tensor, codec: Codec, block_size: int) -> torch.Tensor:
        """``x`` plus its residual, encoded; the new residual is kept. A residual whose size no
        longer matches ``x`` (the wrapper was rebuilt with other buckets) is dropped."""
        x = x.detach().reshape(-1)
        residual = self._residuals.get(key)
        if residual is not None and residual.shape == x.shape:
            # the residual becomes what is meant, then what is left, in place: no copy of the
            # message's size beside it (one loaded from a checkpoint lies on the CPU: moved)
            meant = residual.to(x.device).add_(x if x.dtype.itemsize <= 4 else x.float())  # wider: rounded first, as sent
        else:
            meant = x.to(torch.float32, copy=True)
        message = codec.encode(meant, block_size)
        left = meant.sub_(codec.decode(message, meant.numel(), block_size))
        # A non-finite value (an overflow the scaler will skip) must not poison later steps.
        self._residuals[key] = left.masked_fill_(~torch.isfinite(left), 0.0)
        return message

    def add(self, key: str, residual: torch.Tensor) -> None:
        """Add ``residual`` (float32, 1-D) to message ``key``'s: a carried residual joins a message."""
        held = self._residuals.get(key)
        if held is not None and held.shape == residual.shape:
            self._residuals[key] = held + residual.to(held.device)
        else:
            self._residuals[key] = residual.float().clone()

    def carry(self, by_param: Mapping[Any, torch.Tensor]) -> None:
        """Keep residuals per parameter (full shape, float32) until a message holding the
        parameter takes them; added to any already carried for it."""
        for param, residual in by_param.items():
            held = self._carried.get(param)
            self._carried[param] = residual.detach().float().clone() if held is None else held + residual.to(held.device)

    def take_carried(self, params: Sequence[Any]) -> dict[Any, torch.Tensor]:
        """The residuals carried for ``params`` (those that have one), no longer carried. Called
        for every message sent: with nothing carried (every step but the first after a load or
        a re-plan) it returns at once, without walking ``params``."""
        if not self._carried:
            return {}
        return {p: self._carried.pop(p) for p in params if p in self._carried}

    @property
    def carried(self) -> dict[Any, torch.Tensor]:
        """The residuals waiting per parameter (read-only use: saving them)."""
        return dict(self._carried)

    def clear(self) -> None:
        """Forget every residual (after a skipped step the scaler discards, a load, a reset)."""
        self._residuals.clear()
        self._carried.clear()

    def keep_only(self, names: set[str]) -> int:
        """Drop the residuals of messages no longer sent (a re-planned or rebuilt wrapper);
        returns how many were dropped."""
        gone = [name for name in self._residuals if name not in names]
        for name in gone:
            del self._residuals[name]
        return len(gone)

    def rescale(self, factor: float) -> None:
        """Multiply every residual by ``factor``: the gradients they belong to are now scaled
        ``factor`` times as much (a gradient scaler changed its scale)."""
        for residual in [*self._residuals.values(), *self._carried.values()]:
            residual.mul_(factor)

    def note_non_finite(self, found: torch.Tensor) -> None:
        """A message of this step arrived holding an inf or NaN where ``found`` (a bool tensor,
        left on its device: no host sync here). A stage calls it where every rank learns the same
        (each rank received from every sender), so :meth:`end_step` agrees on all ranks."""
        found = found.any()
        self._non_finite = found if self._non_finite is None else self._non_finite | found

    def end_step(self) -> None:
        """Close the step: if a message arrived non-finite (a gradient scaler skips the step),
        drop every residual, which now holds the rounding of gradients nobody applies."""
        found, self._non_finite = self._non_finite, None
        if found is not None and bool(found):
            self.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals by message name, to save beside the wrapper's own state (live tensors,
        as a module's state dict: the next message updates them in place)."""
        return dict(self._residuals)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take saved residuals back (one whose size no longer fits its message is dropped at the
        next send, as after a rebuild)."""
        self._residuals = {name: value.detach().float().clone() for name, value in state.items()}

    def __len__(self) -> int:
        return len(self._residuals)


# Which residuals belong to the gradients an optimizer steps with: a gradient scaler that skips
# that optimizer's step drops them (they are rounding of gradients the step threw away), and one
# that changes its scale rescales them. Weak both ways: neither keeps the other alive.
_FEEDING: weakref.WeakKeyDictionary[object, list[weakref.ref[ErrorFeedback]]] = weakref.WeakKeyDictionary()


def feed_into(optimizer: object, feedback: ErrorFeedback) -> None:
    """Record that ``feedback``'s residuals belong to gradients ``optimizer`` steps with."""
    refs = [ref for ref in _FEEDING.get(optimizer, []) if ref() is not None and ref() is not feedback]
    _FEEDING[optimizer] = refs + [weakref.ref(feedback)]


# The same, per parameter, for a wrapper that never sees the optimizer (``fully_shard``): the
# residuals of the rows holding a parameter belong to whichever optimizer steps it.
_FED_BY: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> weakref.ref(ErrorFeedback); by identity (tensors compare elementwise)


def feed_from(params: Sequence[torch.Tensor], feedback: ErrorFeedback) -> None:
    """Record that ``feedback``'s residuals belong to the gradients of ``params``: an optimizer
    stepping any of them is fed by it."""
    for param in params:
        _FED_BY[param] = weakref.ref(feedback)


def feedbacks_into(optimizer: Any) -> list[ErrorFeedback]:
    """The live residual stores recorded for ``optimizer`` (:func:`feed_into`) or for a
    parameter it steps (:func:`feed_from`), each once."""
    found = [ref() for ref in _FEEDING.get(optimizer, [])]
    if _FED_BY:
        found += [ref() for group in getattr(optimizer, "param_groups", []) for p in group["params"] if (ref := _FED_BY.get(p)) is not None]
    unique = {id(feedback): feedback for feedback in found if feedback is not None}
    return list(unique.values())
