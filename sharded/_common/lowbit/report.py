"""What a wrapper's low-bit collectives tell the user: bytes sent, messages that fell back, and
shadow checks against the exact collective.

Bytes are counted per rank as what the rank itself puts on the wire, independent of the
algorithm the backend runs: a broadcast's source sends its message to each of the other
``W - 1`` ranks, an all-gather sends this rank's piece to ``W - 1`` ranks, a reduce to one rank
sends this rank's message once (the destination sends nothing), an all-to-all sends ``W - 1`` of
its ``W`` pieces. The exact collective's bytes are counted the same way, so the two compare.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..errors import on_rank
from .policy import LowBitCheck

__all__ = ["Traffic", "StepTraffic", "Fallbacks", "ShadowErrors"]

log = logging.getLogger("sharded.lowbit")


@dataclass
class StepTraffic:
    """Bytes this rank sent in one step, per collective, and what the exact collectives would have sent."""

    step: int
    sent: dict[str, int] = field(default_factory=dict)
    exact: dict[str, int] = field(default_factory=dict)

    @property
    def sent_bytes(self) -> int:
        return sum(self.sent.values())

    @property
    def exact_bytes(self) -> int:
        return sum(self.exact.values())


class Traffic:
    """Counts bytes per collective within a step; :meth:`end_step` closes the step."""

    def __init__(self) -> None:
        self.step = 0
        self.current = StepTraffic(0)
        self.last: Optional[StepTraffic] = None

    def add(self, collective: str, sent: int, exact: int) -> None:
        self.current.sent[collective] = self.current.sent.get(collective, 0) + sent
        self.current.exact[collective] = self.current.exact.get(collective, 0) + exact

    def end_step(self) -> StepTraffic:
        self.last, self.step = self.current, self.step + 1
        self.current = StepTraffic(self.step)
        return self.last


class Fallbacks:
    """Messages a format could not take. ``"raise"`` stops at the first; ``"warn"`` counts them and
    logs once, after the first step that had any: "12 of 310 messages sent exact: ...". """

    def __init__(self, mode: str, group_rank: int) -> None:
        self._mode, self._rank = mode, group_rank
        self._reasons: Counter[str] = Counter()
        self._messages = 0
        self._reported = False

    def note(self, collective: str, name: str, reason: Optional[str], exact_dtype: torch.dtype) -> bool:
        """Record one message; ``True`` when it may travel low-bit, ``False`` when it falls back."""
        self._messages += 1
        if reason is None:
            return True
        if self._mode == "raise":
            raise ValueError(on_rank(f"low-bit {collective} cannot send {name}: {reason} "
                                     f"(LowBit(fallback='warn') sends it in {exact_dtype} instead)", self._rank))
        self._reasons[f"{reason} ({collective}, sent in {str(exact_dtype).replace('torch.', '')})"] += 1
        return False

    def end_step(self) -> None:
        if self._reasons and not self._reported:
            self._reported = True
            total = sum(self._reasons.values())
            why = "; ".join(f"{n}: {reason}" for reason, n in self._reasons.most_common())
            log.warning(on_rank(f"low-bit: {total} of {self._messages} messages in the first step sent exact: {why}", self._rank))
        self._messages = 0

    @property
    def counts(self) -> dict[str, int]:
        """Fallbacks so far, by reason."""
        return dict(self._reasons)


class ShadowErrors:
    """Accumulates, per collective, the error of what a low-bit collective delivered against the
    exact one over one step, and reports a :class:`LowBitCheck` per collective at its end."""

    def __init__(self, every: Optional[int], on_check: Optional[Callable[[LowBitCheck], None]], group_rank: int) -> None:
        self._every, self._on_check, self._rank = every, on_check, group_rank
        self._sums: dict[str, list[float]] = {}
        self.last: list[LowBitCheck] = []  # the checks of the last step that had any

    def due(self, step: int) -> bool:
        return self._every is not None and step % self._every == 0

    def compare(self, collective: str, received: torch.Tensor, exact: torch.Tensor, divergence_of: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        diff = (received.float() - exact.float()).reshape(-1)
        sums = self._sums.setdefault(collective, [0.0, 0.0, 0.0, 0, -1.0, -1.0])
        sums[0] += float(diff.pow(2).sum())
        sums[1] += float(exact.float().pow(2).sum())
        sums[2] = max(sums[2], float(diff.abs().max())) if diff.numel() else sums[2]
        sums[3] += diff.numel()
        if divergence_of is not None:
            mine, reference = (t.float() for t in divergence_of)
            sums[4] = max(sums[4], 0.0) + float((mine - reference).pow(2).sum())
            sums[5] = max(sums[5], 0.0) + float(reference.pow(2).sum())

    def end_step(self, step: int) -> None:
        if self._sums:
            self.last = []
        for collective, (err2, ref2, worst, n, div2, dref2) in self._sums.items():
            divergence = None if div2 < 0 else (div2 / dref2) ** 0.5 if dref2 > 0 else div2 ** 0.5
            check = LowBitCheck(step, collective, (err2 / ref2) ** 0.5 if ref2 > 0 else err2 ** 0.5, worst, int(n), divergence)
            self.last.append(check)
            if self._on_check is not None:
                self._on_check(check)
            else:
                log.info(on_rank(f"low-bit check, step {step}: {check}", self._rank))
        self._sums.clear()
