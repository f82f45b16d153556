"""Validation of user input, local and across ranks, with errors that name the culprit.

Sharding silently assumes every rank holds the same parameters in the same order: if one rank
does not, partitions disagree and training produces wrong numbers or hangs in a collective. The
cross-rank check here gathers a compact signature per parameter (two small collectives at set-up,
never per step) and, on a mismatch, names the first differing parameter, its shape on every rank,
and the ranks that differ.
"""

from __future__ import annotations

import zlib
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn

from . import comm
from .errors import on_rank

__all__ = [
    "as_param_groups",
    "check_dense",
    "check_no_sparse_grad_modules",
    "check_optimizer_class",
    "check_param_list",
    "check_same_across_ranks",
    "param_list",
]

_MAX_DIMS = 16


def check_optimizer_class(optim: Any, argument: str = "optim") -> None:
    """Raise unless ``optim`` is a plain first-order torch optimizer class that OSS can shard;
    ``argument`` is its name in the caller's signature, for the message."""
    if not (isinstance(optim, type) and issubclass(optim, torch.optim.Optimizer)):
        raise TypeError(
            f"{argument} must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, got {optim!r}"
        )
    if getattr(optim, "partition_parameters", None) is not None:
        raise TypeError(f"{argument} must be a plain optimizer class, not a sharded one")
    if issubclass(optim, torch.optim.LBFGS):
        raise TypeError(
            "LBFGS re-evaluates the closure a data-dependent number of times per step, which "
            "sharded ranks cannot agree on; use a first-order optimizer"
        )


def as_param_groups(params: Iterable[Any], rank: int) -> list[dict[str, Any]]:
    """``params`` as a list of param-group dicts (validated as each group is added)."""
    if isinstance(params, torch.Tensor):
        raise TypeError(on_rank("params should be an iterable of tensors or dicts, got a single tensor", rank))
    groups = list(params)
    if not groups:
        raise ValueError(on_rank("OSS got an empty parameter list", rank))
    return groups if isinstance(groups[0], dict) else [{"params": groups}]


def param_list(group: Any) -> list[Any]:
    """The ``params`` entry of a param-group dict, as a list."""
    if not isinstance(group, dict) or "params" not in group:
        raise TypeError(f"a param group must be a dict with a 'params' entry, got {group!r:.80}")
    params = group["params"]
    return [params] if isinstance(params, torch.Tensor) else list(params)


def check_param_list(params: Sequence[object], where: str, rank: int) -> None:
    """Raise if ``params`` holds anything a sharded optimizer cannot own.

    ``where`` describes the list in messages, e.g. ``"param group 1"``.
    """
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        name = f"{where}, parameter {i}"
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                on_rank(
                    f"{name} is a {type(p).__name__}, not a torch.Tensor; pass "
                    "tensors (e.g. model.parameters()) or dicts of them",
                    rank,
                )
            )
        if p.device.type == "meta":
            raise ValueError(
                on_rank(
                    f"{name} is on the meta device; materialize the model (e.g. "
                    "module.to_empty(device=...)) before building the optimizer",
                    rank,
                )
            )
        if not p.is_leaf:
            raise ValueError(
                on_rank(
                    f"{name} is not a leaf tensor; optimize the parameters "
                    "themselves, not tensors computed from them",
                    rank,
                )
            )
        check_dense([(f"{name} (shape {tuple(p.shape)})", p)], "OSS", rank)
        if id(p) in seen:
            raise ValueError(
                on_rank(
                    f"{name} is the same tensor as parameter {seen[id(p)]}; "
                    "each parameter may appear only once",
                    rank,
                )
            )
        seen[id(p)] = i


