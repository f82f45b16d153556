"""ZeRO-3's gradient reduce-scatter in fewer bits (``fully_shard(lowbit=LowBit(grads=...))``) at
worlds 1, 2 and 3, against ``fully_shard`` without ``lowbit`` on the same batches.

Each rank records what its units sent (the packed, scaled rows the wire encodes, and its
residuals before encoding); the ranks exchange those and every rank predicts, by encoding and
decoding them itself, the gradient shards that must land in its ``.grad``: equal to the bit.
Against the exact run (the first step, same parameters) every element is within ``(1/W) * sum
over senders of their error_bound`` (scaled as the division scales) and some element differs, so
the low-bit path really ran. Divisions: AVG, ``set_gradient_divide_factor``,
``set_force_sum_reduction_for_comms``, ``reduce_dtype=bfloat16``, and ``param_dtype=bfloat16``
alone (torch 2.15 reduces in the fp32 masters' ``grad_dtype``, earlier torches in bf16). Also:
gradient accumulation (sent once, at the sync), error feedback over steps, the bytes, fallbacks
warned once or raised, shadow checks, clipping, both gradient scalers skipping a step with an inf
in one element (every rank drops its residuals), ``error_feedback=False`` (no residual kept),
``autograd.grad`` over inputs, the refusals, and the residuals through ``sharded.checkpoint``.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sharded import LowBit
from sharded._common.lowbit import codec_for
from tests import _fsdp_reference  # noqa: F401  (preloads layer 3 in the harness's forkserver)
from tests._exact_sums import batch_rank
from tests._harness import run_on_ranks
from tests._lowbit_debt import assert_debt_paid
from tests._models import gpt, gpt_loss, token_batch

BLOCK = 64
POLICY = LowBit(grads="int8", block_size=BLOCK, min_numel=0)


def _shard(lowbit, mp_policy=None, seed=0):
    from sharded import fully_shard
    from sharded.fsdp import MixedPrecisionPolicy

    mp = mp_policy or MixedPrecisionPolicy()
    model = gpt(seed)
    for block in model.blocks:
        fully_shard(block, lowbit=lowbit, mp_policy=mp)
    return fully_shard(model, lowbit=lowbit, mp_policy=mp)


def _wire(model):
    from sharded.fsdp._unit import units_under

    return units_under(model)[0].lowbit_wire


class Recorder:
    """What this rank's units sent through the wire in the low-bit reduce-scatter: per call, the
    unit's name, its layout, the rows encoded (after the plan's scaling) and the residuals the
    wire held before encoding them."""

    def __init__(self, model):
        from sharded.fsdp import _reduction

        self.calls: list[dict] = []
        self.wire = wire = _wire(model)
        send, pack = wire.reduce_scatter, _reduction.pack_gradients

        def packing(*args, **kwargs):
            sent, layout = pack(*args, **kwargs)
            self.calls.append({"layout": layout})
            return sent, layout

        def sending(codec, name, flat, **kwargs):
            self.calls[-1].update(name=name, flat=flat.clone(), residuals={k: v.clone() for k, v in wire.feedback.state_dict().items()})
            return send(codec, name, flat, **kwargs)

        _reduction.pack_gradients, wire.reduce_scatter = packing, sending

    def take(self):
        """The calls of this model's units since the last take (other models pack gradients too)."""
        calls, self.calls = [c for c in self.calls if "flat" in c], []
        return calls


