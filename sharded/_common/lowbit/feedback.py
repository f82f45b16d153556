"""Error feedback: each rank's rounding residual of what it sent, added to what it sends next.

With a residual ``e`` kept per message, a rank sends ``q = Q(g + e)`` and keeps
``e' = g + e - decode(q)``. Over ``T`` steps the values sent add up to the values meant minus the
last residual (``sum decode(q_t) = sum g_t - e_T``), so the rounding never accumulates: the
optimizer sees a sum of gradients whose error stays within one step's rounding, where rounding
afresh every step lets biased rounding (small values that always round to zero) add up. This is
the scheme of 1-bit Adam and of ZeRO++'s gradient path. Residuals are per rank and per message,
float32, the size of what the rank sends: kept where the wrapper keeps its gradients and saved
with its state (``state_dict`` below).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from .codecs import Codec

__all__ = ["ErrorFeedback", "feed_into", "feedbacks_into"]


class ErrorFeedback:
    """Residuals keyed by message name (a bucket, a unit's gradient chunk); float32."""

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}
        self._non_finite: Optional[torch.Tensor] = None  # this step's: did any message arrive non-finite?

    def encode(self, key: str, x: torch.Tensor, codec: Codec, block_size: int) -> torch.Tensor:
        """``x`` plus its residual, encoded; the new residual is kept. A residual whose size no
        longer matches ``x`` (the wrapper was rebuilt with other buckets) is dropped."""
        meant = x.detach().reshape(-1).float()
        residual = self._residuals.get(key)
        if residual is not None and residual.shape == meant.shape:
            meant = meant + residual.to(meant.device)  # a residual loaded from a checkpoint lies on the CPU
        message = codec.encode(meant, block_size)
        decoded = codec.decode(message, meant.numel(), block_size)
        left = meant - decoded
        # A non-finite value (an overflow the scaler will skip) must not poison later steps.
        self._residuals[key] = torch.where(torch.isfinite(left), left, torch.zeros_like(left))
        return message

    def clear(self) -> None:
        """Forget every residual (after a skipped step the scaler discards, a load, a reset)."""
        self._residuals.clear()

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
        for residual in self._residuals.values():
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
        """The residuals by message name, to save beside the wrapper's own state."""
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


def feedbacks_into(optimizer: object) -> list[ErrorFeedback]:
    """The live residual stores recorded for ``optimizer`` (see :func:`feed_into`)."""
    found = [ref() for ref in _FEEDING.get(optimizer, [])]
    return [feedback for feedback in found if feedback is not None]
