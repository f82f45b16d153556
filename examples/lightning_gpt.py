"""The example GPT (examples/gpt.py) trained with ``lightning.Trainer``, sharded by changing one line.

    python examples/lightning_gpt.py --strategy ddp            # Lightning's own DDP
    python examples/lightning_gpt.py --strategy ddp_sharded    # ZeRO-2: optimizer state + gradients sharded
    python examples/lightning_gpt.py --strategy ddp_zero1      # ZeRO-1: optimizer state sharded
    python examples/lightning_gpt.py --strategy sharded_fsdp   # ZeRO-3: parameters sharded too

The whole change from DDP is ``import sharded.lightning`` and the strategy's name::

    import sharded.lightning  # registers "ddp_sharded", "ddp_zero1" and "sharded_fsdp"
    trainer = L.Trainer(strategy="ddp_sharded", ...)      # was: strategy="ddp"

Lightning starts the processes itself (``--devices``, default 2; on a machine without GPUs they
are CPU processes talking over gloo), or takes them from torchrun / SLURM. The text is Python's
own standard library, as in examples/train_gpt.py; no download. ``ddp``, ``ddp_zero1`` and
``ddp_sharded`` train the same numbers: the validation loss printed at the end agrees between
them. ``sharded_fsdp`` builds the model on the meta device and initialises each block as it
shards it, in another order, so it starts from other random weights. ``--resume`` continues from
``<out>/last.ckpt``.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import sharded.lightning  # noqa: F401  registers the strategies
from gpt import GPT, Block, next_token_loss  # examples/gpt.py, beside this script
from sharded.lightning import ShardedFSDPStrategy

VOCAB = 256  # bytes


class Windows(Dataset):
    """``count`` windows of ``seq + 1`` bytes at fixed random offsets into ``data``."""

    def __init__(self, data: torch.Tensor, seq: int, count: int, seed: int) -> None:
        self.data, self.seq = data, seq
        self.starts = torch.randint(0, len(data) - seq - 1, (count,), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = int(self.starts[index])
        return self.data[start : start + self.seq + 1]


class GPTModule(L.LightningModule):
    """The GPT with AdamW (decay on matrices only) and a cosine learning-rate schedule.

    The model is built in ``configure_model``, which Lightning calls once the processes are up:
    under ``sharded_fsdp`` it runs on the meta device, and each block is materialised only when
    it is sharded, so the whole model never exists on one rank.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            a = self.args
            self.model = GPT(VOCAB, a.dim, a.layers, a.heads, a.seq)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = next_token_loss(self.model, batch)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", next_token_loss(self.model, batch), sync_dist=True)

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        others = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=self.args.lr, betas=(0.9, 0.95))
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.args.steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def stdlib_text() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) bytes of the standard library's top-level modules."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8).long()
    split = int(0.9 * len(data))
    return data[:split], data[split:]


def strategy_for(args: argparse.Namespace):
    """The strategy by name; for ZeRO-3, an object to say which layers are units of their own."""
    if args.strategy == "sharded_fsdp":
        return ShardedFSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full")
    return args.strategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp_sharded", help="ddp, ddp_zero1, ddp_sharded or sharded_fsdp")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed, 16-mixed")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (by the global norm)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--out", default="lightning_out")
    parser.add_argument("--resume", action="store_true", help="continue from <out>/last.ckpt")
    args = parser.parse_args()

    L.seed_everything(0)
    train, val = stdlib_text()
    samples = args.steps * args.accumulate * args.batch * args.devices
    train_loader = DataLoader(Windows(train, args.seq, samples, seed=1), batch_size=args.batch, shuffle=True)
    val_loader = DataLoader(Windows(val, args.seq, args.val_batches * args.batch * args.devices, seed=2), batch_size=args.batch)
    trainer = L.Trainer(
        strategy=strategy_for(args),  # the one line that differs from DDP: strategy="ddp"
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip,
        default_root_dir=args.out,
        callbacks=[ModelCheckpoint(dirpath=args.out, save_last=True, save_top_k=0)],
        logger=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = GPTModule(args)
    resume = Path(args.out, "last.ckpt")
    before = trainer.validate(module, val_loader, verbose=False)[0]["val_loss"]
    trainer.fit(module, train_loader, ckpt_path=str(resume) if args.resume and resume.exists() else None)
    after = trainer.validate(module, val_loader, verbose=False)[0]["val_loss"]
    if trainer.is_global_zero:
        print(f"{args.strategy}: validation loss {before:.6f} -> {after:.6f} after {trainer.global_step} steps", flush=True)
    if torch.distributed.is_initialized():  # Lightning leaves it up; gloo's threads must not outlive it
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