def _predict(call, rank, world, finish):
    """This rank's expected row and the bound on its error against the exact average of the
    gradients sent, from every rank's recorded rows and residuals; ``finish`` applies the
    division (and cast) the exact path applies to the summed row."""
    codec = codec_for(POLICY.grads)
    flat, name = call["flat"], call["name"]
    n = flat.numel() // world
    flats = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(flats, flat)
    mine = torch.stack([call["residuals"].get(f"{name}[{r}]", torch.zeros(n)) for r in range(world)])
    residuals = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(residuals, mine)
    total, bound, exact, magnitude = (torch.zeros(n) for _ in range(4))
    for s in range(world):
        sent = flats[s].view(world, n)[rank].float()
        meant = sent + residuals[s][rank]
        total += codec.decode(codec.encode(meant, BLOCK), n, BLOCK)
        bound += codec.error_bound(meant, BLOCK) + residuals[s][rank].abs()
        exact += sent
        magnitude += sent.abs()
    tail = call["layout"].tail_start
    assert bool(torch.isfinite(total[tail:]).all()) and bool((total[tail:] >= 0).all())
    return finish(total), finish(bound, exact_dtype=False), finish(exact), finish(magnitude, exact_dtype=False)


def _shards(layout, row):
    """``row`` cut as the unit cuts its received row: each parameter's rows of this rank."""
    return {id(sp.sharded): rows for sp, rows in layout.unpack(row, every=True)}


def _finisher(case, world, dtype):
    def finish(row, exact_dtype=True):
        if case in ("avg", "bf16", "bf16_compute"):
            row = row / world
        out = row.to(dtype) if exact_dtype else row
        if case == "force_sum":
            out = out / world
        return out

    return finish


def _apply_case(model, case, world):
    units = [*model.blocks, model]
    for module in units:
        if case == "factor":
            module.set_gradient_divide_factor(2.0 * world)
        if case == "force_sum":
            module.set_force_sum_reduction_for_comms(True)


def _division_cases(rank, world):
    """Steps 0-2 per case: step 1 accumulates two micro-batches (sync off for the first)."""
    from sharded.fsdp import MixedPrecisionPolicy

    from sharded.fsdp._grad_dtypes import grads_follow_grad_dtype

    results = {}
    for case in ("avg", "factor", "force_sum", "bf16", "bf16_compute"):
        mp = {"bf16": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
              "bf16_compute": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}.get(case)
        # reduce_dtype=None: torch 2.15's grad_dtype (the fp32 masters'), before it param_dtype
        follows = case == "bf16_compute" and grads_follow_grad_dtype()
        dtype = torch.bfloat16 if case.startswith("bf16") and not follows else torch.float32
        ours, ref = _shard(POLICY, mp), _shard(None, mp)
        for model in (ours, ref):
            _apply_case(model, case, world)
        recorder = Recorder(ours)
        opt_ours, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref))
        finish = _finisher(case, world, dtype)
        for step in range(3):
            micro = 2 if step == 1 else 1
            for m in range(micro):
                for model in (ours, ref):
                    model.set_requires_gradient_sync(m == micro - 1)
                    gpt_loss(model, token_batch(rank, 10 * step + m)).backward()
                if m < micro - 1:
                    assert recorder.take() == [], "sync off: nothing sent"
            calls = recorder.take()
            assert len(calls) == 3 and len({c["name"] for c in calls}) == 3, "each unit sends once per step"
            grads = {id(p): p.grad.to_local() for p in ours.parameters()}
            sent_bytes, exact_bytes = 0, 0
            for call in calls:
                assert call["flat"].dtype == dtype
                row, bound, exact, magnitude = _predict(call, rank, world, finish)
                predicted = _shards(call["layout"], row)
                for key, expected in predicted.items():
                    landed = grads[key]
                    assert torch.equal(landed, expected.to(landed.dtype)), f"{case} step {step} {call['name']}"
                bounds, exacts, sizes = (_shards(call["layout"], t) for t in (bound, exact, magnitude))
                slack = 2.0 ** (-7 if dtype == torch.bfloat16 else -20)
                for key in predicted:
                    off = (grads[key].float() - exacts[key].float()).abs()
                    assert bool((off <= bounds[key] * (1 + slack) + slack * sizes[key] + 1e-12).all()), f"{case} step {step}"
                n = call["flat"].numel() // world
                sent_bytes += codec_for("int8").message_numel(n, BLOCK) * (world - 1)
                # what the exact path sends: each parameter's slot and one flag per parameter, no gap
                exact_row = sum(sp.geometry.slot_numel for sp in call["layout"].params) + len(call["layout"].params)
                assert exact_row < n, "the low-bit row carries a gap before its flags"
                exact_bytes += exact_row * call["flat"].element_size() * (world - 1)
            traffic = ours.lowbit_traffic
            assert (traffic.sent["reduce_scatter"], traffic.exact["reduce_scatter"]) == (sent_bytes, exact_bytes)
            assert traffic.sent.get("all_gather") == traffic.exact.get("all_gather"), "parameters gathered exact"
            if step == 0:  # the same parameters: against the exact run's gradients
                errors = _against_exact(ours, ref, calls, rank, world, finish, dtype)
                results[case] = (max(errors), sent_bytes, exact_bytes, dtype.itemsize)
            for opt in (opt_ours, opt_ref):
                opt.step()
                opt.zero_grad()
        assert len(recorder.wire.feedback) == 3 * world, "a residual per unit and chunk"
    return results


