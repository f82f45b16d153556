"""The memory planner behind :func:`sharded.estimate_memory` and ``python -m sharded.plan``.

It plans per *stage*, the ZeRO stage a configuration trains with, because it plans plain DDP too:
stage 0 is DDP with the plain optimizer (nothing sharded), and stages 1, 2 and 3 are run by
sharded's layers of the same numbers: layer 1 (DDP + ``OSS``), layer 2 (``ShardedDataParallel``
+ ``OSS``), layer 3 (``fully_shard`` / ``FullyShardedDataParallel``). ``STAGE_NAMES`` gives each
its printed name (``DDP``, ``ZeRO-1``...).

- :mod:`.layout`: what one stage places on its busiest rank (``Layout``) and the constants the
  walks share.
- :mod:`.replicated`: the walk for DDP and ZeRO-1/2 (the partition and reduce buckets the stages
  really use); :mod:`.zero3`: the walk for ZeRO-3 (the units and padded shard slots).
- :mod:`.trial`: the optimizer state and activations, measured by running the optimizer and one
  forward/backward on meta and fake tensors.
- :mod:`.estimate`: the estimate itself, the largest of the step's three worst moments.

Nothing here allocates a real tensor; the planner imports the stages' own planners, never the
reverse.
"""
