"""Checkpoints that reshard, for every layer, with torch.distributed.checkpoint (DCP) as the engine.

Save (collective; every rank writes what it holds, no rank gathers the optimizer state)::

    state = checkpoint.get_state_dict(model, optimizer)       # DDP / ShardedDataParallel / fully_shard / FSDP / plain
    state["step"] = step                                      # anything else you need back
    checkpoint.save(state, f"ckpt/step-{step:06d}")           # visible only once complete

Resume (collective; any world size, ZeRO-1 <-> ZeRO-2 <-> ZeRO-3 <-> plain single process)::

    state = checkpoint.get_state_dict(model, optimizer)       # the template: what this rank wants
    state["step"] = 0
    checkpoint.load(state, checkpoint.latest_checkpoint("ckpt"))
    checkpoint.set_state_dict(model, optimizer, state)
    step = state["step"]

Keys are the FQNs of the unwrapped model, and optimizer state is filed under its parameter's
FQN, so checkpoints do not depend on the world size, the sharding layer or parameter order.
The files are a standard DCP checkpoint: ``torch.distributed.checkpoint.save`` can write the
state dict too, and ``torch.distributed.checkpoint.load`` can fill the template in place (a fresh
optimizer's template holds placeholder state for it to fill; :func:`set_state_dict` refuses
placeholders nothing filled). :func:`load` also refuses to run code from the files, which DCP's
own reader does not guarantee. ``get_state_dict(..., full=True)`` gives rank 0 a plain torch
state dict for export.

Layer 3 (``fully_shard``, ``FullyShardedDataParallel``, or torch's own ``fully_shard``) goes
through the same functions with a plain torch optimizer over the DTensor parameters: DTensors are
saved shard by shard (each rank writes only its own) and loaded into staging DTensors laid out
like the model's.

Modules: ``_state_dict`` (the sharded and full forms of a model's and its optimizers' state),
``_names`` (FQNs, and optimizer state between torch's numbered form and FQN keys), ``_save``
(atomic publish), ``_load`` (validated first, then all or nothing), ``_storage`` (the allow-listed,
verifying reader: the only place a checkpoint is read), ``_fit_checks`` (does it fit: the errors),
``_peers`` (a lost or silent rank, told by ``_heartbeat`` and ``_silent_peers``), ``_ranks``, ``_paths``, ``_placeholders``.
"""

from __future__ import annotations

from ._fit_checks import CheckpointError
from ._load import load
from ._peers import PeerFailure, PeerWatch, detect_peer_failure
from ._save import latest_checkpoint, save
from ._state_dict import get_state_dict, set_state_dict

__all__ = [
    "CheckpointError",
    "PeerFailure",
    "PeerWatch",
    "detect_peer_failure",
    "get_state_dict",
    "latest_checkpoint",
    "load",
    "save",
    "set_state_dict",
]
