"""``fully_shard(shard_placement_fn=...)`` with ``sharded.fsdp.Owned``: matrices kept whole on one
owner rank each, so ``torch.optim.Muon`` steps them there with no collective, against DDP +
``torch.optim.Muon`` (matrices) + ``torch.optim.AdamW`` (the rest) on the same batches.

Tolerances: at world 1 and 2 every gradient is the average DDP computes, bit for bit (two terms
add the same in any order), and each optimizer steps the same tensors: losses, norms, parameters
and optimizer state are compared with ``torch.equal``. At world 3 the reduce onto the owner adds
three terms in gloo's order, not DDP's ring order, so gradients differ by float32 ulps; AdamW's
scale-free update can turn ulps on a ~0 gradient into up to ``lr`` per step on that element
(tests/_fsdp_reference.py), and Muon's Newton–Schulz runs in bfloat16, where an ulp of the input
can flip a rounding of the orthogonalised update: the worst element may differ by
``0.1 * lr * steps`` and the mean difference must stay at rounding level (1e-6).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import checkpoint, fully_shard
from sharded.fsdp import MixedPrecisionPolicy, Owned, clip_grad_norm_, summon_full_params
from tests._fsdp_reference import full_tensors
from tests._harness import run_on_ranks
from tests._models import gpt, gpt_loss, mlp_batch, mlp_loss, token_batch

MUON_LR, ADAMW_LR = 0.02, 1e-2
STEPS = 5
MAX_NORM = 0.3  # below the gradients' norm: every step clips


def _optimizers(named):
    """Muon over the blocks' matrices, AdamW over the rest (biases, norms, embeddings, head)."""
    named = list(named)
    matrices = [p for n, p in named if _is_block_matrix(n, p)]
    rest = [p for n, p in named if not _is_block_matrix(n, p)]
    return [torch.optim.Muon(matrices, lr=MUON_LR), torch.optim.AdamW(rest, lr=ADAMW_LR, weight_decay=0.1)]


def _is_block_matrix(name, param):
    return name.startswith("blocks.") and param.dim() == 2


def _owned_block_matrices(model, placement=Owned()):
    """``shard_placement_fn`` placing the blocks' matrices with ``placement``, the rest cut."""
    ids = {id(p) for n, p in model.named_parameters() if _is_block_matrix(n, p)}
    return lambda p: placement if id(p) in ids else None


def _shard(model, placement_fn, **kwargs):
    for block in model.blocks:
        fully_shard(block, shard_placement_fn=placement_fn, **kwargs)
    return fully_shard(model, shard_placement_fn=placement_fn, **kwargs)


def _step(model, optimizers, batch, loss_fn):
    for optimizer in optimizers:
        optimizer.zero_grad()
    loss = loss_fn(model, batch)
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
    return loss.detach()


def _assert_same(ours, theirs, what, exact, lr=ADAMW_LR, steps=STEPS):
    if exact:
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), f"{what}: differs from DDP's by {(a - b).abs().max():.3g}"
        return
    diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(ours, theirs)])
    assert diffs.max() <= 0.1 * lr * steps and diffs.mean() <= 1e-6, f"{what}: max {diffs.max():.3g}, mean {diffs.mean():.3g}"


def _owners_hold_alone(model, world):
    """Each owned matrix is whole on exactly one rank and empty on the others (collective)."""
    owned = [(n, p) for n, p in model.named_parameters() if p.device_mesh.ndim == 1 and p.device_mesh.size() == 1 and world > 1]
    held = torch.tensor([p.to_local().numel() == p.numel() for _, p in owned], dtype=torch.int64)
    empty = torch.tensor([p.to_local().numel() == 0 for _, p in owned], dtype=torch.int64)
    torch.distributed.all_reduce(held)
    torch.distributed.all_reduce(empty)
    assert held.tolist() == [1] * len(owned) and empty.tolist() == [world - 1] * len(owned), f"{held} {empty}"
    return [n for n, _ in owned]


# ------------------------------------------------------------------ Muon + AdamW vs DDP


