"""``fully_shard(shard_placement_fn=...)`` with ``sharded.fsdp.Owned``: matrices kept whole on one
owner rank each, so ``torch.optim.Muon`` steps them there with no collective, against DDP +
``torch.optim.Muon`` (matrices) + ``torch.optim.AdamW`` (the rest) on the same batches.

Every comparison is bit for bit: losses, parameters and optimizer state with ``torch.equal``. At
world 1 and 2 every gradient is the average DDP computes (two terms add the same in any order).
At world 3 every rank trains on rank 0's batch and DDP averages after the sum, and the 2 x 2
hybrid mesh's reference sums in the mesh's tree (tests/_exact_sums.py says why: with three
different gradients the sum order differs from DDP's, and Muon's bfloat16 Newton–Schulz turns
that into differences whose size depends on the CPU). Only the gradient norm, whose squares are
summed in another order at any world size, is compared to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import checkpoint, fully_shard
from sharded.fsdp import MixedPrecisionPolicy, Owned, clip_grad_norm_, summon_full_params
from tests._exact_sums import averaging_ddp, batch_rank, pairwise_ddp
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


def _train_beside_ddp(reference, sharded, data_rank, steps, batch_fn, loss_fn, what):
    """Train both ``(model, optimizers)`` pairs on the same batches (``data_rank``'s), comparing
    each step's loss and then the parameters, bit for bit."""
    (ddp, theirs), (model, ours) = reference, sharded
    for step in range(steps):
        batch = batch_fn(data_rank, step)
        ref_loss = _step(ddp, theirs, batch, loss_fn)
        _assert_same([_step(model, ours, batch, loss_fn)], [ref_loss], f"{what}, step {step}: loss")
    _assert_same(_full_parameters(model), [p.detach() for p in ddp.module.parameters()], f"{what}: parameters")


def _assert_same(ours, theirs, what):
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b), f"{what}: differs from DDP's by {(a - b).abs().max():.3g}"


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

    data_rank = batch_rank(rank, world)
    ref = gpt()
    ddp, theirs = averaging_ddp(ref), _optimizers(ref.named_parameters())
    model = gpt()
    _shard(model, _owned_block_matrices(model))
    ours = _optimizers(model.named_parameters())
    owned = _owners_hold_alone(model, world)
    assert len(owned) == (8 if world > 1 else 0)  # 4 matrices per block, 2 blocks
    batch = token_batch(data_rank, STEPS)  # first a backward that is clipped and dropped
    gpt_loss(ddp, batch).backward()
    gpt_loss(model, batch).backward()
    _check_clipping_counts_owned_gradients_once(model, ref, owned)
    for step in range(STEPS):
        batch = token_batch(data_rank, step)
        ref_loss = _step(ddp, theirs, batch, gpt_loss)
        for optimizer in ours:
            optimizer.zero_grad()
        loss = gpt_loss(model, batch)
        loss.backward()
        with CommDebugMode() as comms:
            ours[0].step()  # Muon: Newton-Schulz on the owner's whole matrices, no collective
        assert comms.get_total_counts() == 0, f"Muon's step communicated: {comms.get_comm_counts()}"
        ours[1].step()
        _assert_same([loss.detach()], [ref_loss], f"step {step}: loss")
        if step == 0:  # the first momentum is the averaged gradient itself (times 1 - momentum)
            _assert_muon_state_on_owners_only(model, ref, ours[0], theirs[0])
    _assert_same(_full_parameters(model), [p.detach() for p in ref.parameters()], "parameters")
    _assert_muon_state_on_owners_only(model, ref, ours[0], theirs[0])


