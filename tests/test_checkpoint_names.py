"""The one conversion of optimizer state between torch's numbered format and FQN keys, the FQNs
themselves (state-dict keys, not ``named_parameters()`` paths), and the one optimizer-state shape
check: pure, one process, no launch."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from sharded._owners.optim_state import check_state_shapes, shapes_of
from sharded.checkpoint import CheckpointError
from sharded.checkpoint._names import is_keyed_by_number, keyed_by_fqn, keyed_by_number, optimizer_fqns, param_fqns


def _stepped(model: nn.Module, groups: list[list[nn.Parameter]]) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW([{"params": g, "lr": 0.1 * (i + 1)} for i, g in enumerate(groups)])
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return optimizer


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), checkpoint_wrapper(nn.Linear(4, 4)), nn.Linear(4, 1))


def test_fqns_are_state_dict_keys_as_torch_names_optimizer_state():
    model = _model()
    optimizer = _stepped(model, [list(model[2].parameters()), list(model[0].parameters()) + list(model[1].parameters())])
    fqns = optimizer_fqns(optimizer, param_fqns(model))
    assert fqns == [["2.weight", "2.bias"], ["0.weight", "0.bias", "1.weight", "1.bias"]]
    paths = [name for name, _ in model.named_parameters()]
    assert "1._checkpoint_wrapped_module.weight" in paths  # a module path is another thing
    by_fqn = keyed_by_fqn(optimizer.state_dict(), fqns, "the state dict")
    assert by_fqn["state"].keys() == get_optimizer_state_dict(model, optimizer)["state"].keys()


def test_numbered_and_fqn_keyed_optimizer_state_convert_both_ways():
    model = _model()
    optimizer = _stepped(model, [list(model[2].parameters()), list(model[0].parameters()) + list(model[1].parameters())])
    numbered = optimizer.state_dict()
    fqns = optimizer_fqns(optimizer, param_fqns(model))
    by_fqn = keyed_by_fqn(numbered, fqns, "the state dict")
    assert is_keyed_by_number(numbered) and not is_keyed_by_number(by_fqn)
    assert [g["params"] for g in by_fqn["param_groups"]] == fqns
    assert [g["lr"] for g in by_fqn["param_groups"]] == [0.1, 0.2]
    assert by_fqn["state"]["2.bias"] is numbered["state"][1]
    back = keyed_by_number(by_fqn, fqns)
    assert back["param_groups"] == numbered["param_groups"] and back["state"] == numbered["state"]
    # another optimizer's FQNs are left out; the numbers follow the given optimizer's order
    first_only = keyed_by_number(by_fqn, fqns[:1])
    assert first_only["state"].keys() == {0, 1} and first_only["state"][1] is numbered["state"][1]


def test_numbered_state_of_another_optimizer_is_refused_with_the_rank():
    model = _model()
    optimizer = _stepped(model, [list(model.parameters())])
    fqns = optimizer_fqns(optimizer, param_fqns(model))
    with pytest.raises(ValueError, match=r"^rank 0: ckpt: optimizer 0 has param groups of sizes \[6\], but the optimizer has \[5\]"):
        keyed_by_fqn(optimizer.state_dict(), [fqns[0][:5]], "ckpt: optimizer 0")


def test_one_shape_check_names_the_parameter_the_rank_and_the_source():
    state = shapes_of({"step": torch.tensor(3.0), "exp_avg": torch.zeros(4, 3), "row": torch.zeros(4, 1), "note": "x"})
    assert state == {"step": (), "exp_avg": (4, 3), "row": (4, 1), "note": None}
    check_state_shapes(state, (4, 3), "0.weight", "checkpoint ckpt", CheckpointError)  # broadcasts: fits
    with pytest.raises(CheckpointError, match=r"^rank 0: checkpoint ckpt: optimizer state 'exp_avg' of parameter "
                                              r"0\.weight has shape \(4, 3\), but the parameter has shape \(3, 4\)"):
        check_state_shapes(state, (3, 4), "0.weight", "checkpoint ckpt", CheckpointError)
    with pytest.raises(ValueError, match=r"^rank 0 \(rank 2 in its group\): the optimizer state dict: optimizer state "
                                         r"'exp_avg' of parameter 7 has shape"):
        check_state_shapes(state, (3, 4), "7", "the optimizer state dict", group_rank=2)
