"""Train one small character model three ways and show what each rank holds.

    torchrun --standalone --nproc-per-node 2 examples/demo_oss.py

1. DDP + torch.optim.AdamW                          (every rank: all state, all gradients)
2. DDP + sharded.OSS(AdamW)                          (ZeRO-1: optimizer state sharded)
3. sharded.ShardedDataParallel + sharded.OSS(AdamW)  (ZeRO-2: gradients sharded too)

The three runs start from the same weights and see the same batches, so their losses agree; what
differs is the memory each rank holds, printed per rank at the end. Uses NCCL and one GPU per rank
when CUDA is available, gloo on CPU otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, ShardedDataParallel


def corpus() -> torch.Tensor:
    """Bytes of the standard library's json package source: real text that ships with Python."""
    files = sorted(Path(json.__file__).parent.glob("*.py"))
    return torch.tensor(list(b"".join(f.read_bytes() for f in files)), dtype=torch.long)


class CharModel(nn.Module):
    """A small causal transformer over bytes."""

    def __init__(self, dim: int = 128, layers: int = 2, seq: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, dim)
        self.pos = nn.Embedding(seq, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        return self.head(self.blocks(h, mask=mask, is_causal=True))


def batch(text: torch.Tensor, step: int, rank: int, size: int, seq: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    starts = torch.randint(0, len(text) - seq - 1, (size,), generator=g)
    return torch.stack([text[s : s + seq + 1] for s in starts]).to(device)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run(mode: str, text: torch.Tensor, args, device) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = CharModel(seq=args.seq).to(device)
    adamw = dict(lr=3e-3, weight_decay=0.01)
    if mode == "ddp":
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)
        wrapped = DDP(model)
    else:
        optimizer = OSS(model.parameters(), torch.optim.AdamW, **adamw)
        wrapped = DDP(model) if mode == "zero1" else ShardedDataParallel(model, optimizer)
    for step in range(args.steps):
        tokens = batch(text, step, rank, args.batch, args.seq, device)
        optimizer.zero_grad()
        logits = wrapped(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        loss.backward()
        grad_bytes = tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
        optimizer.step()
    inner = optimizer.optim if isinstance(optimizer, OSS) else optimizer
    state_bytes = tensor_bytes(v for s in inner.state.values() for v in s.values() if torch.is_tensor(v))
    loss_sum = loss.detach().clone()
    dist.all_reduce(loss_sum)
    return {
        "loss": loss_sum.item() / dist.get_world_size(),
        "state": state_bytes,
        "grads": grad_bytes,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def gather_ints(value: int, device) -> list[int]:
    mine = torch.tensor([value], device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [int(t.item()) for t in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    text = corpus()

    results = {mode: run(mode, text, args, device) for mode in ("ddp", "zero1", "zero2")}
    labels = {"ddp": "DDP + AdamW", "zero1": "DDP + OSS(AdamW)", "zero2": "ShardedDDP + OSS(AdamW)"}
    rows = []
    for mode, result in results.items():
        drift = max((a - b).abs().max().item() for a, b in zip(result["params"], results["ddp"]["params"]))
        rows.append((labels[mode], result["loss"], drift, gather_ints(result["state"], device), gather_ints(result["grads"], device)))
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"\n{args.steps} AdamW steps on {len(text):,} bytes of Python's json source, {world} ranks\n")
        header = f"{'setup':<26}{'final loss':>11}{'max |Δ| vs DDP':>16}" + "".join(
            f"{f'rank {r} state':>15}{f'rank {r} grads':>15}" for r in range(world)
        )
        print(header)
        for label, loss, drift, state, grads in rows:
            cells = "".join(f"{s / 2**20:>12.2f}MiB{g / 2**20:>12.2f}MiB" for s, g in zip(state, grads))
            print(f"{label:<26}{loss:>11.4f}{drift:>16.2e}{cells}")
        print("\nstate: optimizer state bytes per rank; grads: gradient bytes held after backward")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
