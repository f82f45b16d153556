"""Where a unit's parameters live: the mesh it shards over and the DTensor layout of its shards.

- :mod:`.mesh`: the 1-D or hybrid 2-D ``DeviceMesh`` a unit shards over, and its groups.
- :mod:`.spmd`: ``fully_shard(mesh=..., dp_mesh_dims=...)`` on an N-D SPMD mesh.
- :mod:`.dtensor`: parameters that are already DTensors (tensor parallel): how their local
  tensors are sharded and put back.
- :mod:`.owned`: ``shard_placement_fn``'s ``Owned()``: a parameter kept whole on one rank of the
  shard group (a DTensor on its owner mesh), owners balanced by step cost.
- :mod:`.secondary_shard`: ``reshard_after_forward=int``: the secondary shard a unit keeps after
  forward, and the smaller group that gathers it in backward.
"""