def _check_muon_and_adamw_match_ddp(rank, world):
    from torch.distributed.tensor.debug import CommDebugMode

    exact = world <= 2
    ref = gpt()
    ddp, theirs = DDP(ref), _optimizers(ref.named_parameters())
    model = gpt()
    _shard(model, _owned_block_matrices(model))
    ours = _optimizers(model.named_parameters())
    owned = _owners_hold_alone(model, world)
    assert len(owned) == (8 if world > 1 else 0)  # 4 matrices per block, 2 blocks
    batch = token_batch(rank, STEPS)  # first a backward that is clipped and dropped
    gpt_loss(ddp, batch).backward()
    gpt_loss(model, batch).backward()
    _check_clipping_counts_owned_gradients_once(model, ref)
    for step in range(STEPS):
        batch = token_batch(rank, step)
        ref_loss = _step(ddp, theirs, batch, gpt_loss)
        for optimizer in ours:
            optimizer.zero_grad()
        loss = gpt_loss(model, batch)
        loss.backward()
        with CommDebugMode() as comms:
            ours[0].step()  # Muon: Newton-Schulz on the owner's whole matrices, no collective
        assert comms.get_total_counts() == 0, f"Muon's step communicated: {comms.get_comm_counts()}"
        ours[1].step()
        if exact:
            _assert_same([loss], [ref_loss], f"step {step}: loss", exact)
        else:
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=f"step {step}: loss")
        if step == 0:  # the first momentum is the averaged gradient itself (times 1 - momentum)
            _assert_muon_state_on_owners_only(model, ref, ours[0], theirs[0], exact)
    if exact:
        _assert_same(_full_parameters(model), [p.detach() for p in ref.parameters()], "parameters", exact)
        _assert_muon_state_on_owners_only(model, ref, ours[0], theirs[0], exact)
    else:
        _assert_within_bf16_rounding(model, ref)


def _assert_within_bf16_rounding(model, ref):
    """World 3: Muon orthogonalises in bfloat16, so a gradient an ulp away can round an element of
    the update one bfloat16 ulp (2**-7 of values below 2) the other way: each Muon step may move an
    element by that much times its adjusted learning rate (``lr * sqrt(max(1, rows / cols))``).
    AdamW-stepped parameters keep AdamW's bound; their mean drifts a little more than AdamW's
    alone (1e-6, tests/_fsdp_reference.py) as Muon's roundings reach them through the forward."""
    adamw = []
    for (name, q), p in zip(ref.named_parameters(), _full_parameters(model)):
        diff = (p - q.detach()).abs()
        if _is_block_matrix(name, q):
            rows, cols = q.shape
            bound = STEPS * MUON_LR * max(1.0, rows / cols) ** 0.5 * 2**-7
            assert diff.max() <= bound, f"{name}: {diff.max():.3g} over {bound:.3g}"
        else:
            adamw.append(diff.flatten())
    diffs = torch.cat(adamw)
    assert diffs.max() <= 0.1 * ADAMW_LR * STEPS and diffs.mean() <= 1e-5, f"AdamW-stepped: max {diffs.max():.3g}, mean {diffs.mean():.3g}"


def _check_clipping_counts_owned_gradients_once(model, ref):
    """``sharded.fsdp.clip_grad_norm_`` takes the norm over every gradient, each owned one once,
    and clips each by it: torch's norm and clipped gradients on DDP, to float32 rounding (the
    squares are summed in another order, so the clip factor may differ in its last bit)."""
    names = [n for n, _ in model.named_parameters()]
    norm = clip_grad_norm_(model.parameters(), MAX_NORM)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0, msg="global norm")
    assert norm > MAX_NORM, "the check must clip"
    for name, p, q in zip(names, model.parameters(), ref.parameters()):
        if p.grad is None or p.to_local().numel() == 0 or p.grad.to_local().numel() != p.numel():
            continue  # an element-sharded gradient's rows, or another rank's matrix
        torch.testing.assert_close(p.grad.to_local(), q.grad, rtol=1e-6, atol=1e-9, msg=f"clipped gradient of {name}")


def _assert_muon_state_on_owners_only(model, ref, ours, theirs, exact):
    held = [p for p in ours.param_groups[0]["params"] if ours.state.get(p)]
    assert all(p.to_local().numel() == p.numel() for p in held), "Muon state on a rank that does not own the matrix"
    name_of = {id(p): n for n, p in model.named_parameters()}
    reference = dict(ref.named_parameters())
    for p in held:
        mine, expected = ours.state[p]["momentum_buffer"].to_local(), theirs.state[reference[name_of[id(p)]]]["momentum_buffer"]
        if exact:
            _assert_same([mine], [expected], f"Muon momentum of {name_of[id(p)]}", exact)
        else:  # world 3, first step: the average of three gradients, added in another order
            torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item(), msg=f"Muon momentum of {name_of[id(p)]}")
    count = torch.tensor([len(held)])
    torch.distributed.all_reduce(count)
    assert count.item() == len(ours.param_groups[0]["params"]), "every matrix has its Muon state on exactly one rank"


def _full_parameters(model):
    with summon_full_params(model, writeback=False):
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_owned_matrices_with_muon_and_adamw_match_ddp_without_a_collective_in_the_step(world_size):
    run_on_ranks(_check_muon_and_adamw_match_ddp, world_size, timeout=180)
