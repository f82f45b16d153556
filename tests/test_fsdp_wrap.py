"""Auto-wrap policies pick the same units FSDP1 would, in every shape users bring them
(pure: no process group needed)."""

from __future__ import annotations

import functools

import pytest
from torch import nn

from examples.gpt import Block
from sharded.fsdp.wrap import (
    ModuleWrapPolicy,
    always_wrap_policy,
    as_wrap_policy,
    lambda_auto_wrap_policy,
    modules_to_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from tests._fsdp_reference import TiedGPT
from tests._models import gpt

BLOCK_POLICIES = {
    "set of classes (Lightning, Megatron)": {Block},
    "one class": Block,
    "ModuleWrapPolicy": ModuleWrapPolicy({Block}),
    "transformer_auto_wrap_policy": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    "lambda_auto_wrap_policy": functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, Block)),
}


@pytest.mark.parametrize("shape", list(BLOCK_POLICIES))
def test_every_policy_shape_wraps_the_blocks(shape):
    model = gpt(layers=3)
    assert modules_to_wrap(model, as_wrap_policy(BLOCK_POLICIES[shape])) == list(model.blocks)


def test_size_based_policy_wraps_modules_holding_enough_unwrapped_parameters_children_first():
    model = gpt(layers=2)  # each block: 12,704 parameters, 8,352 of them in its mlp
    blocks, mlps = list(model.blocks), [block.mlp for block in model.blocks]
    size = lambda n: functools.partial(size_based_auto_wrap_policy, min_num_params=n)  # noqa: E731
    # 8,000: each mlp; a block without its mlp keeps 4,352, too few, but the Sequential holding
    # both blocks' leftovers has 8,704 (FSDP1 excludes only ModuleList / ModuleDict)
    assert modules_to_wrap(model, size(8_000)) == [*mlps, model.blocks]
    # 4,300: no single Linear (4,224 at most), each mlp, then each block with the 4,352 left
    assert modules_to_wrap(model, size(4_300)) == [mlps[0], blocks[0], mlps[1], blocks[1]], "children first"
    assert modules_to_wrap(model, size(10**9)) == []


def test_the_root_is_never_chosen_and_tied_parameters_stay_together():
    model = TiedGPT()
    chosen = modules_to_wrap(model, always_wrap_policy)
    assert model not in chosen
    assert model.tok not in chosen and model.head not in chosen, "a tied parameter must stay in one unit"
    assert model.blocks[0].qkv in chosen


def test_policies_that_are_not_callables_or_module_classes_are_refused():
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        as_wrap_policy({"Block"})
    assert as_wrap_policy(None) is None
    assert isinstance(as_wrap_policy([nn.Linear, Block]), ModuleWrapPolicy)
