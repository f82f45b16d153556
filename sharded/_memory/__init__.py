"""The memory planner behind :func:`sharded.estimate_memory` and ``python -m sharded.plan``.

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
