"""Will it fit? Which ZeRO stages fit a per-rank memory budget, and what each costs in communication.

A stage is the ZeRO stage a configuration trains with: 0 is plain DDP, and 1, 2 and 3 are run by
sharded's layers 1, 2 and 3 (``OSS``; ``ShardedDataParallel``; ``fully_shard``).
``sharded.plan(model, world_size=8, budget_bytes=40 * 2**30)`` returns the stages whose
estimated peak fits, cheapest first by bytes sent per step (DDP, ZeRO-1 and ZeRO-2 send twice
the model per rank and step, ZeRO-3 three times), each with its :class:`MemoryEstimate`.

As a command::

    python -m sharded.plan MODULE:FACTORY --world-size 8 --budget 40GiB [--stages 0,1,2,3]
    python -m sharded.plan MODULE:FACTORY --world-sizes 8,64,512,4096

``FACTORY`` is called with no arguments under ``torch.device("meta")``, so building even a
model that fits nowhere costs no memory. The first form prints the table of stages at one world
size and which fit; the second prints, per stage and world size, bytes per rank, bytes sent per
rank per step, collectives per step and the busiest rank's share of the sharded state against
the ideal 1/N.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import types
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ._memory.estimate import STAGE_NAMES, MemoryEstimate, estimate_memory

__all__ = ["plan", "parse_bytes", "build_parser", "main"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def plan(
    model: nn.Module,
    *,
    world_size: int,
    budget_bytes: int,
    stages: Sequence[int] = (0, 1, 2, 3),
    **estimate_kwargs: Any,
) -> list[MemoryEstimate]:
    """The stages whose estimated peak fits in ``budget_bytes`` per rank, cheapest first.

    Cheapest means fewest bytes sent per rank and step; ties (DDP, ZeRO-1 and ZeRO-2 all send
    twice the model) go to the lower stage: a stage that shards more is chosen only when a less
    sharded one does not fit. Other keyword arguments go
    to :func:`sharded.estimate_memory` (``optimizer``, ``wrap``, ``example_input``...).
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes!r}")
    estimates = [estimate_memory(model, world_size=world_size, stage=s, **estimate_kwargs) for s in stages]
    return _fitting(estimates, budget_bytes)


def _fitting(estimates: Sequence[MemoryEstimate], budget_bytes: int) -> list[MemoryEstimate]:
    fitting = [e for e in estimates if e.peak_bytes <= budget_bytes]
    return sorted(fitting, key=lambda e: (e.bytes_sent, e.stage))


def parse_bytes(text: str) -> int:
    """``"40GiB"``, ``"512 MiB"``, ``"1.5e9"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 40GiB, 512MiB or 1.5e9")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def fit_table(model: nn.Module, world_size: int, budget: int, stages: Sequence[int], **kwargs: Any) -> str:
    """The one-world-size table the command prints."""
    params = sum(p.numel() for p in model.parameters())
    rows = [f"{params / 1e9:.2f}B parameters, {world_size} ranks, budget {_gib(budget)} per rank", "",
            f"{'stage':<8}{'peak/rank':>13}{'params':>12}{'grads':>12}{'optim':>12}{'comm':>12}{'activ':>12}{'sent/step':>13}  fits"]
    estimates = [estimate_memory(model, world_size=world_size, stage=s, **kwargs) for s in stages]
    chosen = _fitting(estimates, budget)
    for e in estimates:
        fits = "yes" if e.peak_bytes <= budget else "no"
        rows.append(f"{e.name:<8}{_gib(e.peak_bytes):>13}{_gib(e.parameters):>12}{_gib(e.gradients):>12}"
                    f"{_gib(e.optimizer_state):>12}{_gib(e.communication):>12}{_gib(e.activations):>12}{_gib(e.bytes_sent):>13}  {fits}")
    rows.append("")
    rows.append(f"choose: {chosen[0].name}" if chosen else "nothing fits: more ranks, a smaller model or a larger budget")
    return "\n".join(rows)


def account_table(model: nn.Module, world_sizes: Sequence[int], stages: Sequence[int], **kwargs: Any) -> str:
    """Per stage and world size: bytes per rank, bytes sent per step, collectives, busiest share."""
    params = sum(p.numel() for p in model.parameters())
    rows = [f"{params / 1e9:.2f}B parameters; per rank: peak bytes, bytes sent per step, collectives per step, "
            "busiest rank's share of the sharded state x N (1.00 = even)", "",
            f"{'stage':<8}{'ranks':>7}{'peak/rank':>13}{'sent/step':>13}{'calls':>8}{'share x N':>11}"]
    for s in stages:
        for n in world_sizes:
            e = estimate_memory(model, world_size=n, stage=s, **kwargs)
            share = e.largest_share * n if s else 1.0
            rows.append(f"{e.name:<8}{n:>7}{_gib(e.peak_bytes):>13}{_gib(e.bytes_sent):>13}{e.collectives:>8}{share:>11.2f}")
    return "\n".join(rows)


def load_factory(spec: str) -> Callable[[], nn.Module]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected MODULE:FACTORY, got {spec!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")
    factory = importlib.import_module(module_name)
    for part in attr.split("."):
        factory = getattr(factory, part)
    return factory  # type: ignore[return-value]


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (the docs site renders its reference from this parser)."""
    parser = argparse.ArgumentParser(prog="python -m sharded.plan", description=__doc__.splitlines()[0])
    parser.add_argument("factory", help="MODULE:FACTORY, a callable returning the model (built on the meta device)")
    parser.add_argument("--world-size", type=int, help="ranks to plan for")
    parser.add_argument("--budget", type=parse_bytes, help="bytes per rank, e.g. 40GiB")
    parser.add_argument("--world-sizes", help="comma-separated world sizes: print the account at scale")
    parser.add_argument(
        "--stages", "--stage", dest="stages", default="0,1,2,3",
        help="comma-separated ZeRO stages: 0 = DDP, 1-3 = sharded's layers 1-3 (default: all)",
    )
    parser.add_argument("--optimizer", default="Adam", help="a torch.optim class name (default Adam)")
    parser.add_argument("--wrap", default=None, help="MODULE:CLASS of the stage-3 units (default: none but the root)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m sharded.plan``: print the table of stages that fit, or the account at scale."""
    parser = build_parser()
    args = parser.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    bad = [s for s in stages if s not in STAGE_NAMES]
    if bad:
        parser.error(f"--stages: {bad[0]} is not a stage; use 0 (DDP), 1, 2 or 3")
    with torch.device("meta"):
        model = load_factory(args.factory)()
    kwargs: dict[str, Any] = {"optimizer": getattr(torch.optim, args.optimizer)}
    if args.wrap:
        kwargs["wrap"] = {load_factory(args.wrap)}
    if args.world_sizes:
        print(account_table(model, [int(n) for n in args.world_sizes.split(",")], stages, **kwargs))
        return 0
    if args.world_size is None or args.budget is None:
        parser.error("give --world-size and --budget, or --world-sizes")
    print(fit_table(model, args.world_size, args.budget, stages, **kwargs))
    return 0


class _CallableAsPlan(types.ModuleType):
    """This module, callable as :func:`plan`. ``sharded.plan`` is the function, but a program
    whose first import is ``import sharded.plan`` (this module, the command's) has Python set the
    package attribute to the module: ``sharded.plan(model, ...)`` must still plan."""

    def __call__(self, *args: Any, **kwargs: Any) -> list[MemoryEstimate]:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableAsPlan

if __name__ == "__main__":
    sys.exit(main())