def _check_clipping_counts_owned_gradients_once(model, ref, owned):
    """``sharded.fsdp.clip_grad_norm_`` takes the norm over every gradient, each owned one once,
    and clips each by it: torch's norm and clipped gradients on DDP, to float32 rounding (the
    squares are summed in another order, so the clip factor may differ in its last bit). torch's
    ``clip_grad_norm_`` over a model with owned parameters is routed to it; ``foreach`` picks
    kernels, not numbers; torch's ``get_total_norm`` refuses an owned gradient (from gradients
    alone it would return this rank's norm)."""
    names = [n for n, _ in model.named_parameters()]
    unclipped = clip_grad_norm_(model.parameters(), float("inf"))  # sharded's: the norm, nothing scaled
    for foreach in (False, True):
        assert torch.equal(clip_grad_norm_(model.parameters(), float("inf"), foreach=foreach), unclipped), f"foreach={foreach}"
    if any(p.to_local().numel() for n, p in model.named_parameters() if n in owned):
        every = [p.grad for p in model.parameters() if p.grad is not None]  # torch would refuse two meshes
        mine = [p.grad for n, p in model.named_parameters() if n in owned and p.grad is not None]  # or sum these alone
        for grads in (every, mine):
            with pytest.raises(NotImplementedError, match=r"rank \d+: torch.nn.utils.get_total_norm got the gradient \(shape .*\) of an owner-placed"):
                torch.nn.utils.get_total_norm(grads)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # torch's name, routed to sharded's
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    assert torch.equal(norm, unclipped), "torch's clip_grad_norm_ over owned parameters is sharded's"
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0, msg="global norm")
    assert norm > MAX_NORM, "the check must clip"
    for name, p, q in zip(names, model.parameters(), ref.parameters()):
        if p.grad is None or p.to_local().numel() == 0 or p.grad.to_local().numel() != p.numel():
            continue  # an element-sharded gradient's rows, or another rank's matrix
        torch.testing.assert_close(p.grad.to_local(), q.grad, rtol=1e-6, atol=1e-9, msg=f"clipped gradient of {name}")


def _assert_muon_state_on_owners_only(model, ref, ours, theirs):
    held = [p for p in ours.param_groups[0]["params"] if ours.state.get(p)]
    assert all(p.to_local().numel() == p.numel() for p in held), "Muon state on a rank that does not own the matrix"
    name_of = {id(p): n for n, p in model.named_parameters()}
    reference = dict(ref.named_parameters())
    for p in held:
        mine, expected = ours.state[p]["momentum_buffer"].to_local(), theirs.state[reference[name_of[id(p)]]]["momentum_buffer"]
        _assert_same([mine], [expected], f"Muon momentum of {name_of[id(p)]}")
    count = torch.tensor([len(held)])
    torch.distributed.all_reduce(count)
    assert count.item() == len(ours.param_groups[0]["params"]), "every matrix has its Muon state on exactly one rank"


def _full_parameters(model):
    with summon_full_params(model, writeback=False):
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_owned_matrices_with_muon_and_adamw_match_ddp_without_a_collective_in_the_step(world_size):
    run_on_ranks(_check_muon_and_adamw_match_ddp, world_size, timeout=180)


# ------------------------------------------- owner counts, explicit owners, other shapes


def _mlp_placement(model, world):
    """Two matrices owned by ranks 0 and 1 (at world 3 rank 2 owns none of them), the last
    matrix cut, and one bias, a non-matrix, owned whole by rank 0."""
    table = {"0.weight": Owned(0), "2.weight": Owned(min(1, world - 1)), "4.bias": Owned(0)}
    owned = {id(p): table[n] for n, p in model.named_parameters() if n in table}
    return lambda p: owned.get(id(p))


def _mlp_optimizers(model):
    named = dict(model.named_parameters())
    matrices = [named["0.weight"], named["2.weight"]]
    rest = [p for n, p in named.items() if n not in ("0.weight", "2.weight")]
    return [torch.optim.Muon(matrices, lr=MUON_LR), torch.optim.AdamW(rest, lr=ADAMW_LR, weight_decay=0.1)]


def _check_explicit_owners_and_a_rank_owning_nothing(rank, world):
    from tests._models import mlp

    ref = mlp()
    ddp, theirs = averaging_ddp(ref), _mlp_optimizers(ref)
    model = mlp()
    placement = _mlp_placement(model, world)
    for layer in model[::2]:
        fully_shard(layer, shard_placement_fn=placement)
    fully_shard(model, shard_placement_fn=placement)
    ours = _mlp_optimizers(model)
    named = dict(model.named_parameters())
    owners = {"0.weight": 0, "2.weight": min(1, world - 1), "4.bias": 0}
    for name, owner in owners.items():
        held = named[name].to_local().numel() == named[name].numel()
        assert held == (rank == owner or world == 1), f"{name} whole on rank {rank}, owner {owner}"
    if world == 3 and rank == 2:
        assert not any(named[n].to_local().numel() for n in owners), "rank 2 owns nothing"
    _train_beside_ddp((ddp, theirs), (model, ours), batch_rank(rank, world), STEPS, mlp_batch, mlp_loss, "explicit owners")
    owned_bias_state = ours[1].state.get(named["4.bias"], {})
    assert bool(owned_bias_state) == (rank == 0), "the owned bias has AdamW state on its owner alone"