def check_dense(named: Iterable[tuple[str, torch.Tensor]], who: str, rank: Optional[int] = None) -> None:
    """Raise ``ValueError`` naming the first sparse tensor of ``named``: ``(name, tensor)`` pairs,
    each name saying which parameter it is (``"parameter embed.weight"``).

    Every layer lays parameters into flat buffers (owner broadcasts, reduce buckets, shards),
    which hold strided storage only; a sparse parameter, trainable or frozen, is refused when
    the layer is built instead of failing in torch's internals at the first collective (torch's
    ZeroRedundancyOptimizer refuses them with a ``ValueError`` too). ``who`` names the layer.
    """
    for name, tensor in named:
        if tensor.layout != torch.strided:
            raise ValueError(on_rank(
                f"{who}: {name} is a sparse tensor (layout {tensor.layout}); sharded shards dense parameters "
                "only. Make it dense (nn.Parameter(p.to_dense())), or keep it out of the sharded "
                "model and optimizer",
                rank,
            ))


def check_no_sparse_grad_modules(
    named_modules: Iterable[tuple[str, nn.Module]], who: str, rank: Optional[int] = None
) -> None:
    """Raise ``ValueError`` naming the first of ``named_modules`` known to produce sparse
    gradients for its dense weight (``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``,
    trainable): no reduce can carry them. Gradients made sparse any other way are refused where
    they are reduced."""
    for name, sub in named_modules:
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
            raise ValueError(on_rank(
                f"{who}: module {name or 'the root'} ({type(sub).__name__}) has sparse=True, so its "
                f"weight gets sparse gradients; {who} reduces dense gradients only. Build it with sparse=False, "
                "or use DistributedDataParallel, which reduces sparse gradients",
                rank,
            ))


def check_same_across_ranks(
    named_tensors: Sequence[tuple[str, torch.Tensor]], group: comm.ProcessGroup, what: str
) -> None:
    """Collective: raise on every rank unless all ranks hold tensors of the same names,
    shapes, dtypes and trainability in the same order.

    ``what`` says what is being compared in messages, e.g. ``"OSS parameters"``.
    """
    if comm.group_size(group) == 1:
        return
    counts = comm.all_gather_lengths(len(named_tensors), group)
    if len(set(counts)) > 1:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
        raise ValueError(f"{what} differ across ranks: different counts ({listing})")
    if not named_tensors:
        return
    signatures = torch.tensor(
        [_signature(name, t) for name, t in named_tensors],
        dtype=torch.int64,
        device=comm.comm_device(group),
    )
    gathered = torch.stack(comm.all_gather(signatures, group))
    differs = (gathered != gathered[0]).any(dim=0)
    if not differs.any():
        return
    index = int(differs.nonzero()[0])
    name, tensor = named_tensors[index]
    shapes = _gather_description(tensor, group)
    listing = "; ".join(f"rank {r}: {desc}" for r, desc in enumerate(shapes))
    raise ValueError(
        f"{what} differ across ranks at {name} (position {index}): {listing}. Every rank "
        "must build the same model and optimizer in the same order"
    )


def _signature(name: str, t: torch.Tensor) -> int:
    text = f"{name}|{tuple(t.shape)}|{t.dtype}|{t.requires_grad}"
    return zlib.crc32(text.encode())


def _gather_description(t: torch.Tensor, group: comm.ProcessGroup) -> list[str]:
    """Every rank's shape, dtype and trainability of its ``t``, as text."""
    dims = list(t.shape)[:_MAX_DIMS]
    code = [t.dim(), zlib.crc32(str(t.dtype).encode()), int(t.requires_grad)]
    encoded = torch.tensor(code + dims + [0] * (_MAX_DIMS - len(dims)), dtype=torch.int64)
    gathered = comm.all_gather(encoded.to(comm.comm_device(group)), group)
    dtype_names = {zlib.crc32(str(d).encode()): str(d) for d in _KNOWN_DTYPES}
    return [
        f"shape {tuple(g[3 : 3 + int(g[0])].tolist())}, "
        f"{dtype_names.get(int(g[1]), 'another dtype')}, requires_grad={bool(g[2])}"
        for g in gathered
    ]


_KNOWN_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