def _against_exact(ours, ref, calls, rank, world, finish, dtype):
    """Every element within the bound of the exact run's; the largest error relative to the
    largest gradient, per parameter (some must be > 0)."""
    bounds, sizes = {}, {}
    for call in calls:
        _, bound, _, magnitude = _predict(call, rank, world, finish)
        bounds.update(_shards(call["layout"], bound))
        sizes.update(_shards(call["layout"], magnitude))
    slack = 2.0 ** (-6 if dtype == torch.bfloat16 else -19)
    errors = []
    for p, q in zip(ours.parameters(), ref.parameters()):
        mine, exact = p.grad.to_local().float(), q.grad.to_local().float()
        off = (mine - exact).abs()
        assert bool((off <= bounds[id(p)] * (1 + slack) + slack * sizes[id(p)] + 1e-12).all())
        errors.append(float(off.max() / exact.abs().max().clamp_min(1e-30)) if off.numel() else 0.0)
    assert max(errors) > 0, "the low-bit path ran"
    return errors


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_reduce_scatter_lands_the_decoded_sum_within_the_bound(world_size):
    results = run_on_ranks(_division_cases, world_size, timeout=240)
    for case, (error, sent, exact, itemsize) in results[0].items():
        assert 0 < error < 0.05
        ratio = 3.5 if itemsize == 4 else 1.8  # bytes of an element: 4 (bf16: 2) against 1 + 4 / BLOCK
        assert world_size == 1 or sent < exact / ratio, f"{case}: {sent} bytes against {exact}"


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _steps(model, rank, steps, start=0):
    for step in range(start, start + steps):
        gpt_loss(model, token_batch(batch_rank(rank, dist.get_world_size()), step)).backward()
        model.zero_grad()


