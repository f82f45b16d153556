"""Reference runs and models for the layer-3 tests: torch DDP + the plain optimizer beside
``fully_shard`` / ``FullyShardedDataParallel``, trained on the same batches, compared with stated
tolerances.

Tolerances (:func:`assert_matches_ddp`):

* SGD (with momentum): the update is linear in the gradient, and the only difference to DDP is
  how the ranks' gradients are averaged (DDP divides each by the world size and sums; the
  reduce-scatter sums and divides): bit-equal at world 1 and 2, float32 ulps apart at world 3.
  ``ATOL``/``RTOL`` = 1e-6/1e-5.
* Adam(W): ``m / sqrt(v)`` is scale-free, so ulp noise on a gradient that is ~0 can move that
  element by up to ``lr`` per step, by an amount that depends on which roundings flip and so on
  the CPU's kernels: no bound is both machine-independent and tight. So AdamW is compared bit for
  bit (``exact=True``): the caller trains at world 3 on rank 0's batches and DDP averages after
  the sum (tests/_exact_sums.py). Where that cannot be (a unit that sends its gradients twice in
  one backward, an optimizer stepping on another device than the reference's, a clip factor an
  ulp off torch's), ``exact=False``: the worst element may differ by ``0.1 * lr * steps``, the
  mean difference must stay at rounding level (1e-6).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from examples.gpt import GPT
from tests import _harness
from tests._device import on_test_device
from tests._models import gpt_loss, token_batch

# Every rank forks from the harness's forkserver: have it import DTensor (layer 3) and what DDP's
# first build imports (dynamo) once, instead of each rank of each launch paying ~1.5 s for each.
_harness._PRELOAD.extend(m for m in ("sharded.fsdp.api", "torch._dynamo") if m not in _harness._PRELOAD)

ATOL, RTOL = 1e-6, 1e-5
STEPS = 5
SGD = (torch.optim.SGD, dict(lr=0.05, momentum=0.9))
ADAMW = (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1))


def optimizers_for(optim, *models) -> list[torch.optim.Optimizer]:
    """One optimizer of ``optim`` (a ``(class, kwargs)`` pair such as :data:`SGD`) per model."""
    cls, kwargs = optim
    return [cls(m.parameters(), **kwargs) for m in models]


def full_tensors(tensors) -> list[torch.Tensor]:
    """Full copies, never aliases (collective for DTensors: every rank, in the same order)."""
    return [t.full_tensor().clone() if isinstance(t, DTensor) else t.detach().clone() for t in tensors]


def assert_matches_ddp(ours: nn.Module, ref: nn.Module, what: str, optim=SGD, steps: int = STEPS, atol=ATOL, rtol=RTOL,
                       exact: bool = True) -> None:
    """``ours`` (sharded) holds the parameters ``ref`` (trained by DDP) holds; every rank
    checks, so every rank ends identical to DDP. AdamW: bit for bit unless ``exact=False``."""
    names = [name for name, _ in ours.named_parameters()]
    mine, theirs = full_tensors(ours.parameters()), [p.detach() for p in ref.parameters()]
    assert len(mine) == len(theirs), f"{what}: {len(mine)} parameters against DDP's {len(theirs)}"
    mine = [a.to(b.device) for a, b in zip(mine, theirs)]  # an offloaded model's come from the CPU
    if optim[0] is torch.optim.AdamW and exact:
        for name, a, b in zip(names, mine, theirs):
            assert torch.equal(a, b), f"{what}: {name} differs from DDP by {(a - b).abs().max().item():.3g}"
        return
    if optim[0] is torch.optim.AdamW:
        lr = optim[1]["lr"]
        diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(mine, theirs)])
        assert diffs.max() <= 0.1 * lr * steps, f"{what}: max diff {diffs.max():.3g}"
        assert diffs.mean() <= 1e-6, f"{what}: mean diff {diffs.mean():.3g}"
        return
    for name, a, b in zip(names, mine, theirs):
        if not torch.allclose(a, b, atol=atol, rtol=rtol):
            raise AssertionError(f"{what}: {name} differs from DDP by {(a - b).abs().max().item():.3g}")


def train_recording(model: nn.Module, rank: int, optimizer=None, first: int = 0, steps: int = 3, loss_fn=gpt_loss, batch_fn=token_batch):
    """``steps`` steps of SGD with momentum (``optimizer``, else one built now), every
    parameter required to get a gradient; returns the losses and the final full parameters."""
    optimizer = optimizer or optimizers_for(SGD, model)[0]
    losses = []
    for step in range(first, first + steps):
        optimizer.zero_grad()
        loss = loss_fn(model, batch_fn(rank, step))
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, f"no gradient for {missing}"
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), full_tensors(model.parameters())


def assert_same_as_torch(ours, theirs, what: str, exact: bool) -> None:
    """``ours`` and ``theirs`` (each ``(losses, full parameters)`` of one run, ours and torch's
    ``fully_shard``) are equal: bit for bit when ``exact``, else to float32 rounding (SGD's
    ``ATOL``/``RTOL``: where gloo's reduce-scatter adds in another order than ours)."""
    pairs = [("losses", ours[0], theirs[0])] + [("parameters", x, y) for x, y in zip(ours[1], theirs[1])]
    for name, a, b in pairs:
        if exact:
            assert torch.equal(a, b), f"{what}: {name} differ from torch's by {(a - b).abs().max():.3g}"
        else:
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {name}: {m}")


def train_both(pairs, rank: int, steps: int = STEPS, first: int = 0, loss_fn=gpt_loss, batch_fn=token_batch) -> None:
    """``steps`` steps of each ``(model, optimizer)`` in ``pairs`` on the same batches."""
    for step in range(first, first + steps):
        for model, optimizer in pairs:
            optimizer.zero_grad()
            loss_fn(model, batch_fn(rank, step)).backward()
            optimizer.step()


def shard_gpt(model: GPT, shard=None, **kwargs) -> GPT:
    """The usual layout: every block a unit, the root the unit for the rest; ``shard`` is the
    ``fully_shard`` to apply (default: ours; torch's for the reference runs)."""
    if shard is None:
        from sharded import fully_shard as shard

    for block in model.blocks:
        shard(block, **kwargs)
    return shard(model, **kwargs)


def local_bytes(tensors) -> int:
    """Bytes this rank holds for ``tensors`` (DTensors: the local shard; shared storage once)."""
    storages = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


class TiedGPT(GPT):
    """The GPT with its head tied to the token embedding (one Parameter, two names)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(64, 32, 2, 2, 16)
        self.head.weight = self.tok.weight
        on_test_device(self)


class UnevenNet(nn.Module):
    """Parameters of awkward shapes: 0-dim, one row, dim 0 not divisible by 2 or 3, fewer rows
    than ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.row = nn.Parameter(torch.randn(1, 6))
        self.emb = nn.Embedding(7, 6)
        self.lin = nn.Linear(6, 5)
        self.tiny = nn.Linear(5, 2)
        self.out = nn.Linear(2, 3)
        on_test_device(self)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens).mean(dim=1) * self.scale + self.row
        return self.out(torch.tanh(self.tiny(torch.relu(self.lin(x)))))


