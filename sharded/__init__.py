"""sharded: ZeRO-style sharding of optimizer state, gradients and parameters for PyTorch."""

from __future__ import annotations

from .oss import OSS

__version__ = "0.1.0"

__all__ = ["OSS", "__version__"]