def _fallback_and_shadow_cases(rank, world):
    # too small for the policy: sent exact (the same sums as without lowbit), warned once
    caught = _Warnings()
    logging.getLogger("sharded.lowbit").addHandler(caught)
    small, ref = _shard(LowBit(grads="int8", min_numel=10**9)), _shard(None)
    for model in (small, ref):
        gpt_loss(model, token_batch(batch_rank(rank, world), 0)).backward()
    for p, q in zip(small.parameters(), ref.parameters()):
        assert torch.equal(p.grad.to_local(), q.grad.to_local())
    assert small.lowbit_traffic.sent == small.lowbit_traffic.exact and "reduce_scatter" in small.lowbit_traffic.sent
    _steps(small, rank, 2, start=1)
    assert len(caught.messages) == 1 and f"rank {rank}" in caught.messages[0]
    assert "3 of 3 messages in the first step sent exact" in caught.messages[0] and "below 1000000000 elements" in caught.messages[0]
    logging.getLogger("sharded.lowbit").removeHandler(caught)

    # ... or refused, naming the unit and the rank
    strict = _shard(LowBit(grads="int8", min_numel=10**9, fallback="raise"))
    with pytest.raises(ValueError, match=f"rank {rank}: low-bit reduce_scatter cannot send blocks.1: below"):
        gpt_loss(strict, token_batch(rank, 0)).backward()

    # parameters only in low bits: the reduce-scatter is exact, its bytes counted as such
    params_only = _shard(LowBit(params="int8", min_numel=0))
    _steps(params_only, rank, 1)
    traffic = params_only.lowbit_traffic
    assert traffic.sent["reduce_scatter"] == traffic.exact["reduce_scatter"] and (traffic.exact["reduce_scatter"] > 0) == (world > 1)

    # without error feedback: no residual kept, each step's rows rounded afresh
    fresh = _shard(dataclasses.replace(POLICY, error_feedback=False))
    recorder = Recorder(fresh)
    for step in range(2):
        gpt_loss(fresh, token_batch(rank, step)).backward()
        grads = {id(p): p.grad.to_local() for p in fresh.parameters()}
        for call in recorder.take():
            assert call["residuals"] == {}
            row = _predict(call, rank, world, _finisher("avg", world, torch.float32))[0]
            assert all(torch.equal(grads[key], expected) for key, expected in _shards(call["layout"], row).items())
        fresh.zero_grad()
    assert len(_wire(fresh).feedback) == 0

    # shadow checks every 2 steps: the relative error of what each rank received
    checks = []
    shadowed = _shard(LowBit(grads="int8", block_size=BLOCK, min_numel=0, check_every=2, on_check=checks.append))
    _steps(shadowed, rank, 5)
    assert [(c.step, c.collective) for c in checks] == [(0, "reduce_scatter"), (2, "reduce_scatter"), (4, "reduce_scatter")]
    assert all(0 < c.relative_error < 0.02 and c.divergence is None for c in checks)
    return [round(c.relative_error, 5) for c in checks]


def _clip_and_autograd_cases(rank, world):
    ours, ref = _shard(POLICY), _shard(None)
    for model in (ours, ref):
        gpt_loss(model, token_batch(rank, 0)).backward()
    # clipping: the norm of what the optimizer sees (the low-bit gradients), not the exact ones
    seen = torch.stack([p.grad.full_tensor().norm() for p in ours.parameters()]).norm()
    exact = torch.stack([p.grad.full_tensor().norm() for p in ref.parameters()]).norm()
    norm = torch.nn.utils.clip_grad_norm_(ours.parameters(), max_norm=float(seen) / 2)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    assert torch.allclose(norm, seen, rtol=1e-6) and not torch.allclose(seen, exact, rtol=1e-7, atol=0)
    clipped = torch.stack([p.grad.full_tensor().norm() for p in ours.parameters()]).norm()
    assert torch.allclose(clipped, seen / 2, rtol=1e-5)

    # autograd.grad over an activation: no parameter gradient, nothing reduced or encoded
    ours.zero_grad()
    recorder = Recorder(ours)
    kept = {}
    handle = ours.blocks[1].register_forward_pre_hook(lambda module, args: kept.setdefault("x", args[0]))
    loss = gpt_loss(ours, token_batch(rank, 1))
    (grad_x,) = torch.autograd.grad(loss, [kept["x"]])
    handle.remove()
    assert grad_x.abs().sum() > 0 and recorder.take() == [] and all(p.grad is None for p in ours.parameters())


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fallbacks_shadow_checks_clipping_and_autograd_grad(world_size):
    relative_errors = run_on_ranks(_fallback_and_shadow_cases, world_size, timeout=240)
    print(f"world {world_size}: shadow relative errors (steps 0, 2, 4) per rank: {relative_errors}")
    run_on_ranks(_clip_and_autograd_cases, world_size)