def _check_balancer_spreads_step_cost(rank, world):
    """``Owned()`` in one unit per matrix: the balance carries over units, largest cost first."""
    model = nn.Sequential(*(nn.Linear(d, d, bias=False) for d in (32, 32, 16, 16, 8, 8)))
    for layer in model:
        fully_shard(layer, shard_placement_fn=lambda p: Owned())
    fully_shard(model)
    mine = torch.tensor([float(p.numel() ** 1.5) if p.to_local().numel() else 0.0 for p in model.parameters()])
    loads = [torch.zeros_like(mine) for _ in range(world)]
    torch.distributed.all_gather(loads, mine)
    per_rank = [load.sum().item() for load in loads]
    largest = max(p.numel() ** 1.5 for p in model.parameters())
    assert max(per_rank) <= sum(per_rank) / world + largest, f"Newton-Schulz cost per rank {per_rank}"
    owners = torch.stack(loads).gt(0).long().sum(0)
    assert owners.tolist() == [1] * len(mine), "each matrix owned by exactly one rank"


# ------------------------------------------ mixed precision, no_sync, recompute, meta init


def _check_mixed_precision_and_no_sync_match_element_sharding(rank, world):
    """bf16 compute, fp32 reduction, two micro-batches per step (``no_sync`` on the first):
    owner-placed matrices get the gradients element-sharded ones get (the same average of the
    same bf16 products), so AdamW over both trains the same bits (at world 3 on equal batches: the
    reduce to the owner and the reduce-scatter then sum alike)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    owned, cut = gpt(), gpt()
    _shard(owned, _owned_block_matrices(owned), mp_policy=policy)
    _shard(cut, lambda p: None, mp_policy=policy)
    pairs = [(m, torch.optim.AdamW(m.parameters(), lr=ADAMW_LR, weight_decay=0.1)) for m in (owned, cut)]
    data_rank = batch_rank(rank, world)
    for step in range(3):
        for model, optimizer in pairs:
            optimizer.zero_grad()
            with model.no_sync():
                gpt_loss(model, token_batch(data_rank, 2 * step)).backward()
            gpt_loss(model, token_batch(data_rank, 2 * step + 1)).backward()
            optimizer.step()
    a, b = _full_parameters(owned), _full_parameters(cut)
    assert all(p.dtype == torch.float32 for p in a), "fp32 masters"
    _assert_same(a, b, "owned against element-sharded, bf16 + no_sync")


def _reentrant_gpt_class():
    from torch.utils.checkpoint import checkpoint

    from examples.gpt import GPT

    class ReentrantGPT(GPT):
        """The test GPT recomputing each block in backward with reentrant checkpointing: the
        block's forward runs again inside backward, and gathers its owned matrices again."""

        def forward(self, tokens):
            x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=True)
            return self.head(self.ln(x))

    return ReentrantGPT


def _check_recompute_and_meta_init(rank, world):
    ref = gpt()
    ddp, theirs = averaging_ddp(ref), _optimizers(ref.named_parameters())
    model = _meta_gpt_loaded_from(ref, _reentrant_gpt_class())
    ours = _optimizers(model.named_parameters())
    _train_beside_ddp((ddp, theirs), (model, ours), batch_rank(rank, world), 3, token_batch, gpt_loss, "recomputed")


