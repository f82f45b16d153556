"""Whole-matrix optimizers (Muon, Adafactor, one's own) under layers 1-2, against torch DDP.

Layers 1-2 give each parameter whole to one owner, whose optimizer steps it exactly as a plain
optimizer on DDP would: these tests make that a promise, for optimizers whose update of one
element depends on the whole matrix, under ZeRO-1 (``OSS`` + DDP) and ZeRO-2 (``OSS`` +
``ShardedDataParallel``), with gradient clipping on. They also check the partition by step cost
that ``OSS`` uses for Muon (pure tests), ``param_cost`` and ranks that own nothing.

Tolerances. The clip norm is the one number not computed as torch computes it: torch takes the
norm of the per-parameter norms in one reduction, the sharded layers sum each rank's squares
and then the ranks' sums, another association of the same terms, so the norms can differ by an
ulp or two (measured: up to 1.2e-7 relative at world 2 and 3, none at world 1). It is checked
against torch's within ``NORM_RTOL``; the reference then clips with torch's
``clip_grads_with_norm_`` by *that* norm, so that everything else is compared bit for bit.
ZeRO-1's gradients are DDP's own, and ZeRO-2's are DDP's bits at world 1 and 2 (one term, or two
summed in either order, are the same float); the owner runs the same optimizer code on them, so
parameters and optimizer state must be equal (``torch.equal``). At world 3 ZeRO-2's reduce and
DDP's all-reduce would add three different terms in different orders, and Muon's bfloat16
Newton–Schulz and Adam's ``m / sqrt(v)`` grow those ulps by amounts that depend on the CPU
(tests/_exact_sums.py), so at world 3 every rank trains on rank 0's batch: three equal terms,
each divided by 3 first as DDP and ZeRO-2 both do, add to the same float in any order, and the
comparison stays bit for bit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sharded
from sharded import OSS, ShardedDataParallel
from sharded._owners.partition import Balance, Partition
from sharded._owners.step_cost import bytes_cost, default_param_cost, newton_schulz_cost, param_costs
from tests._device import DEVICE_AGNOSTIC, on_test_device
from tests._exact_sums import batch_rank
from tests._harness import run_on_ranks
from tests._models import mlp_batch, mlp_loss

pytestmark = DEVICE_AGNOSTIC

WORLD_SIZES = [1, 2, 3]
STEPS = 5
MAX_NORM = 0.05  # below the gradients' norm at every step of these runs, so clipping always acts
MUON_LR, ADAMW_LR, ADAFACTOR_LR, SPECTRAL_LR = 0.02, 1e-2, 1e-2, 0.05


class SpectralSGD(torch.optim.Optimizer):
    """Momentum SGD that divides each matrix's update by its largest singular value (estimated by
    power iteration, the vector kept in the state from step to step): a user's optimizer whose
    update of one element depends on the whole matrix, right only when one rank steps it whole.
    Vectors are divided by their norm."""

    def __init__(self, params: Any, lr: float = 0.05, momentum: float = 0.9, power_steps: int = 2) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, power_steps=power_steps))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_param(p, self.state[p], group)
        return loss

    @staticmethod
    def _step_param(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
            if p.dim() == 2:
                state["right_vector"] = torch.ones(p.shape[1], dtype=p.dtype, device=p.device)
        update = state["momentum_buffer"].mul_(group["momentum"]).add_(p.grad)
        scale = _spectral_norm(update, state["right_vector"], group["power_steps"]) if p.dim() == 2 else update.norm()
        p.add_(update, alpha=-group["lr"] / (float(scale) + 1e-8))


def _spectral_norm(matrix: torch.Tensor, right: torch.Tensor, steps: int) -> torch.Tensor:
    """Power iteration from ``right`` (updated in place); the estimate of the largest singular value."""
    sigma = right.new_zeros(())
    for _ in range(steps):
        left = matrix @ right
        left /= left.norm() + 1e-12
        right.copy_(matrix.T @ left)
        sigma = right.norm()
        right /= sigma + 1e-12
    return sigma


def _matrix_model(seed: int = 0, hidden: tuple[int, ...] = (32, 32, 16)) -> nn.Module:
    """An MLP of matrices of several shapes (12 in, 3 out, as tests._models.mlp_batch) and biases."""
    torch.manual_seed(seed)
    sizes = (12, *hidden, 3)
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.Tanh()]
    return on_test_device(nn.Sequential(*layers[:-1]))


def _matrices(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.dim() == 2]


def _the_rest(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.dim() != 2]


# Each case: (optimizer class, kwargs, which parameters) per optimizer the model is trained with.
Spec = tuple[type[torch.optim.Optimizer], dict[str, Any], Callable[[nn.Module], list[nn.Parameter]]]
CASES: dict[str, list[Spec]] = {
    "muon+adamw": [
        (torch.optim.Muon, dict(lr=MUON_LR), _matrices),
        (torch.optim.AdamW, dict(lr=ADAMW_LR, weight_decay=0.1), _the_rest),
    ],
    "adafactor": [(torch.optim.Adafactor, dict(lr=ADAFACTOR_LR), lambda m: list(m.parameters()))],
    "spectral_sgd": [(SpectralSGD, dict(lr=SPECTRAL_LR), lambda m: list(m.parameters()))],
}

# The clip norm's terms summed in another association: with k terms each association is within
# (k - 1) ulps of the exact sum, so two are within 2k ulps and the root halves that; these models
# have at most 8 parameters, hence 8 ulps of 2**-24.
NORM_RTOL = 8 * 2**-24

def _build(case: str, model: nn.Module, sharded_optimizers: bool) -> list[torch.optim.Optimizer]:
    specs = CASES[case]
    if sharded_optimizers:
        return [OSS(select(model), cls, **kwargs) for cls, kwargs, select in specs]
    return [cls(select(model), **kwargs) for cls, kwargs, select in specs]


# -------------------------------------------------------------------------- the clip, both ways


def _clip_ours(wrapped: nn.Module, optimizers: list[OSS], zero2: bool) -> list[torch.Tensor]:
    """ZeRO-2 clips the whole module by one norm; ZeRO-1's ``OSS.clip_grad_norm`` clips the
    parameters of each optimizer by their own norm."""
    if zero2:
        return [wrapped.clip_grad_norm_(MAX_NORM)]
    return [optimizer.clip_grad_norm(MAX_NORM) for optimizer in optimizers]


def _clip_reference(model: nn.Module, case: str, zero2: bool, our_norms: list[torch.Tensor]) -> list[torch.Tensor]:
    """torch's clipping on DDP's full gradients, over the same parameter sets as ours, by the
    norms ours took (see the module docstring); returns torch's own norms, to compare."""
    param_sets = [list(model.parameters())] if zero2 else [select(model) for _, _, select in CASES[case]]
    torch_norms = []
    for params, norm in zip(param_sets, our_norms):
        torch_norms.append(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
    return torch_norms


# ------------------------------------------------------------------ the training and the diffs


def _train_and_compare(rank: int, world: int, case: str, zero2: bool, hidden: tuple[int, ...] = (32, 32, 16),
                       steps: int = STEPS) -> dict[str, float]:
    """Train ZeRO-1/2 + OSS and DDP + the plain optimizers side by side, comparing after each
    step; the largest differences seen (parameters, optimizer state, clip norms relative)."""
    ref_model, our_model = _matrix_model(hidden=hidden), _matrix_model(hidden=hidden)
    ref_opts, our_opts = _build(case, ref_model, False), _build(case, our_model, True)
    ref = DDP(ref_model)
    ours = ShardedDataParallel(our_model, our_opts) if zero2 else DDP(our_model)
    worst = dict(params=0.0, state=0.0, norm=0.0)
    for step in range(steps):
        batch = mlp_batch(batch_rank(rank, world), step)
        our_norms = _backward_clip_step(ours, our_opts, batch, lambda: _clip_ours(ours, our_opts, zero2))
        torch_norms = _backward_clip_step(ref, ref_opts, batch,
                                          lambda: _clip_reference(ref_model, case, zero2, our_norms))
        assert all(n > MAX_NORM for n in torch_norms), f"{case}: clipping did not act at step {step}"
        relative = [_diff(a, b) / float(b) for a, b in zip(our_norms, torch_norms)]
        worst["norm"] = max(worst["norm"], *relative)
        _track(worst, "params", list(our_model.parameters()), list(ref_model.parameters()))
        _track(worst, "state", *_owned_states(our_opts, ref_opts, our_model, ref_model, rank))
    return worst


def _backward_clip_step(model: nn.Module, optimizers: list, batch: Any, clip: Callable[[], list[torch.Tensor]]
                        ) -> list[torch.Tensor]:
    for optimizer in optimizers:
        optimizer.zero_grad()
    mlp_loss(model, batch).backward()
    norms = clip()
    for optimizer in optimizers:
        optimizer.step()
    return norms


def _owned_states(our_opts: list[OSS], ref_opts: list, our_model: nn.Module, ref_model: nn.Module, rank: int
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The state tensors of every parameter this rank owns, and DDP's of the same parameters
    (every parameter is some rank's, so the ranks together compare all of them)."""
    twin = dict(zip(our_model.parameters(), ref_model.parameters()))
    ours, theirs = [], []
    for our_opt, ref_opt in zip(our_opts, ref_opts):
        for p in [p for p, owner in our_opt.param_to_rank.items() if owner == rank]:
            mine, reference = our_opt.optim.state[p], ref_opt.state[twin[p]]
            assert sorted(mine) == sorted(reference), (sorted(mine), sorted(reference))
            ours += [torch.as_tensor(mine[key]) for key in sorted(mine)]
            theirs += [torch.as_tensor(reference[key]) for key in sorted(reference)]
    return ours, theirs


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """0.0 when bit-equal (``torch.equal``), else the largest absolute difference (> 0)."""
    if torch.equal(a, b):
        return 0.0
    return max(float((a.detach().double() - b.detach().double()).abs().max()), math.ulp(0.0))


def _track(worst: dict[str, float], what: str, ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    """Fold the largest difference of ``ours`` from ``theirs`` into ``worst[what]``."""
    assert len(ours) == len(theirs)
    worst[what] = max(worst[what], *(_diff(a, b) for a, b in zip(ours, theirs)), 0.0)


def _assert_matches_ddp(worst: dict[str, float], case: str, zero2: bool, world: int) -> None:
    """The clip norm within its association bound, parameters and optimizer state bit for bit."""
    what = f"{case} under ZeRO-{2 if zero2 else 1} at world {world}"
    assert worst["norm"] <= NORM_RTOL, f"{what}: the clip norm is {worst['norm']:.3g} off torch's (relative)"
    assert worst["params"] == worst["state"] == 0.0, f"{what} is not bit-equal to DDP: {worst}"


# ---------------------------------------------------------------- one launch per world size


def _check_whole_matrix_training(rank: int, world: int) -> dict[str, dict[str, float]]:
    """Every case under ZeRO-1 and ZeRO-2; then a model of two matrices and two biases, so that
    at world 3 one rank owns nothing in either optimizer (and still takes part in every
    collective); then OSS's own partition. Returns the differences seen, per run."""
    report = {}
    for case in CASES:
        for zero2 in (False, True):
            report[f"{case} ZeRO-{2 if zero2 else 1}"] = worst = _train_and_compare(rank, world, case, zero2)
            _assert_matches_ddp(worst, case, zero2, world)
    two_matrices = dict(hidden=(24,), steps=3)
    report["muon+adamw ZeRO-2, two matrices"] = worst = _train_and_compare(rank, world, "muon+adamw", True, **two_matrices)
    _assert_matches_ddp(worst, "muon+adamw", True, world)
    _check_muon_places_by_newton_schulz_cost(world)
    _check_param_cost_is_used_and_checked(rank)
    return report


def _check_muon_places_by_newton_schulz_cost(world: int) -> None:
    """Muon's OSS places by Newton-Schulz cost, reports its balance and warns once naming each
    uneven measure."""
    two = _matrix_model(hidden=(24,))
    with _warnings_of("sharded.oss") as warnings:
        muon = OSS(_matrices(two), torch.optim.Muon, lr=MUON_LR)
    assert muon.partition.costs == tuple(newton_schulz_cost(p.shape) for p in _matrices(two))
    assert len(set(muon.param_to_rank.values())) == min(world, 2), "at world 3 a rank should own no matrix"
    # a 24x12 matrix and a 3x24 one: Newton-Schulz costs 3456 and 216, bytes 1152 and 288
    balance = Balance(bytes=max(1152, 288) * world / 1440 if world > 1 else 1.0,
                      cost=3456 * world / 3672 if world > 1 else 1.0)
    assert muon.balance == pytest.approx(balance)
    if world > 1:
        assert len(warnings) == 1 and f"holds {balance.bytes:.2f}x" in warnings[0], warnings
        assert "balances step costs, not bytes" in warnings[0] and f"step costs {balance.cost:.2f}x" in warnings[0]
    else:
        assert warnings == []


def _check_param_cost_is_used_and_checked(rank: int) -> None:
    """A user's ``param_cost`` is what OSS balances, also for a group added later and after a
    re-partition; a bad one raises on every rank, naming the parameter, and leaves the ranks in
    step."""
    model = _matrix_model()
    matrices = _matrices(model)
    by_rows = OSS(matrices[:-1], torch.optim.Muon, lr=MUON_LR, param_cost=lambda p: p.shape[0])
    by_rows.add_param_group({"params": matrices[-1:]})
    assert by_rows.partition.costs == tuple(float(p.shape[0]) for p in matrices) == (32.0, 32.0, 16.0, 3.0)
    matrices[0].requires_grad_(False)
    by_rows.refresh_trainable()
    assert by_rows.partition.costs == (32.0, 32.0, 16.0, 3.0)
    assert by_rows.balance == by_rows.partition.balance()
    for bad, error in ((-1.0, ValueError), (float("nan"), ValueError), ("big", TypeError)):
        cost = lambda p, bad=bad: bad if p.shape == (32, 32) else 1.0  # noqa: E731
        match = rf"rank {rank}: param_cost.s result for param group 0, parameter 1 \(shape \(32, 32\)\) is .*; a cost must be"
        with pytest.raises(error, match=match):
            OSS(_matrices(model), torch.optim.Muon, lr=MUON_LR, param_cost=cost)
    dist.barrier()


@contextlib.contextmanager
def _warnings_of(logger_name: str) -> Iterator[list[str]]:
    """The messages ``logger_name`` logs at WARNING or above inside the block."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_whole_matrix_optimizers_match_ddp_under_zero1_and_zero2(world_size):
    """(a) ZeRO-1 and (b) ZeRO-2 with Muon + AdamW as two OSS optimizers, (c) Adafactor, (d) a
    user's whole-matrix optimizer, gradient clipping on: parameters, optimizer state and clip
    norms after every step; a rank that owns no Muon matrix; OSS's cost partition and
    ``param_cost``, one launch."""
    run_on_ranks(_check_whole_matrix_training, world_size)


# ------------------------------------------------------------------ the partition, pure tests


def _tensors(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    return [torch.zeros(shape, requires_grad=True) for shape in shapes]


def _ns_partition(shapes: list[tuple[int, ...]], world: int) -> Partition:
    params = _tensors(shapes)
    return Partition.build([params], world, param_costs([params], default_param_cost(torch.optim.Muon), 0))


def test_newton_schulz_cost_of_matrices_batches_and_vectors():
    assert newton_schulz_cost((64, 64)) == 64**3
    assert newton_schulz_cost((512, 8)) == newton_schulz_cost((8, 512)) == 512 * 8 * 8
    assert newton_schulz_cost((3, 64, 16)) == 3 * 64 * 16 * 16
    assert newton_schulz_cost((2, 5, 64, 16)) == 10 * 64 * 16 * 16
    assert newton_schulz_cost((7,)) == 7 and newton_schulz_cost(()) == 1 and newton_schulz_cost((0, 5)) == 0
    assert sharded.newton_schulz_cost is newton_schulz_cost


def test_muon_and_its_subclasses_default_to_newton_schulz_cost_others_to_bytes():
    class MyMuon(torch.optim.Muon):
        pass

    matrix = torch.zeros(64, 8)
    assert default_param_cost(torch.optim.Muon)(matrix) == default_param_cost(MyMuon)(matrix) == 64 * 8 * 8
    for other in (torch.optim.AdamW, torch.optim.Adafactor, SpectralSGD):
        assert default_param_cost(other) is bytes_cost


@pytest.mark.parametrize("seed", range(10))
def test_cost_partition_owns_every_parameter_once_within_the_greedy_bound(seed):
    rng = random.Random(seed)
    sizes = [1, 8, 64, 100, 512]
    shapes = [(rng.choice(sizes), rng.choice(sizes)) if rng.random() < 0.7 else (rng.choice(sizes),)
              for _ in range(rng.randint(1, 14))]
    world = rng.randint(1, 5)
    part = _ns_partition(shapes, world)
    owned = sorted(i for r in range(world) for i in part.owned_indices(r))
    assert owned == list(range(len(shapes)))
    costs = [newton_schulz_cost(s) for s in shapes]
    loads = part.trainable_cost_per_rank()
    assert sum(loads) == sum(costs)
    # list scheduling: the busiest rank is at most one parameter over the mean
    assert max(loads) <= sum(costs) / world + max(costs)


def test_cost_partition_shares_the_newton_schulz_work_that_a_bytes_partition_piles_up():
    # a long thin matrix as large in bytes as four square ones, but an eighth of their work
    shapes = [(2048, 8)] + [(64, 64)] * 4
    params = _tensors(shapes)
    by_bytes = Partition.build([params], 2)
    by_cost = _ns_partition(shapes, 2)
    # bytes: the thin matrix alone on one rank, all four squares on the other
    assert by_bytes.owners == (0, 1, 1, 1, 1)
    costs = tuple(float(newton_schulz_cost(s)) for s in shapes)
    bytes_partition_cost = dataclasses.replace(by_bytes, costs=costs)
    assert bytes_partition_cost.balance().cost == pytest.approx(1048576 * 2 / 1179648)  # 1.78x
    # cost: two squares each, the thin one beside two of them
    assert sorted(by_cost.owners[1:]) == [0, 0, 1, 1]
    assert by_cost.balance() == Balance(bytes=pytest.approx(1.5), cost=pytest.approx(655360 * 2 / 1179648))
    assert by_cost.balance().cost < bytes_partition_cost.balance().cost
    assert by_bytes.balance() == Balance(bytes=1.0, cost=1.0)  # a bytes partition's cost is its bytes


def test_user_costs_decide_the_order_and_the_loads():
    # the bytes say the first parameter is the big one, the costs say the last
    part = Partition.build([_tensors([(1000,), (10,), (10,)])], 2, costs=[5.0, 5.0, 10.0])
    assert part.owners == (1, 1, 0) and part.trainable_cost_per_rank() == [10.0, 10.0]
    # costliest first: in the given order greedy would end at 3 and 1
    assert Partition.build([_tensors([(4,)] * 3)], 2, costs=[1, 1, 2]).trainable_cost_per_rank() == [2.0, 2.0]


def test_a_new_group_is_placed_by_its_costs_on_the_current_loads():
    flat = Partition.build([_tensors([(10,), (10,)])], 2, costs=[7.0, 2.0])
    extended = flat.with_group(_tensors([(1,), (1000,)]), costs=[4.0, 1.0])
    assert extended.owners == flat.owners + (1, 1) and extended.costs == (7.0, 2.0, 4.0, 1.0)
    assert extended.trainable_cost_per_rank() == [7.0, 7.0]
    with pytest.raises(ValueError, match="2 costs for 3 parameters"):
        Partition.build([_tensors([(1,)] * 3)], 2, costs=[1.0, 2.0])


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                                        ("3", TypeError), (True, TypeError), (None, TypeError)])
def test_a_bad_param_cost_names_the_parameter_and_the_rank(bad, error):
    groups = [_tensors([(4, 4)]), _tensors([(2,), (3, 3)])]
    cost = lambda p: bad if p.dim() == 2 and p.shape[0] == 3 else 1.0  # noqa: E731
    with pytest.raises(error, match=r"^rank 0: param_cost.s result for param group 1, parameter 1 \(shape \(3, 3\)\) is .*; a cost must be"):
        param_costs(groups, cost, group_rank=0)