def _poison_one_element(model, rank):
    """On rank 0, make one element of one gradient of ``blocks.1`` inf in the next backward
    (the others' gradients stay finite); returns the hook's handle."""
    from sharded.fsdp._unit import units_under

    unsharded = units_under(model.blocks[1])[0].params[2].unsharded

    def poison(grad):
        grad = grad.clone()
        grad.view(-1)[5] = float("inf") if rank == 0 else grad.view(-1)[5]
        return grad

    return unsharded.register_hook(poison)


def _scaler_cases(rank, world):
    from sharded import ShardedGradScaler

    for make_scaler in (lambda: ShardedGradScaler(device="cpu", init_scale=2.0**8), lambda: torch.amp.GradScaler("cpu", init_scale=2.0**8)):
        model = _shard(POLICY)
        feedback = _wire(model).feedback
        scaler, opt = make_scaler(), torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            before = [p.full_tensor().clone() for p in model.parameters()]
            handle = _poison_one_element(model, rank) if step == 1 else None
            scaler.scale(gpt_loss(model, token_batch(rank, step))).backward()
            if handle is not None:
                handle.remove()
                # every rank learned that a gradient was not finite, and dropped its residuals
                assert len(feedback) == 0
            else:
                assert len(feedback) == 3 * world
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            moved = [not torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters())]
            assert all(moved) if step != 1 else not any(moved), f"step {step}: {moved}"
        assert scaler.get_scale() == 2.0**8 * 0.5
    # a scale that grows without a skip rescales the residuals with it (ShardedGradScaler only:
    # torch's knows nothing of them and leaves them one step in the old scale)
    model = _shard(POLICY)
    feedback, opt = _wire(model).feedback, torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**8, growth_interval=1)
    scaler.scale(gpt_loss(model, token_batch(rank, 0))).backward()
    before = {k: v.clone() for k, v in feedback.state_dict().items()}
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9 and len(before) == 3 * world
    assert all(torch.equal(feedback.state_dict()[k], 2 * v) for k, v in before.items())


def _refusal_cases(rank, world):
    model = _shard(POLICY)
    with pytest.raises(ValueError, match=f"rank {rank}: set_custom_reduce_scatter on fully_shard\\(Block\\): its lowbit="):
        model.blocks[1].set_custom_reduce_scatter(object())
    with pytest.raises(ValueError, match=f"rank {rank}: set_separate_reduce_scatter_group on fully_shard\\(GPT\\)"):
        model.set_separate_reduce_scatter_group(True)
    model.set_separate_reduce_scatter_group(False)
    model.blocks[1].set_custom_reduce_scatter(None)
    _steps(model, rank, 1)  # nothing was set
    exact_grads = _shard(LowBit(params="int8"))  # with the gradients exact, both are allowed
    exact_grads.blocks[1].set_custom_reduce_scatter(None)
    exact_grads.set_separate_reduce_scatter_group(True)
    _steps(exact_grads, rank, 1)
    dist.barrier()


