"""``LowBit``: which collectives a wrapper sends in fewer bits, in which format, and what it does
where a format cannot apply. One frozen policy for every stage, as torch's ``MixedPrecisionPolicy``.

``params`` is the format of parameters on the wire: ZeRO-1's broadcast of updated parameters
(``OSS``), ZeRO-3's all-gather (``fully_shard``). ``grads`` is the format of gradients on the
wire: ZeRO-2's reduce to the owner (``ShardedDataParallel``), ZeRO-3's reduce-scatter. Either
may be ``None`` (that collective stays exact). Master weights, optimizer state and the reduced
gradient handed to the optimizer keep their own dtype: only the bytes in flight change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch

from .codecs import GRAD_FORMATS, PARAM_FORMATS

__all__ = ["LowBit", "LowBitCheck", "MODES"]


@dataclass(frozen=True)
class LowBitCheck:
    """What a shadow check found (``LowBit(check_every=K)``): the exact collective computed beside
    the low-bit one on step ``step`` (counted from 0, checked when ``step % K == 0``).

    ``relative_error``: ``||received - exact|| / ||exact||`` (2-norms) over everything this rank
    received from that collective in that step; ``max_abs_error`` the largest element's error;
    ``divergence`` (gathers and broadcasts of parameters): the same relative error of the
    parameters this rank computes with against the exact ones, ``None`` for gradients.
    """

    step: int
    collective: str
    relative_error: float
    max_abs_error: float
    elements: int
    divergence: Optional[float] = None


@dataclass(frozen=True)
class LowBit:
    """Send parameters and/or gradients in fewer bits (blockwise ``int8``/``int4``/``fp8``).

    Args:
        params: format of parameters on the wire (``"int8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``) or
            ``None``.
        grads: format of gradients on the wire (``"int8"``, ``"int4"``, ``"fp8_e4m3"``,
            ``"fp8_e5m2"``) or ``None``. Quantised pieces are summed in float32 after they arrive.
        block_size: elements per block; each block carries its own float32 scale (4 bytes), so
            ``int8`` at 256 sends 1.016 bytes per element. Even (``int4`` packs pairs).
        min_numel: a message (a bucket, a unit's shard) with fewer elements travels exact: the
            scales and the extra pass cost more than they save.
        error_feedback: keep each rank's rounding residual of the gradients it sent and add it to
            what it sends next (so the rounding does not add up over steps); ``False`` rounds each
            step afresh.
        fallback: ``"warn"``: a message the format cannot take (too small, not floating point)
            travels exact and the first step logs how many and why; ``"raise"``: a ``ValueError``
            naming the message and the rank instead.
        check_every: every ``K`` steps also run the exact collective beside the low-bit one and
            report a :class:`LowBitCheck` per collective (``None``: never; costs one exact
            collective on those steps).
        on_check: called with each :class:`LowBitCheck`; ``None`` logs it (logger ``sharded.lowbit``).
    """

    params: Optional[str] = None
    grads: Optional[str] = None
    block_size: int = 256
    min_numel: int = 4096
    error_feedback: bool = True
    fallback: Literal["warn", "raise"] = "warn"
    check_every: Optional[int] = None
    on_check: Optional[Callable[[LowBitCheck], None]] = None

    def __post_init__(self) -> None:
        if self.params is not None and self.params not in PARAM_FORMATS:
            raise ValueError(f"LowBit(params={self.params!r}): parameters travel as one of {list(PARAM_FORMATS)} or None")
        if self.grads is not None and self.grads not in GRAD_FORMATS:
            raise ValueError(f"LowBit(grads={self.grads!r}): gradients travel as one of {list(GRAD_FORMATS)} or None")
        if not isinstance(self.block_size, int) or self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"LowBit(block_size={self.block_size!r}): an even number of elements >= 2")
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"LowBit(min_numel={self.min_numel!r}): a number of elements >= 0")
        if self.fallback not in ("warn", "raise"):
            raise ValueError(f"LowBit(fallback={self.fallback!r}): 'warn' or 'raise'")
        if self.check_every is not None and (not isinstance(self.check_every, int) or self.check_every < 1):
            raise ValueError(f"LowBit(check_every={self.check_every!r}): a number of steps >= 1, or None")
        if self.on_check is not None and self.check_every is None:
            raise ValueError("LowBit(on_check=...) without check_every: no check would ever call it; set check_every=K")

    @classmethod
    def mode(cls, name: str, **options: object) -> "LowBit":
        """The named mode (README's table, :data:`MODES`), with ``options`` overriding its fields:
        ``LowBit.mode("int8", check_every=100)``."""
        try:
            base = MODES[name]
        except KeyError:
            raise ValueError(f"unknown low-bit mode {name!r}; choose one of {sorted(MODES)}") from None
        return dataclasses.replace(base, **options)  # type: ignore[arg-type]

    def exact_reason(self, numel: int, dtype: torch.dtype) -> Optional[str]:
        """Why a message of ``numel`` elements of ``dtype`` travels exact under this policy (not
        a float type a codec narrows, or below ``min_numel``); ``None`` where a codec may take it.
        The one rule the collectives (``LowBitWire.codec``) and the memory planner both follow."""
        if not dtype.is_floating_point or dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return f"{str(dtype).replace('torch.', '')} is not a float type it narrows"
        if numel < self.min_numel:
            return f"below {self.min_numel} elements"
        return None

    @property
    def active(self) -> bool:
        """Whether anything travels in fewer bits."""
        return self.params is not None or self.grads is not None


MODES: dict[str, LowBit] = {
    "int8": LowBit(params="int8", grads="int8"),
    "int8-params": LowBit(params="int8"),
    "int8-grads": LowBit(grads="int8"),
    "int4-grads": LowBit(grads="int4"),
    "int8-params-int4-grads": LowBit(params="int8", grads="int4"),
    "fp8": LowBit(params="fp8_e4m3", grads="fp8_e5m2"),
    "fp8-params": LowBit(params="fp8_e4m3"),
    "fp8-grads": LowBit(grads="fp8_e5m2"),
}
