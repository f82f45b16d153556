"""GPT-shaped layouts for ``python -m sharded.plan`` (built on the meta device there).

    python -m sharded.plan examples.layouts:gpt_1_5b --world-sizes 8,64,512 --wrap examples.gpt:Block
"""

from __future__ import annotations

from examples.gpt import GPT


def gpt_1_5b() -> GPT:
    """GPT-2 XL's shape: 48 blocks of width 1600, a 50257-token vocabulary (1.6B parameters)."""
    return GPT(vocab=50257, dim=1600, layers=48, heads=25, seq=1024)


def gpt_8b() -> GPT:
    """A Llama-3-8B-sized layout in the example's blocks: 32 blocks of width 4096, a 128256-token
    vocabulary (7.5B parameters; the example's MLP is 4x wide, Llama's gated one 3.5x)."""
    return GPT(vocab=128256, dim=4096, layers=32, heads=32, seq=8192)


def demo_gpt() -> GPT:
    """The model of ``make demo``'s memory-budget ending."""
    return GPT(vocab=256, dim=512, layers=8, heads=8, seq=128)
