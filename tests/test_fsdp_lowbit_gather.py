"""``fully_shard(lowbit=...)``: the plumbing (one wire per policy and group, shared by a model's
units, closed once per step; ``lowbit_traffic``) and what is refused, naming the module or the
parameter and the rank."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from examples.gpt import Block
from sharded import LowBit
from tests import _fsdp_reference  # noqa: F401  (preloads layer 3 in the harness's forkserver)
from tests._device import device_type_under_test
from tests._harness import run_on_ranks
from tests._models import gpt, gpt_loss, token_batch


def _shard_gpt(lowbit, root_lowbit="same", **kwargs):
    from sharded import fully_shard

    model = gpt()
    for block in model.blocks:
        fully_shard(block, lowbit=lowbit, **kwargs)
    return fully_shard(model, lowbit=lowbit if root_lowbit == "same" else root_lowbit, **kwargs)


def _plumbing_cases(rank, world):
    from sharded.fsdp._unit import units_under

    policy = LowBit(params="int8", block_size=64, min_numel=0)
    model = _shard_gpt(policy)
    units = units_under(model)
    assert all(u.settings.lowbit is policy for u in units)
    assert model.lowbit_traffic is None, "no step has ended yet"
    gpt_loss(model, token_batch(rank, 0)).backward()
    assert len({id(u.lowbit_wire) for u in units}) == 1, "the root's wire is every unit's"
    wire = units[0].lowbit_wire
    assert wire.traffic.step == 1 and model.lowbit_traffic is wire.traffic.last is not None
    one_backward = wire.traffic.last.sent["all_gather"]

    # accumulation: the step ends with the backward that sends the gradients, not before
    with model.no_sync():
        gpt_loss(model, token_batch(rank, 1)).backward()
    assert wire.traffic.step == 1
    gpt_loss(model, token_batch(rank, 2)).backward()
    assert wire.traffic.step == 2
    two = model.lowbit_traffic.sent["all_gather"]
    assert two == 2 * one_backward and (one_backward > 0) == (world > 1), "both micro-batches' gathers count"

    # a unit with another policy keeps its own wire; the root's property sums both
    other = LowBit(params="int8", block_size=128, min_numel=0)
    mixed = _shard_gpt(other, root_lowbit=policy)
    gpt_loss(mixed, token_batch(rank, 0)).backward()
    wires = {id(u.lowbit_wire): u.lowbit_wire for u in units_under(mixed)}
    assert len(wires) == 2
    total = mixed.lowbit_traffic
    assert total.sent_bytes == sum(w.traffic.last.sent_bytes for w in wires.values())
    assert mixed.blocks[0].lowbit_traffic is units_under(mixed.blocks[0])[0].lowbit_wire.traffic.last

    # off: no wire, no traffic
    plain = _shard_gpt(None)
    gpt_loss(plain, token_batch(rank, 0)).backward()
    assert plain.lowbit_traffic is None and all(u.lowbit_wire is None for u in units_under(plain))

    # the FSDP1 wrapper passes it to every unit
    from sharded.fsdp import FullyShardedDataParallel

    wrapped = FullyShardedDataParallel(gpt(), auto_wrap_policy={Block}, lowbit=policy)
    assert all(u.settings.lowbit is policy for u in units_under(wrapped.module)) and len(units_under(wrapped.module)) == 3
    gpt_loss(wrapped, token_batch(rank, 0)).backward()
    assert wrapped.lowbit_traffic is not None


def _refusal_cases(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from sharded import fully_shard
    from sharded.fsdp import CPUOffloadPolicy, Owned
    from sharded.invariant import MicroBatches

    policy = LowBit.mode("int8")
    with pytest.raises(TypeError, match=f"rank {rank}: fully_shard\\(Linear\\): lowbit must be a sharded.LowBit"):
        fully_shard(nn.Linear(4, 4), lowbit="int8")
    with pytest.raises(ValueError, match=f"rank {rank}: fully_shard\\(Linear\\): lowbit=.* CPU offloading"):
        fully_shard(nn.Linear(4, 4), lowbit=policy, offload_policy=CPUOffloadPolicy())
    with pytest.raises(ValueError, match=f"rank {rank}: fully_shard\\(Linear\\): lowbit=.* parameter weight: it is placed Owned"):
        fully_shard(nn.Linear(4, 4), lowbit=policy, shard_placement_fn=lambda p: Owned() if p.ndim == 2 else None)
    mesh = init_device_mesh(device_type_under_test(), (1, world), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match=f"rank {rank}: fully_shard\\(Linear\\): lowbit=.* 2-D mesh"):
        fully_shard(nn.Linear(4, 4), lowbit=policy, mesh=mesh)
    layer = nn.Linear(4, 4)
    layer.weight.fsdp_pre_all_gather = layer.weight.fsdp_post_all_gather = lambda *args, **kwargs: None
    with pytest.raises(ValueError, match=f"rank {rank}: fully_shard\\(Linear\\): lowbit=.* parameter weight: .*all-gather extension"):
        fully_shard(layer, lowbit=policy)

    # a policy that sends nothing, or asks what the gathers cannot do, acts or raises
    with pytest.raises(ValueError, match=f"rank {rank}: fully_shard\\(Linear\\): lowbit=.* sends nothing in fewer bits"):
        fully_shard(nn.Linear(4, 4), lowbit=LowBit())
    with pytest.raises(ValueError, match=f"rank {rank}: fully_shard\\(Linear\\): lowbit=.* error_feedback=False has no effect"):
        fully_shard(nn.Linear(4, 4), lowbit=LowBit(params="int8", error_feedback=False))

    # a custom all-gather would replace the low-bit one; with grads only it is the plain gather
    module = fully_shard(nn.Linear(4, 4), lowbit=policy)
    with pytest.raises(ValueError, match=f"rank {rank}: set_custom_all_gather on fully_shard\\(Linear\\)"):
        module.set_custom_all_gather(object())
    fully_shard(nn.Linear(4, 4), lowbit=LowBit.mode("int8-grads")).set_custom_all_gather(None)

    # the invariant promise is bits
    if world & (world - 1) == 0:
        with pytest.raises(NotImplementedError, match=f"rank {rank}: MicroBatches: fully_shard\\(GPT\\): lowbit=.*bits"):
            MicroBatches(_shard_gpt(policy), 2)
    dist.barrier()


def test_secondary_shard_is_refused_for_low_bit_gathers():
    """``reshard_after_forward=k`` needs world 4 for a real group; the refusal is decided here."""
    from sharded.fsdp._lowbit import check_scope

    info = types.SimpleNamespace(mesh=types.SimpleNamespace(ndim=1), spmd=None)
    with pytest.raises(ValueError, match="rank 0: fully_shard\\(Block\\): .*reshard_after_forward=k"):
        check_scope(LowBit.mode("int8"), "fully_shard(Block)", info, [], offloads=False, secondary_shard=True)
    assert check_scope(LowBit.mode("int8-grads"), "fully_shard(Block)", info, [], offloads=False, secondary_shard=True) is not None


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_low_bit_plumbing_shares_one_wire_and_ends_one_step_per_sync(world_size):
    run_on_ranks(_plumbing_cases, world_size)
    run_on_ranks(_refusal_cases, world_size)


# ---------------------------------------------------------------------------- the all-gather

# Every gathered parameter is predicted here from the ranks' exact shards alone: each rank's flat
# message is its parameters' shards back to back, each padded to its slot (the documented layout
# of a unit's flat buffer); decoding what encoding it gives is what every rank must compute with,
# bit for bit, in forward and in backward's re-gather, on every rank (its own shard included).

def _message_of(unit) -> torch.Tensor:
    """This rank's exact shard of ``unit``'s parameters, laid out as the gather's message."""
    parts = []
    for sp in unit.params:
        local = sp.sharded.to_local().detach().reshape(-1).float()
        parts.append(torch.cat((local, local.new_zeros(sp.geometry.slot_numel - local.numel()))))
    return torch.cat(parts)


