"""Blockwise codecs: how a floating-point tensor travels in 8 or 4 bits, and what that costs.

A tensor is cut into blocks of ``block_size`` elements (the last one padded with zeros); each
block travels as one float32 scale and its values in the codec's format. One message is one
``uint8`` tensor, scales first and values after, so one collective carries both and every rank's
message for the same number of elements has the same length (what all-gathers need).

The formats and the bound each one keeps, per element ``x`` of a block whose largest magnitude is
``absmax`` (:meth:`Codec.error_bound` computes it; tests/test_lowbit_codecs.py checks it):

- ``int8``: ``scale = absmax / 127``, values rounded to the nearest integer in ``[-127, 127]``:
  ``|decode(encode(x)) - x| <= scale / 2``.
- ``int4``: ``scale = absmax / 7``, integers in ``[-7, 7]`` packed two to a byte:
  ``|decode(encode(x)) - x| <= scale / 2``.
- ``fp8_e4m3`` / ``fp8_e5m2``: ``scale = absmax / finfo.max``, ``x / scale`` rounded to the float8
  format (3 or 2 mantissa bits): ``|error| <= max(|x| * 2**-(m+1), scale * 2**(emin-m-1))``, the
  larger of half a unit in the last place and half the subnormal spacing.

Each bound holds up to float32 arithmetic (the division and multiplication by the scale round
once each), which :meth:`Codec.error_bound` adds as ``2**-22 * absmax``. A block whose largest
magnitude is so small (below about ``1e-36``) that its float32 scale underflows to zero arrives as
zeros: its bound is ``absmax`` (flushed, never made larger). Symmetric scales keep
zero exact, so a block of zeros (padding, frozen rows) costs nothing. A block holding ``inf`` or
``NaN`` decodes to ``NaN`` in every element: an overflow is never rounded into a finite number
(the gradient scaler's check sees it).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["Codec", "codec_for", "FORMATS", "PARAM_FORMATS", "GRAD_FORMATS"]

_SCALE_BYTES = 4  # one float32 per block
_FP32_SLACK = 2.0**-22  # the two float32 roundings (x / scale, q * scale), relative to absmax


class Codec:
    """One format: encode a 1-D floating tensor into a ``uint8`` message, decode it back.

    ``levels`` is the largest magnitude the format's values reach after scaling (127 for
    ``int8``); ``bits`` the bits per value on the wire.
    """

    name: str = ""
    bits: int = 8
    levels: float = 127.0

    def message_numel(self, numel: int, block_size: int) -> int:
        """Bytes of the message for ``numel`` elements (every rank's message for ``numel`` has this length)."""
        blocks = _blocks(numel, block_size)
        return blocks * _SCALE_BYTES + blocks * block_size * self.bits // 8

    def encode(self, x: torch.Tensor, block_size: int) -> torch.Tensor:
        """``x`` (1-D, any floating dtype) as one ``uint8`` message: block scales, then values."""
        blocks = _padded(x, block_size)
        low, high = torch.aminmax(blocks, dim=1)  # |x|'s largest without a temporary |x| of every element
        absmax = torch.maximum(high, low.neg())
        scale = absmax / self.levels
        finite = torch.isfinite(scale)
        scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
        divisor = torch.where(finite & (scale > 0), scale, torch.ones_like(scale))
        # one block-sized temporary, worked on in place (what a bucket's encode holds beside it)
        values = self._encode_values((blocks / divisor[:, None]).masked_fill_(~finite[:, None], 0.0))
        message = torch.empty(self.message_numel(x.numel(), block_size), dtype=torch.uint8, device=x.device)
        head = scale.numel() * _SCALE_BYTES
        message[:head].view(torch.float32).copy_(scale)
        message[head:].copy_(values.reshape(-1))
        return message

    def decode(self, message: torch.Tensor, numel: int, block_size: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The ``numel`` values ``message`` carries, computed in float32 and written into ``out``
        (any floating dtype, ``numel`` elements) or a new float32 tensor."""
        blocks = _blocks(numel, block_size)
        head = blocks * _SCALE_BYTES
        scale = message[:head].view(torch.float32)
        values = self._decode_values(message[head:], blocks, block_size)
        decoded = values.mul_(scale[:, None]).reshape(-1)[:numel]  # ``values`` is a fresh float32 tensor
        if out is None:
            return decoded
        out.copy_(decoded.view_as(out))
        return out

    def error_bound(self, x: torch.Tensor, block_size: int) -> torch.Tensor:
        """Per element of ``x``, the largest ``|decode(encode(x)) - x|`` the format allows (float32)."""
        blocks = _padded(x, block_size)
        absmax = blocks.abs().amax(dim=1, keepdim=True)
        scale = absmax / self.levels
        bound = self._bound(blocks.abs(), scale) + _FP32_SLACK * absmax
        bound = torch.where(scale == 0, absmax, bound)  # a block below ~1e-36: its scale underflows, it arrives as zeros
        return bound.reshape(-1)[: x.numel()]

    # per-format parts
    def _encode_values(self, scaled: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _decode_values(self, data: torch.Tensor, blocks: int, block_size: int) -> torch.Tensor:
        raise NotImplementedError

    def _bound(self, magnitude: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (scale / 2).expand_as(magnitude)


class Int8(Codec):
    name, bits, levels = "int8", 8, 127.0

    def _encode_values(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)

    def _decode_values(self, data: torch.Tensor, blocks: int, block_size: int) -> torch.Tensor:
        return data.view(torch.int8).view(blocks, block_size).float()


class Int4(Codec):
    """Values in ``[-7, 7]``, stored as ``value + 8`` in a nibble: even elements low, odd high."""

    name, bits, levels = "int4", 4, 7.0

    def _encode_values(self, scaled: torch.Tensor) -> torch.Tensor:
        nibbles = scaled.round_().clamp_(-7, 7).add_(8).to(torch.uint8).view(-1, 2)
        return nibbles[:, 0] | (nibbles[:, 1] << 4)

    def _decode_values(self, data: torch.Tensor, blocks: int, block_size: int) -> torch.Tensor:
        low = (data & 0x0F).to(torch.int16) - 8
        high = (data >> 4).to(torch.int16) - 8
        return torch.stack((low, high), dim=1).view(blocks, block_size).float()


class Float8(Codec):
    """``x / scale`` in a float8 format, saturated at its largest finite value."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        info = torch.finfo(dtype)
        self.name, self.bits, self.levels, self._dtype = name, 8, float(info.max), dtype
        self._mantissa = int(round(-torch.log2(torch.tensor(info.eps)).item()))
        self._half_subnormal = info.smallest_normal * 2.0 ** (-self._mantissa - 1)

    def _encode_values(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.clamp_(-self.levels, self.levels).to(self._dtype).view(torch.uint8)

    def _decode_values(self, data: torch.Tensor, blocks: int, block_size: int) -> torch.Tensor:
        return data.view(self._dtype).view(blocks, block_size).float()

    def _bound(self, magnitude: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.maximum(magnitude * 2.0 ** (-self._mantissa - 1), scale * self._half_subnormal)


def _blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def _padded(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` in float32 as ``(blocks, block_size)``, the last block padded with zeros."""
    flat = x.detach().reshape(-1).float()
    pad = _blocks(flat.numel(), block_size) * block_size - flat.numel()
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return flat.view(-1, block_size)


FORMATS: dict[str, Codec] = {
    "int8": Int8(),
    "int4": Int4(),
    "fp8_e4m3": Float8("fp8_e4m3", torch.float8_e4m3fn),
    "fp8_e5m2": Float8("fp8_e5m2", torch.float8_e5m2),
}
PARAM_FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")  # int4 weights lose too much to be a default anyone wants
GRAD_FORMATS = ("int8", "int4", "fp8_e4m3", "fp8_e5m2")


def codec_for(name: str) -> Codec:
    """The codec called ``name`` (one of :data:`FORMATS`)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown low-bit format {name!r}; choose one of {sorted(FORMATS)}") from None