def _meta_gpt_loaded_from(ref, cls):
    """A GPT of class ``cls`` built on the meta device, sharded with owned matrices,
    materialised (``to_empty`` + ``reset_parameters``: each owner initialises its own matrices)
    and then loaded from ``ref``'s full state dict with torch's ``set_model_state_dict``, as
    Accelerate loads a checkpoint into an FSDP2 model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    with torch.device("meta"):
        model = cls(64, 32, 2, 2, 16)
    _shard(model, _owned_block_matrices(model))
    model.to_empty(device=ref.tok.weight.device)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    for a, b in zip(_full_parameters(model), ref.parameters()):
        assert torch.equal(a, b.detach()), "loaded from the full state dict"
    return model


# ------------------------------------------------------------------------------ refusals


def _check_refusals(rank, world):
    from tests._models import mlp

    model = mlp()
    with pytest.raises(ValueError, match=r"rank 0: fully_shard\(shard_placement_fn=...\) returned Owned\(rank=1, cost=None\) for parameter weight: the owner must be a rank of the shard group, 0..0"):
        fully_shard(model[0], shard_placement_fn=lambda p: Owned(world) if p.dim() == 2 else None)
    with pytest.raises(ValueError, match="cost must be a finite number"):
        fully_shard(model[0], shard_placement_fn=lambda p: Owned(cost=float("nan")))
    fully_shard(model[0], shard_placement_fn=lambda p: Owned(0) if p.dim() == 2 else None)
    with pytest.raises(NotImplementedError, match=r"set_all_reduce_hook: parameter .*weight is owner-placed"):
        model[0].set_all_reduce_hook(lambda t: None)
    on_meta = nn.Parameter(torch.zeros(2, device="meta"))
    on_meta.grad = torch.zeros(2, device="meta")
    with pytest.raises(RuntimeError, match="rank 0: foreach=True was passed, but meta tensors have no foreach kernels"):
        clip_grad_norm_([on_meta], 1.0, foreach=True)


def _check_one_unit_offloaded_or_resharded(rank, world):
    """The whole net one unit (the root: kept gathered after forward by default), with CPU
    offload, and resharded after forward: the owned weights train as DDP's."""
    from sharded.fsdp import CPUOffloadPolicy

    for kwargs in ({}, {"offload_policy": CPUOffloadPolicy()}, {"reshard_after_forward": True}):
        ref = _net()
        ddp, theirs = averaging_ddp(ref), [torch.optim.Muon([p for p in ref.parameters() if p.dim() == 2], lr=MUON_LR)]
        model = _net()
        fully_shard(model, shard_placement_fn=lambda p: Owned() if p.dim() == 2 else None, **kwargs)
        ours = [torch.optim.Muon([p for p in model.parameters() if p.dim() == 2], lr=MUON_LR)]
        for step in range(3):
            batch = _net_batch(batch_rank(rank, world), step)
            _step(ddp, theirs, batch, _net_loss)
            _step(model, ours, batch, _net_loss)
        mine = _full_parameters(model)
        _assert_same(mine, [p.detach() for p in ref.parameters()], f"one unit, {kwargs}")


def _check_placements(rank, world):
    _check_one_unit_offloaded_or_resharded(rank, world)
    _check_explicit_owners_and_a_rank_owning_nothing(rank, world)
    _check_balancer_spreads_step_cost(rank, world)
    _check_mixed_precision_and_no_sync_match_element_sharding(rank, world)
    _check_recompute_and_meta_init(rank, world)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_owners_explicit_or_balanced_other_shapes_mixed_precision_no_sync_recompute_and_meta_init(world_size):
    run_on_ranks(_check_placements, world_size, timeout=180)


def test_bad_owner_placements_and_settings_that_do_not_apply_are_refused():
    run_on_ranks(_check_refusals, 1)


# --------------------------------------------------------------------------- checkpoints