def _swapped_trainability_case(rank, world):
    """Freeze one matrix and unfreeze another of its shape in the same unit: the packed row has the
    same length, and must not take the other parameter's residual."""
    from torch import nn

    from sharded import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    model[1].weight.requires_grad_(False)
    fully_shard(model, lowbit=LowBit(grads="int4", min_numel=0, block_size=64))
    wire = _wire(model)
    model(torch.randn(4, 64)).pow(2).sum().backward()
    before = set(wire.feedback.state_dict())
    model[0].weight.requires_grad_(False)
    model[1].weight.requires_grad_(True)
    model[0].weight.grad = None
    model(torch.randn(4, 64)).pow(2).sum().backward()
    after = set(wire.feedback.state_dict()) - before
    assert before and after and len(after) == len(before), (before, after)
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_row_of_other_parameters_takes_no_residual_of_another(world_size):
    run_on_ranks(_swapped_trainability_case, world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gradient_scalers_skip_a_step_with_an_inf_and_every_rank_drops_its_residuals(world_size):
    run_on_ranks(_scaler_cases, world_size)
    run_on_ranks(_refusal_cases, world_size)


def _train(model, opt, rank, steps):
    for step in steps:
        gpt_loss(model, token_batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()


def _resume(rank, world, directory):
    """The residuals saved with sharded.checkpoint come back on the same rank (loaded before the
    model's first forward): the resumed run's parameters are the uninterrupted run's, bit for
    bit; without them they differ."""
    from sharded import checkpoint

    first = _shard(POLICY)
    opt = torch.optim.AdamW(first.parameters(), lr=1e-2)
    _train(first, opt, rank, range(2))
    checkpoint.save(checkpoint.get_state_dict(first, opt), f"{directory}/w{world}")
    _train(first, opt, rank, range(2, 4))
    for keep_residuals in (True, False):
        resumed = _shard(POLICY, seed=1)
        opt_resumed = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
        state = checkpoint.get_state_dict(resumed, opt_resumed)
        checkpoint.load(state, f"{directory}/w{world}")
        if not keep_residuals:
            state["lowbit"][f"world{world}_rank{rank}"].clear()
            state["lowbit"]["debt"].clear()
        checkpoint.set_state_dict(resumed, opt_resumed, state)
        assert len(_wire(resumed).feedback) == (3 * world if keep_residuals else 0)
        _train(resumed, opt_resumed, rank, range(2, 4))
        same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(first.parameters(), resumed.parameters()))
        assert same == keep_residuals
    dist.barrier()


def _resume_elsewhere(rank, world, directory, saved_at, save_as=None):
    """At another world size the saved residuals are resharded: every rank carries 1/W of the
    checkpoint's debt (per parameter, what the saving ranks' residuals add to the average), so
    the first reduced gradient plus the debt its own rounding leaves equals the exact average
    plus the saved debt. Without the debt they would differ by it, far above the float32
    rounding allowed. ``save_as``: then save, for the next world size to load."""
    from sharded import checkpoint

    caught = _Warnings()
    caught.setLevel(logging.INFO)
    logging.getLogger("sharded.lowbit").addHandler(caught)
    logging.getLogger("sharded.lowbit").setLevel(logging.INFO)
    model = _shard(POLICY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = checkpoint.get_state_dict(model, opt)
    checkpoint.load(state, f"{directory}/w{saved_at}")
    debt = {n: t.clone() for n, t in state["lowbit"]["debt"].items()}
    checkpoint.set_state_dict(model, opt, state)
    assert len(_wire(model).feedback) == 0 and len(_wire(model).feedback.carried) == len(debt) > 0
    (line,) = [m for m in caught.messages if "resharded" in m]
    assert f"saved at world size {saved_at}) are resharded to world size {world}" in line
    ref = gpt(0)
    ref.load_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()})
    for r in range(world):
        gpt_loss(ref, token_batch(r, 2)).backward()
    exact = {n: p.grad / world for n, p in ref.named_parameters()}
    gpt_loss(model, token_batch(rank, 2)).backward()
    delivered = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    left = checkpoint.get_state_dict(model, opt)["lowbit"]["debt"]
    assert len(_wire(model).feedback.carried) == 0 and len(_wire(model).feedback) == 3 * world
    assert_debt_paid(delivered, left, exact, debt, world)
    if save_as is not None:
        checkpoint.save(checkpoint.get_state_dict(model, opt), f"{directory}/{save_as}")
    dist.barrier()


def test_residuals_survive_a_checkpoint_and_reshard_to_another_world_size(tmp_path):
    run_on_ranks(_resume, 2, str(tmp_path))
    run_on_ranks(_resume_elsewhere, 3, str(tmp_path), 2, "w3")
    run_on_ranks(_resume_elsewhere, 1, str(tmp_path), 3)
