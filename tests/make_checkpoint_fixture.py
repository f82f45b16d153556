"""Write tests/data/<name>/: a checkpoint of ``sharded.fully_shard`` at world 2, saved by
``sharded.checkpoint.save`` under the torch this runs with, and ``expected.json``: its full state
as the writer saw it (every float written with ``repr``, so the numbers come back exactly).

tests/test_checkpoint_versions.py loads it under whatever torch the suite runs with: a checkpoint
written by a newer torch (2.15 adds ``strides`` to DCP's index) must load exactly or stop with an
error naming both versions. Regenerate with the writer's torch (the checkpoint is committed)::

    torchrun --nproc-per-node 2 tests/make_checkpoint_fixture.py tests/data/torch-2.15-world-2
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

import sharded
from sharded import checkpoint


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A two-layer model whose values are plain arithmetic, the same under every torch."""
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            param.copy_(torch.arange(param.numel(), dtype=torch.float32).reshape(param.shape) / (7 + index))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def main(directory: str) -> None:
    dist.init_process_group("gloo")
    model, _ = model_and_optimizer()
    for layer in model:
        sharded.fully_shard(layer)
    sharded.fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(0)
    for _ in range(2):
        model(torch.randn(5, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint.save(checkpoint.get_state_dict(model, optimizer), f"{directory}/checkpoint")
    full = checkpoint.get_state_dict(model, optimizer, full=True)
    if dist.get_rank() == 0:
        expected = {"torch": torch.__version__, "state": as_json(full)}
        with open(f"{directory}/expected.json", "w") as stream:
            json.dump(expected, stream, indent=1, sort_keys=True)
    dist.destroy_process_group()


def as_json(value: object) -> object:
    """``value`` (a state dict) as JSON: tensors as dtype, shape and each float's repr."""
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype), "shape": list(value.shape), "values": [repr(x) for x in value.flatten().tolist()]}
    if isinstance(value, dict):
        return {str(key): as_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_json(item) for item in value]
    return value


if __name__ == "__main__":
    main(sys.argv[1])