def _every_rank(flat: torch.Tensor, world: int) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = flat.new_empty(world * flat.numel())
    dist.all_gather_into_tensor(out, flat)
    return list(out.chunk(world))


def _full_params(unit, per_rank: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter of ``unit`` rebuilt from every rank's message (rows in rank order)."""
    fulls, offset = {}, 0
    for sp in unit.params:
        g = sp.geometry
        slots = [flat[offset:offset + g.slot_numel] for flat in per_rank]
        if g.dim == 0:
            fulls[sp.fqn] = torch.cat(slots)[: g.numel].view(g.shape)
        else:  # shard_placement_fn's Shard(d): equal chunks of dim d
            fulls[sp.fqn] = torch.cat([slot.view(g.slot_shape) for slot in slots], dim=g.dim)
        offset += g.slot_numel
    return fulls


def _record_gathers(model) -> dict[str, list[torch.Tensor]]:
    """What each unit's module computes with, at every forward (a pre-hook after fully_shard's
    sees the gathered parameters)."""
    from torch.distributed.tensor import DTensor

    seen: dict[str, list[torch.Tensor]] = {}
    for prefix, module in [("", model)] + [(f"blocks.{i}.", b) for i, b in enumerate(model.blocks)]:
        def snapshot(m, args, prefix=prefix):
            for name, p in m.named_parameters():
                if not isinstance(p, DTensor):
                    seen.setdefault(prefix + name, []).append(p.detach().clone())
        module.register_forward_pre_hook(snapshot)
    return seen


def _predicted(model, codec, block: int, world: int):
    """Per parameter: the decoded values every rank must gather, the exact ones, the codec's bound."""
    from sharded.fsdp._unit import units_under

    decoded, exact, bound = {}, {}, {}
    for unit in units_under(model):
        pieces = _every_rank(_message_of(unit), world)
        decoded.update(_full_params(unit, [codec.decode(codec.encode(p, block), p.numel(), block) for p in pieces]))
        exact.update(_full_params(unit, pieces))
        bound.update(_full_params(unit, [codec.error_bound(p, block) for p in pieces]))
    return decoded, exact, bound


def _gather_contract(rank, world, policy, mp_policy, **placement):
    import torch.distributed as dist

    from sharded._common.lowbit import codec_for

    kwargs = dict(placement, **({} if mp_policy is None else {"mp_policy": mp_policy}))
    model, reference = _shard_gpt(policy, **kwargs), _shard_gpt(None, **kwargs)
    seen = _record_gathers(model)
    tokens = token_batch(rank, 0)
    loss, exact_loss = gpt_loss(model, tokens), gpt_loss(reference, tokens)
    loss.backward()
    exact_loss.backward()
    what = f"{policy.params} {mp_policy}"
    assert 0 < abs(loss.item() - exact_loss.item()) < 0.02, f"{what}: loss {loss.item()} against exact {exact_loss.item()}"

    decoded, exact, bound = _predicted(model, codec_for(policy.params), policy.block_size, world)
    compute_dtype = mp_policy.param_dtype if mp_policy is not None else torch.float32
    moved = 0.0
    for name, values in decoded.items():
        for got in seen[name]:  # forward (and a block's gather for its backward, checked below)
            assert torch.equal(got, values.to(compute_dtype)), f"{what}: {name} gathered {(got.float() - values).abs().max():.3g} off the decoded shards"
        assert bool(((values - exact[name]).abs() <= bound[name]).all()), f"{what}: {name} beyond the codec's bound"
        moved = max(moved, float((values - exact[name]).abs().max()))
    assert moved > 0, f"{what}: nothing was rounded, so the low-bit gather did not run"
    # the shards stay exact: the same as the exact run's
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), f"{what}: the shard of {name} changed"
    if mp_policy is not None:
        return

    # backward's re-gather gave forward's values: the gradients are those of a plain model
    # computing with the decoded weights (averaged as DDP does; float32 sums in another order)
    plain = gpt()
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(decoded[name])
    plain_loss = gpt_loss(plain, tokens)
    plain_loss.backward()
    rounding_moved = 0.0
    assert torch.equal(plain_loss, loss.detach()), f"loss {loss.item()} against the plain model's {plain_loss.item()}"
    for (name, p), q, e in zip(model.named_parameters(), plain.parameters(), reference.parameters()):
        expect = q.grad.clone()
        dist.all_reduce(expect)
        expect /= world
        torch.testing.assert_close(p.grad.full_tensor(), expect, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        rounding_moved = max(rounding_moved, float((e.grad.full_tensor() - expect).abs().max()))
    assert rounding_moved > 1e-4, "the exact weights' gradients would have passed as well: the check cannot tell"

    # the optimizer steps the exact shard with that gradient
    before = [(p.to_local().clone(), p.grad.to_local().clone()) for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=0.1, foreach=False).step()
    for p, (shard, grad) in zip(model.parameters(), before):
        assert torch.equal(p.to_local(), torch.add(shard, grad, alpha=-0.1)), "the step moved the exact shard by its gradient"


def _gather_cases(rank, world):
    from torch.distributed.tensor import Shard

    from sharded.fsdp import MixedPrecisionPolicy

    _gather_contract(rank, world, LowBit(params="int8", block_size=64, min_numel=0), None)
    _gather_contract(rank, world, LowBit(params="fp8_e4m3", block_size=64, min_numel=0), MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    _gather_contract(rank, world, LowBit(params="int8", block_size=64, min_numel=0), MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    # matrices cut on dim 1 where it divides (at world 3 none does): the same flat message
    _gather_contract(rank, world, LowBit(params="int8", block_size=64, min_numel=0), None,
                     shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % world == 0 else None)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gathered_parameters_are_the_decoded_shards_in_forward_and_backward(world_size):
    run_on_ranks(_gather_cases, world_size)


def _gathers_by_unit(model) -> list:
    """The units of ``model`` in the order their gathers ran through the wire, one entry each."""
    from sharded.fsdp._unit import units_under

    units = units_under(model)
    wire = units[0].lowbit_wire
    order, original = [], wire.all_gather

    def spy(codec, shard, exact_dtype=None):
        order.extend(u for u in units if u.gathers[0].sharded_flat is shard)
        return original(codec, shard, exact_dtype)

    wire.all_gather = spy
    return order


def _shadow_and_traffic_cases(rank, world):
    """The shadow check reports what the gathers really did, measured here from the shards; the
    bytes are the messages' against the exact float32 gather's."""
    from sharded._common.lowbit import codec_for

    checks, block = [], 64
    policy = LowBit(params="int8", block_size=block, min_numel=0, check_every=2, on_check=checks.append)
    model = _shard_gpt(policy)
    gpt_loss(model, token_batch(rank, 0)).backward()  # the root claims its units and shares the wire
    order = _gathers_by_unit(model)
    codec = codec_for("int8")
    for step in (1, 2):  # check_every=2: steps 0 and 2 are checked
        order.clear()
        gpt_loss(model, token_batch(rank, step)).backward()
    assert [c.step for c in checks] == [0, 2]
    check = checks[-1]
    assert check.collective == "all_gather"
    err2 = ref2 = 0.0
    elements = worst = 0
    for unit in order:  # the blocks twice (forward, backward), the root once
        pieces = _every_rank(_message_of(unit), world)
        for piece in pieces:
            diff = codec.decode(codec.encode(piece, block), piece.numel(), block) - piece
            err2, ref2 = err2 + float(diff.pow(2).sum()), ref2 + float(piece.pow(2).sum())
            worst, elements = max(worst, float(diff.abs().max())), elements + piece.numel()
    assert sorted(u.module_name for u in order) == ["GPT", "blocks.0", "blocks.0", "blocks.1", "blocks.1"]
    assert check.elements == elements and check.max_abs_error == worst
    assert check.relative_error == pytest.approx((err2 / ref2) ** 0.5, rel=1e-6) and check.divergence == check.relative_error
    assert 0 < check.relative_error < 0.01

    traffic = model.lowbit_traffic
    sent = sum(codec.message_numel(u.gathers[0].shard_numel, block) for u in order) * (world - 1)
    exact = sum(u.gathers[0].shard_numel * 4 for u in order) * (world - 1)
    # the gradients' reduce-scatter, exact under this policy, is counted as exact beside it
    assert traffic.step == 2 and traffic.sent["all_gather"] == sent and traffic.exact["all_gather"] == exact
    assert set(traffic.sent) == {"all_gather", "reduce_scatter"} and traffic.sent["reduce_scatter"] == traffic.exact["reduce_scatter"]
    if world > 1:
        assert sent < exact * 0.28  # (64 + 4) bytes per 64 elements against 256, and padding
    return sent, exact, check.relative_error


def _fallback_cases(rank, world):
    """A unit below ``min_numel`` is gathered exact: warned once, counted in the bytes; or raised."""
    import logging

    from sharded._common.lowbit import codec_for
    from sharded.fsdp._unit import units_under

    exact_model = _shard_gpt(None)
    root, *blocks = units_under(exact_model)
    smallest_block = min(b.gathers[0].shard_numel for b in blocks)
    assert root.gathers[0].shard_numel < smallest_block
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("sharded.lowbit").addHandler(handler)
    try:
        model = _shard_gpt(LowBit(params="int8", block_size=64, min_numel=smallest_block))
        seen = _record_gathers(model)
        for step in range(2):
            gpt_loss(model, token_batch(rank, step)).backward()
    finally:
        logging.getLogger("sharded.lowbit").removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0] == (f"rank {rank}: low-bit: 1 of 5 messages in the first step sent exact: "
                           f"1: below {smallest_block} elements (all_gather, sent in float32)")
    # the root's parameters arrived exact, the blocks' rounded
    rounded = {name: not torch.equal(seen[name][-1], p.full_tensor()) for name, p in exact_model.named_parameters()}
    assert not any(r for name, r in rounded.items() if not name.startswith("blocks.")), rounded
    assert all(r for name, r in rounded.items() if name.endswith("qkv.weight")), rounded
    codec, n = codec_for("int8"), root.gathers[0].shard_numel
    block_bytes = sum(codec.message_numel(b.gathers[0].shard_numel, 64) for b in blocks) * 2
    assert model.lowbit_traffic.sent["all_gather"] == (block_bytes + n * 4) * (world - 1)

    raising = _shard_gpt(LowBit(params="int8", block_size=64, min_numel=smallest_block, fallback="raise"))
    with pytest.raises(ValueError, match=f"rank {rank}: low-bit all_gather cannot send the float32 parameters of GPT: below"):
        gpt_loss(raising, token_batch(rank, 0))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shadow_check_bytes_and_fallbacks_of_low_bit_gathers(world_size):
    run_on_ranks(_shadow_and_traffic_cases, world_size)
    run_on_ranks(_fallback_cases, world_size)


def _train_steps(model, optimizer, rank, steps) -> list[float]:
    losses = []
    for step in steps:
        loss = gpt_loss(model, token_batch(rank, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _checkpoint_cases(rank, world, path):
    """Low-bit gathers keep no state of their own: the checkpoint holds what an exact run's
    holds, and a run resumed from it gives the bits of the run that went on."""
    from sharded import checkpoint

    def build():
        model = _shard_gpt(LowBit(params="int8", block_size=64, min_numel=0))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, optimizer = build()
    _train_steps(model, optimizer, rank, [0, 1])
    state = checkpoint.get_state_dict(model, optimizer)
    assert set(model.state_dict()) == set(gpt().state_dict())
    checkpoint.save(state, path)
    went_on = _train_steps(model, optimizer, rank, [2, 3])

    resumed, resumed_optimizer = build()
    template = checkpoint.get_state_dict(resumed, resumed_optimizer)
    checkpoint.load(template, path)
    checkpoint.set_state_dict(resumed, resumed_optimizer, template)
    assert _train_steps(resumed, resumed_optimizer, rank, [2, 3]) == went_on
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), f"{name} after resuming"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_checkpoint_of_a_low_bit_model_resumes_bit_for_bit(tmp_path, world_size):
    run_on_ranks(_checkpoint_cases, world_size, str(tmp_path / "ckpt"))
