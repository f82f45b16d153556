"""Layers 1-2 (ZeRO-1 ``OSS``, ZeRO-2 ``ShardedDataParallel``): one owner rank per parameter.

- :mod:`.partition`: which rank owns which parameter, balanced (a frozen plan, rebuilt and
  swapped in when the trainable set or the param groups change).
- :mod:`.step_cost`: what each parameter weighs in that balance: its bytes, or its step cost
  (Newton-Schulz for Muon's whole matrices, or the user's ``param_cost``).
- :mod:`.optim_state`: each owner's optimizer-state shard, and the full state dict assembled from
  and split into shards.
- :mod:`.reduce_plan`, :mod:`.reduce_pass`: the gradient buckets, each reduced to its owner, and
  one backward's fill and sends of them.
- :mod:`.grad_router`: the hooks that send each gradient to its owner during backward; it
  connects its parts: :mod:`.bucket_index` (where each gradient goes), :mod:`.learned_graph`
  (arrivals per gradient, ``static_graph``), :mod:`.late_grads` (gradients after their bucket
  left), :mod:`.held_averages` (averages a backward adds to after their reduce, set aside and
  given back), :mod:`.grad_checks` (gradients no bucket can carry), :mod:`.backward_stats`.
- :mod:`.broadcaster`: after a step, the owners' broadcasts of the updated parameters (their
  buckets, the parameters living in them, and the waits).
- :mod:`.lowbit_params`: those broadcasts in fewer bits (``OSS(lowbit=)``): the owners' exact
  masters, and each bucket's change from the replica sent encoded.
- :mod:`.param_waits`: hooks that wait for an updated parameter's broadcast just before use.
- :mod:`.compile_split`: splitting a compiled graph where a reduce bucket ends.
- :mod:`.torch_clip`: torch's ``clip_grad_norm_`` over a ``ShardedDataParallel``'s parameters
  routed to the global norm (the norm every rank's owned gradients make together).
- :mod:`.ddp_overlap`: under DDP, each bucket's owned parameters stepped and sent as that
  bucket's all-reduce finishes (``OSS(overlap_with_ddp=True)``).

The public modules on top are :mod:`sharded.oss` and :mod:`sharded.sharded_ddp`.
"""
