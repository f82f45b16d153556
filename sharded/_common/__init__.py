"""What every layer uses: nothing here knows about owners, units or checkpoints.

- :mod:`.comm`: the collectives, the one home of backend quirks (gloo's missing ops, the renamed
  ``*_into_tensor`` calls, object transfer without object collectives).
- :mod:`.peers`: what the backend tells about peers (which errors mean one failed, the
  process group's timeout, the operations issued) and the rendezvous store.
- :mod:`.errors`: the rank prefix every error message starts with (the global rank).
- :mod:`.dtensors`: DTensors told apart and gathered without importing DTensor; the one full
  model state dict.
- :mod:`.flat`: packing many tensors into size-bounded flat buckets, and the default bucket size.
- :mod:`.broadcast`: bucketed broadcasts from the ranks that hold the true values (OSS's updated
  parameters, ShardedDataParallel's buffers, the FSDP wrapper's ``sync_module_states``).
- :mod:`.in_flight`: how many sends a rank keeps in flight during backward (layers 2 and 3),
  read by the mechanism and the memory planner alike.
- :mod:`.checks`: argument checks and the cross-rank "same model everywhere" check.
- :mod:`.norm`: the one global gradient norm and clipping, for every stage.
- :mod:`.optimizers`: what the layers need to know about a ``torch.optim`` class and its groups.
- :mod:`.step_checks`: checks every optimizer step runs first, each installed once.
- :mod:`.torch_routes`: torch's functions that a layer routes to its own, wrapped once per process.
- :mod:`.step_cost`: what a whole-matrix optimizer's step costs per parameter (Muon's
  Newton–Schulz), which owner placements balance (``OSS``'s partition, layer 3's ``Owned``).
"""