def uneven_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(30_000 + 100 * step + rank)
    return on_test_device(torch.randint(0, 7, (5, 4), generator=g)), on_test_device(torch.randn(5, 3, generator=g))


def uneven_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, target = batch
    return F.mse_loss(model(tokens), target)


class Twice(nn.Module):
    """A block that calls the same submodule twice in one forward, and changes its input in place."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.inner = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.mul_(0.5)
        return x + self.inner(torch.relu(self.inner(x)))


class TwoOutputs(nn.Module):
    """A unit with two outputs, the second independent of the input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.offset = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), self.offset * 2.0


class MixedBag(nn.Module):
    """Buffers (BatchNorm), a unit called twice that changes its input in place, a parameter no
    rank uses, one used on rank 0 only, and a unit whose backward runs twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(64, 16)
        self.norm = nn.BatchNorm1d(16)
        self.twice = Twice(16)
        self.unused = nn.Linear(16, 16)
        self.sometimes = nn.Linear(16, 16)
        self.two = TwoOutputs(16)
        self.head = nn.Linear(16, 64)
        self.register_buffer("anchor", torch.linspace(-1, 1, 16))
        on_test_device(self)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # first call on an input needing no gradient: its backward comes last, after the second
        # call's has already sent the unit's gradients, so the unit is gathered and sends again
        constant, _ = self.two(self.anchor)
        x = self.norm(self.embed(tokens).mean(dim=1))
        x = self.twice(self.twice(x))
        if dist.get_rank() == 0:
            x = x + self.sometimes(x)
        x, offset = self.two(x)
        return self.head(x + offset + constant).unsqueeze(1).expand(-1, tokens.shape[1], -1)


class CountCollectives:
    """Counts calls to torch.distributed's gathers and reductions while active (layer 3 looks
    them up at call time, so patching the module attributes sees them).

    Layer 3's own all-gathers are counted where they start, at ``sharded._common.comm``'s
    ``all_gather_into_tensor`` (on gloo that is one broadcast per rank, not a torch gather); a
    torch gather it makes inside is not counted again. A user's gather (``set_custom_all_gather``)
    calls torch's directly and is counted there."""

    GATHERS = ("all_gather_single", "all_gather_into_tensor")
    REDUCES = ("reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")

    def __enter__(self) -> "CountCollectives":
        from sharded._common import comm

        self.gathers, self.reduces, self.gathered_bytes = 0, 0, 0
        self._inside_comm_gather = False
        self._saved = {name: getattr(dist, name) for name in self.GATHERS + self.REDUCES if hasattr(dist, name)}
        for name, fn in self._saved.items():
            setattr(dist, name, self._counting(name, fn))
        self._comm, self._comm_gather = comm, comm.all_gather_into_tensor
        comm.all_gather_into_tensor = self._counting_comm_gather(self._comm_gather)
        return self

    def _count_gather(self, sent) -> None:
        self.gathers += 1
        self.gathered_bytes += sent.numel() * sent.element_size()

    def _counting_comm_gather(self, fn):
        def counted(output, input, *args, **kwargs):
            self._count_gather(input)
            self._inside_comm_gather = True
            try:
                return fn(output, input, *args, **kwargs)
            finally:
                self._inside_comm_gather = False

        return counted

    def _counting(self, name, fn):
        def counted(*args, **kwargs):
            if name in self.GATHERS:
                if not self._inside_comm_gather:
                    self._count_gather(args[1] if len(args) > 1 else kwargs.get("input_tensor"))
            else:
                self.reduces += 1
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc) -> None:
        self._comm.all_gather_into_tensor = self._comm_gather
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