def _net():
    """A net whose last layer has 4 rows: at world 3 one rank holds none of its element-sharded
    rows (and nothing of its optimizer state)."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8), nn.ReLU(), nn.Linear(8, 4))


def _net_batch(rank, step):
    g = torch.Generator().manual_seed(40_000 + 100 * step + rank)
    return torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)


def _net_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _build_net(layout):
    """(model to train and checkpoint, Muon + AdamW): ``owned`` (every weight whole on an owner),
    ``cut`` (ZeRO-3, element-sharded), or ``ddp``."""
    model = _net()
    if layout in ("owned", "cut"):
        placement = (lambda p: Owned() if p.dim() == 2 else None) if layout == "owned" else None
        for layer in model[::2]:
            fully_shard(layer, shard_placement_fn=placement)
        fully_shard(model, shard_placement_fn=placement)
    weights = [p for p in model.parameters() if p.dim() == 2]
    biases = [p for p in model.parameters() if p.dim() != 2]
    optimizers = [torch.optim.Muon(weights, lr=MUON_LR), torch.optim.AdamW(biases, lr=ADAMW_LR)]
    return (DDP(model) if layout == "ddp" else model), optimizers


def _assert_full_states_equal(ours, reference, what):
    assert ours["model"].keys() == reference["model"].keys(), what
    for key, value in reference["model"].items():
        assert torch.equal(ours["model"][key], value), f"{what}: model {key}"
    for mine, theirs in zip(ours["optim"], reference["optim"]):
        assert mine["param_groups"] == theirs["param_groups"], what
        assert mine["state"].keys() == theirs["state"].keys(), f"{what}: {mine['state'].keys()} {theirs['state'].keys()}"
        for index, state in theirs["state"].items():
            for key, value in state.items():
                assert torch.equal(mine["state"][index][key], value), f"{what}: optimizer state {index}/{key}"


def _save_owned_at_world(rank, world, directory):
    """Train owned and DDP side by side; the full form of the owned one (owned state gathered from
    the owners) is DDP's, bit for bit; save the sharded checkpoint and, on rank 0, the full form."""
    owned, ours = _build_net("owned")
    ddp, theirs = _build_net("ddp")
    for step in range(3):
        batch = _net_batch(rank, step)
        _step(ddp, theirs, batch, _net_loss)
        _step(owned, ours, batch, _net_loss)
    full = checkpoint.get_state_dict(owned, ours, full=True)
    reference = checkpoint.get_state_dict(ddp, theirs, full=True)
    state = checkpoint.get_state_dict(owned, ours)
    held = [fqn for fqn, s in state["optim"]["state"].items() if s]
    assert all(state["model"][fqn].to_local().numel() for fqn in held if state["model"][fqn].dim() == 2), "state of another rank's matrix"
    checkpoint.save(state, directory / "step-3")
    if rank == 0:
        _assert_full_states_equal(full, reference, "owned at world 2, full form, against DDP's")
        torch.save(full, directory / "full.pt")


def _load_into_every_layout(rank, world, directory):
    reference = torch.load(directory / "full.pt", weights_only=True) if rank == 0 else None
    for layout in ("owned", "cut", "ddp"):
        model, optimizers = _build_net(layout)
        state = checkpoint.get_state_dict(model, optimizers)
        checkpoint.load(state, directory / "step-3")
        checkpoint.set_state_dict(model, optimizers, state)
        full = checkpoint.get_state_dict(model, optimizers, full=True)
        if rank == 0:
            _assert_full_states_equal(full, reference, f"saved owned at world 2, loaded {layout} at world {world}")


def test_owned_checkpoints_save_at_world_2_and_load_at_world_3_into_owned_cut_and_ddp(tmp_path):
    run_on_ranks(_save_owned_at_world, 2, tmp_path, timeout=180)
    run_on_ranks(_load_into_every_layout, 3, tmp_path, timeout=180)


# ---------------------------------------------------------------------- hybrid sharding


def _check_hybrid(rank, world):
    """A (replicate 2, shard 2) mesh: each replica row has an owner of each matrix (the ranks at
    the same shard index), which gets its row's gradient and averages it with the other row's
    owner. The reference DDP sums the four gradients in the same tree (shard pairs first), so the
    losses and parameters are DDP's bit for bit."""
    from sharded.fsdp._placement.mesh import hybrid_mesh
    from tests._models import mlp

    mesh = hybrid_mesh(2)
    ref = mlp()
    ddp, theirs = pairwise_ddp(ref, [[0, 1], [2, 3]]), _mlp_optimizers(ref)
    model = mlp()
    placement = lambda p: Owned() if p.dim() == 2 else None  # noqa: E731
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    ours = _mlp_optimizers(model)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            holders = [int(r) for r in p.device_mesh.mesh.flatten()]
            assert len(holders) == 2 and holders[1] - holders[0] == 2, f"{name} held by {holders}: one per row"
    for step in range(STEPS):
        batch = mlp_batch(rank, step)
        ref_loss = _step(ddp, theirs, batch, mlp_loss)
        loss = _step(model, ours, batch, mlp_loss)
        _assert_same([loss], [ref_loss], f"step {step}: loss")
    mine, expected = _full_parameters(model), [p.detach() for p in ref.parameters()]
    _assert_same(mine, expected, "hybrid: parameters")


def test_hybrid_sharding_keeps_an_owner_per_replica_row_and_matches_ddp():
    run_on_ranks(_check_hybrid, 4, timeout=180)
