"""Pure tests of how FullyShardedDataParallel reads its arguments (torch FSDP1's, fairscale's and
Lightning's spellings) into one FSDP1Options: no ranks, no process group, nothing sharded."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging

import pytest
import torch
from torch import nn

from sharded.fsdp import BackwardPrefetch, CPUOffload, CPUOffloadPolicy, FullyShardedDataParallel, MixedPrecision
from sharded.fsdp import MixedPrecisionPolicy, ShardingStrategy
from sharded.fsdp._fsdp1_options import FSDP1Options, fsdp1_options
from sharded.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

# Stand-ins: the options only carry groups and meshes to the build, never use them.
SHARD_GROUP, REPLICATE_GROUP, MESH = object(), object(), object()
COMPATIBILITY_ONLY = {"forward_prefetch", "limit_all_gathers", "flatten_parameters"}


def test_defaults_are_fsdp1s():
    options = fsdp1_options()
    assert options == FSDP1Options()
    assert options.strategy is ShardingStrategy.FULL_SHARD
    assert options.reshard_after_forward is None and not options.hybrid
    assert options.offload_policy is None and options.buffer_dtype is None
    assert options.mp_policy(root=True) == MixedPrecisionPolicy() == options.mp_policy(root=False)
    assert options.backward_prefetch is BackwardPrefetch.BACKWARD_PRE
    assert options.wrap_policy is None and options.device is None and options.ignored_modules == ()


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        fsdp1_options().strategy = ShardingStrategy.NO_SHARD  # type: ignore[misc]


def test_the_wrapper_passes_every_argument_that_acts_with_the_same_default():
    wrapper = inspect.signature(FullyShardedDataParallel.__init__).parameters
    options = inspect.signature(fsdp1_options).parameters
    acting = set(wrapper) - {"self", "module"} - COMPATIBILITY_ONLY
    assert acting == set(options)
    for name in acting:
        assert options[name].default == wrapper[name].default, name


# ------------------------------------------------------------------------ torch FSDP1's spelling


@pytest.mark.parametrize(
    "strategy, reshard_after_forward, hybrid",
    [
        (ShardingStrategy.FULL_SHARD, None, False),
        (ShardingStrategy.SHARD_GRAD_OP, False, False),
        (ShardingStrategy.NO_SHARD, False, False),
        (ShardingStrategy.HYBRID_SHARD, None, True),
        (ShardingStrategy._HYBRID_SHARD_ZERO2, False, True),
    ],
)
def test_each_sharding_strategy_maps_to_fully_shards_reshard_and_hybrid(strategy, reshard_after_forward, hybrid):
    options = fsdp1_options(sharding_strategy=strategy)
    assert options.strategy is strategy
    assert options.reshard_after_forward is reshard_after_forward
    assert options.hybrid is hybrid


def test_torchs_enums_map_by_name_and_other_values_raise():
    """Code written for torch's FSDP passes torch's enums: each member means what ours of that name does."""
    from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    for theirs in TorchStrategy:
        assert fsdp1_options(sharding_strategy=theirs).strategy is ShardingStrategy[theirs.name]
    for prefetch in TorchPrefetch:
        assert fsdp1_options(backward_prefetch=prefetch).backward_prefetch is BackwardPrefetch[prefetch.name]
    with pytest.raises(TypeError, match="sharding_strategy must be a ShardingStrategy"):
        fsdp1_options(sharding_strategy="FULL_SHARD")
    with pytest.raises(TypeError, match="backward_prefetch must be a BackwardPrefetch"):
        fsdp1_options(backward_prefetch=1)


def test_cpu_offload_sharded_and_torch_spellings():
    from torch.distributed.fsdp import CPUOffload as TorchCPUOffload

    for given, offloads in ((CPUOffload(offload_params=True), True), (CPUOffload(), False), (TorchCPUOffload(offload_params=True), True)):
        options = fsdp1_options(cpu_offload=given)
        assert options.offload_params is offloads, given
        assert options.offload_policy == (CPUOffloadPolicy() if offloads else None), given


def test_mixed_precision_is_kept_and_casts_the_roots_inputs_by_its_own_switch():
    mixed = MixedPrecision(torch.bfloat16, torch.float32, torch.float16, cast_forward_inputs=False, cast_root_forward_inputs=True)
    options = fsdp1_options(mixed_precision=mixed, compute_dtype=torch.float64, fp32_reduce_scatter=True)
    assert options.mixed_precision is mixed, "fairscale's compute_dtype and fp32_reduce_scatter only go with mixed_precision=True"
    assert options.buffer_dtype is torch.float16
    assert options.mp_policy(root=True) == MixedPrecisionPolicy(torch.bfloat16, torch.float32, cast_forward_inputs=True)
    assert options.mp_policy(root=False) == MixedPrecisionPolicy(torch.bfloat16, torch.float32, cast_forward_inputs=False)


def test_wrap_policy_shapes():
    callable_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})
    by_class = ModuleWrapPolicy({nn.Linear})
    assert fsdp1_options(auto_wrap_policy=callable_policy).wrap_policy is callable_policy
    assert fsdp1_options(auto_wrap_policy=by_class).wrap_policy is by_class
    from_set = fsdp1_options(auto_wrap_policy={nn.Linear}).wrap_policy
    assert isinstance(from_set, ModuleWrapPolicy) and from_set.module_classes == (nn.Linear,)


def test_device_id_as_a_cuda_index_or_a_device():
    assert fsdp1_options(device_id=1).device == torch.device("cuda", 1)
    assert fsdp1_options(device_id=torch.device("cpu")).device == torch.device("cpu")


def test_the_other_arguments_pass_through():
    ignored = nn.Linear(2, 2)

    def init(module: nn.Module) -> None:
        pass

    options = fsdp1_options(
        process_group=SHARD_GROUP,
        device_mesh=MESH,
        backward_prefetch=None,
        ignored_modules=(m for m in [ignored]),
        param_init_fn=init,
        sync_module_states=True,
    )
    assert options.process_group is SHARD_GROUP and options.device_mesh is MESH
    assert options.backward_prefetch is None
    assert options.ignored_modules == (ignored,), "an iterable of modules becomes a tuple"
    assert options.param_init_fn is init and options.sync_module_states
    assert fsdp1_options(backward_prefetch=BackwardPrefetch.BACKWARD_POST).backward_prefetch is BackwardPrefetch.BACKWARD_POST


def test_use_orig_params_false_is_logged_and_treated_as_true(caplog):
    with caplog.at_level(logging.INFO, logger="sharded.fsdp._fsdp1_options"):
        options = fsdp1_options(use_orig_params=False)
    assert options == FSDP1Options()
    assert "use_orig_params=False is treated as True" in caplog.text


def test_a_group_pair_goes_with_a_hybrid_strategy():
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        options = fsdp1_options(process_group=(SHARD_GROUP, REPLICATE_GROUP), sharding_strategy=strategy)
        assert options.process_group == (SHARD_GROUP, REPLICATE_GROUP)


# --------------------------------------------------------------------------- fairscale's spelling


@pytest.mark.parametrize("reshard, strategy", [(True, ShardingStrategy.FULL_SHARD), (False, ShardingStrategy.SHARD_GRAD_OP)])
def test_fairscale_reshard_after_forward_is_a_strategy(reshard, strategy):
    assert fsdp1_options(reshard_after_forward=reshard).strategy is strategy


@pytest.mark.parametrize(
    "arguments, offloads",
    [
        (dict(move_params_to_cpu=True), True),
        (dict(move_params_to_cpu=True, cpu_offload=CPUOffload(offload_params=False)), True),
        (dict(cpu_offload=True), True),
        (dict(cpu_offload=False), False),
    ],
)
def test_fairscale_offload_spellings(arguments, offloads):
    assert fsdp1_options(**arguments).offload_params is offloads


@pytest.mark.parametrize(
    "arguments, expected",
    [
        (dict(mixed_precision=True), MixedPrecision(torch.float16, torch.float16)),
        (dict(mixed_precision=True, compute_dtype=torch.bfloat16), MixedPrecision(torch.bfloat16, torch.bfloat16)),
        (dict(mixed_precision=True, fp32_reduce_scatter=True), MixedPrecision(torch.float16, torch.float32)),
        (dict(mixed_precision=False, compute_dtype=torch.bfloat16, fp32_reduce_scatter=True), None),
    ],
)
def test_fairscale_mixed_precision_flag(arguments, expected):
    options = fsdp1_options(**arguments)
    assert options.mixed_precision == expected
    if expected is not None:
        assert options.mp_policy(root=True) == MixedPrecisionPolicy(expected.param_dtype, expected.reduce_dtype)


def test_fairscale_fsdp_auto_wrap_policy_is_the_wrap_policy():
    assert fsdp1_options(fsdp_auto_wrap_policy={nn.Linear}).wrap_policy.module_classes == (nn.Linear,)


# --------------------------------------------------------------------------- Lightning's spelling


def test_what_lightnings_strategy_passes():
    """``lightning._fsdp_setup.shard_module``: converted types, a root device, a hybrid mesh it built."""
    options = fsdp1_options(
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        cpu_offload=CPUOffload(),
        mixed_precision=None,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        device_id=torch.device("cpu"),
        device_mesh=MESH,
    )
    assert options.strategy is ShardingStrategy.HYBRID_SHARD and options.hybrid
    assert options.reshard_after_forward is None and not options.offload_params and options.mixed_precision is None
    assert options.device == torch.device("cpu") and options.device_mesh is MESH


# --------------------------------------------------------------------------------------- errors


def _raises(error: type, *words: str):
    return pytest.raises(error, match="^rank 0: .*" + ".*".join(words))


def test_both_wrap_policy_spellings_raise():
    with _raises(ValueError, "auto_wrap_policy", "fsdp_auto_wrap_policy", "not both"):
        fsdp1_options(auto_wrap_policy={nn.Linear}, fsdp_auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def test_a_wrap_policy_of_no_known_shape_raises():
    for arguments in (dict(auto_wrap_policy={"Linear"}), dict(fsdp_auto_wrap_policy=[nn.Linear, 3])):
        with _raises(TypeError, "auto_wrap_policy", "callable or module classes"):
            fsdp1_options(**arguments)


@pytest.mark.parametrize("reshard", [True, False])
def test_a_strategy_and_fairscales_reshard_after_forward_raise(reshard):
    with _raises(ValueError, "sharding_strategy", "reshard_after_forward", "not both"):
        fsdp1_options(sharding_strategy=ShardingStrategy.FULL_SHARD, reshard_after_forward=reshard)


@pytest.mark.parametrize(
    "arguments, name",
    [
        (dict(), "FULL_SHARD"),
        (dict(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP), "SHARD_GRAD_OP"),
        (dict(sharding_strategy=ShardingStrategy.NO_SHARD), "NO_SHARD"),
        (dict(reshard_after_forward=False), "SHARD_GRAD_OP"),
    ],
)
def test_a_group_pair_without_a_hybrid_strategy_raises(arguments, name):
    with _raises(ValueError, r"\(shard_group, replicate_group\) pair", f"not {name}$"):
        fsdp1_options(process_group=(SHARD_GROUP, REPLICATE_GROUP), **arguments)
