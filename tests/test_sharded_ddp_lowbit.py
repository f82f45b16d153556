"""ShardedDataParallel(lowbit=LowBit(grads=...)): ZeRO-2's reduce in int8 / int4 / fp8.

The owner's gradient is predicted bit for bit on every rank from every rank's data: each rank's
bucket (its gradients divided by the world size, plus its residual) encoded and decoded locally,
the decoded pieces summed in float32 in rank order. Against the exact average (DDP's, and the
average of the local gradients) the error stays within the sum of the senders' codec bounds plus
the residual each carried in, and is above zero, so the low-bit path really ran. One rank
reduces nothing: its gradients are autograd's, bit for bit.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, LowBit, ShardedDataParallel, ShardedGradScaler
from sharded._common.lowbit import ErrorFeedback, codec_for
from sharded._owners.lowbit_reduce import bucket_message_name
from tests._harness import run_on_ranks
from tests._lowbit_debt import assert_debt_paid

FORMATS = ["int8", "int4", "fp8_e4m3", "fp8_e5m2"]
BLOCK = 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 8))


def _batch(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _local_grads(sdp: ShardedDataParallel, world: int, step: int, micros: int = 1) -> list[dict[str, torch.Tensor]]:
    """Every rank's own gradients at the wrapper's current parameters (autograd's sum over
    ``micros`` micro-batches), computed here on a plain copy."""
    ref = _model()
    ref.load_state_dict(sdp.module.state_dict())
    out = []
    for r in range(world):
        ref.zero_grad(set_to_none=True)
        for m in range(micros):
            _loss(ref, _batch(r, step, m)).backward()
        out.append({n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None})
    return out


class Predict:
    """The owner's gradient, from every rank's gradients: what each rank's message decodes to
    (its residual added first under error feedback), summed in float32 in rank order; and the
    bound on its distance to the exact average. When the buckets are re-planned, a residual of a
    bucket the new plan lacks moves, per parameter, into the new bucket holding the parameter."""

    def __init__(self, policy: LowBit, world: int) -> None:
        self.codec, self.block, self.world = codec_for(policy.grads), policy.block_size, world
        self.feedback = [ErrorFeedback() for _ in range(world)] if policy.error_feedback else None
        self._last_plan: list = []

    def _replan(self, buckets, names) -> None:
        kept = {bucket_message_name(b, names): b for b in buckets}
        for fb in self.feedback or []:
            residuals = fb.state_dict()
            for b in self._last_plan:
                key = bucket_message_name(b, names)
                if key not in kept and key in residuals:
                    fb.carry({p: residuals[key][o : o + p.numel()].view(p.shape) for p, o in zip(b.params, b.offsets)})
            fb.keep_only(set(kept))
            for key, b in kept.items():
                carried = fb.take_carried(list(b.params))
                if carried:
                    moved = torch.zeros(b.numel)
                    for p, o in zip(b.params, b.offsets):
                        if p in carried:
                            moved[o : o + p.numel()] = carried[p].reshape(-1)
                    fb.add(key, moved)
        self._last_plan = list(buckets)

    def step(self, buckets, names, grads: list[dict[str, torch.Tensor]]):
        delivered, bound, exact = {}, {}, {}
        self._replan(buckets, names)
        for bucket in buckets:
            key = bucket_message_name(bucket, names)
            total = torch.zeros(bucket.numel)
            room = torch.zeros(bucket.numel)
            mean = torch.zeros(bucket.numel)
            for r in range(self.world):
                flat = torch.cat([(_grad_or_zeros(grads[r], names[p], p) * (1.0 / self.world)).reshape(-1) for p in bucket.params])
                carried = self.feedback[r].state_dict().get(key) if self.feedback else None
                carried = carried.clone() if carried is not None else torch.zeros_like(flat)
                meant = flat + carried
                if self.feedback:
                    message = self.feedback[r].encode(key, flat, self.codec, self.block)
                else:
                    message = self.codec.encode(flat, self.block)
                total += self.codec.decode(message, bucket.numel, self.block)
                room += self.codec.error_bound(meant, self.block) + carried.abs() + 2.0**-20 * meant.abs()
                mean += flat
            for p, offset in zip(bucket.params, bucket.offsets):
                n = names[p]
                piece = slice(offset, offset + p.numel())
                delivered[n], bound[n], exact[n] = total[piece].view(p.shape), room[piece].view(p.shape), mean[piece].view(p.shape)
        return delivered, bound, exact


def _grad_or_zeros(grads: dict[str, torch.Tensor], name: str, param: torch.Tensor) -> torch.Tensor:
    """A rank's gradient, or the zeros its bucket carries for a parameter it did not use."""
    return grads[name] if name in grads else torch.zeros_like(param)


def _residual_total(predict: Predict) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for fb in predict.feedback or []:
        for key, value in fb.state_dict().items():
            out[key] = out.get(key, 0) + value
    return out


def _parity(rank: int, world: int) -> dict:
    figures = {}
    for fmt in FORMATS:
        policy = LowBit(grads=fmt, block_size=BLOCK, min_numel=0)
        model = _model()
        sdp = ShardedDataParallel(model, OSS(model.parameters(), torch.optim.SGD, lr=0.1), reduce_buffer_size=2500, lowbit=policy)
        opt = sdp.sharded_optimizers[0]
        names = {p: n for n, p in model.named_parameters()}
        predict = Predict(policy, world)
        sums_delivered: dict[str, torch.Tensor] = {}
        sums_exact: dict[str, torch.Tensor] = {}
        worst = 0.0
        for step in range(3):
            grads = _local_grads(sdp, world, step)
            buckets = sdp._router.buckets
            if step == 0 and world > 1:  # DDP's average at the same parameters
                ddp = DDP(_model())
                ddp.module.load_state_dict(model.state_dict())
                _loss(ddp, _batch(rank, step)).backward()
                ddp_grads = {n: p.grad for n, p in ddp.module.named_parameters()}
            opt.zero_grad()
            _loss(sdp, _batch(rank, step)).backward()
            if world == 1:  # nothing is reduced: autograd's gradients, no traffic
                assert all(torch.equal(p.grad, grads[0][n]) for p, n in names.items())
                assert sdp.lowbit_traffic is None
                opt.step()
                continue
            delivered, bound, exact = predict.step(buckets, names, grads)
            owner = sdp.param_to_rank
            for p, n in names.items():
                if owner[p] != rank:
                    assert p.grad is None
                    continue
                assert torch.equal(p.grad, delivered[n]), (fmt, step, n)
                err = (p.grad - exact[n]).abs()
                assert bool((err <= bound[n]).all()), (fmt, step, n)
                worst = max(worst, float(err.max()))
                if step == 0:
                    slack = 1e-6 * exact[n].abs().max()
                    assert bool(((p.grad - ddp_grads[n]).abs() <= bound[n] + slack).all())
                sums_delivered[n] = sums_delivered.get(n, 0) + p.grad
                sums_exact[n] = sums_exact.get(n, 0) + exact[n]
            # the residuals this rank keeps are the ones predicted for it
            ours = sdp._lowbit.wire.feedback.state_dict()
            assert set(ours) == {bucket_message_name(b, names) for b in buckets}
            assert all(torch.equal(ours[k], v) for k, v in predict.feedback[rank].state_dict().items())
            # bytes: each bucket owned elsewhere goes once, as its message and exact flags
            traffic = sdp.lowbit_traffic
            codec = codec_for(fmt)
            others = [b for b in buckets if b.owner != rank]
            assert traffic.step == step
            assert traffic.sent["reduce"] == sum(codec.message_numel(b.numel, BLOCK) + 4 * len(b.params) for b in others)
            assert traffic.exact["reduce"] == sum(4 * (b.numel + len(b.params)) for b in others)
            figures[fmt] = (traffic.sent_bytes, traffic.exact_bytes)
            opt.step()
        if world > 1:
            assert worst > 0, fmt  # the codec really rounded
            # error feedback: over the steps, delivered = exact - the residuals left (fp32 sums aside)
            left = _residual_total(predict)
            for b in buckets:
                if b.owner != rank:
                    continue
                res = left[bucket_message_name(b, names)]
                for p, offset in zip(b.params, b.offsets):
                    n = names[p]
                    gap = sums_delivered[n] - sums_exact[n] + res[offset:offset + p.numel()].view(p.shape)
                    assert float(gap.abs().max()) <= 1e-6 * float(sums_exact[n].abs().max() + 1e-3), (fmt, n)
        sdp.remove_hooks()
    dist.barrier()
    return figures


@pytest.mark.parametrize("world", [1, 2, 3])
def test_owner_gradient_is_the_decoded_sum_within_the_codec_bounds(world):
    figures = run_on_ranks(_parity, world)
    print(f"world {world}, bytes sent by each rank in one step (low-bit, exact): {figures}")
    if world > 1:
        sent = sum(f["int8"][0] for f in figures)
        exact = sum(f["int8"][1] for f in figures)
        assert sent < exact / 3  # int8 at block 64: 1.06 bytes per element against 4
        sent4 = sum(f["int4"][0] for f in figures)
        assert sent4 < exact / 6


def _wrap(policy, model=None, **kwargs) -> ShardedDataParallel:
    model = model if model is not None else _model()
    return ShardedDataParallel(model, OSS(model.parameters(), torch.optim.SGD, lr=0.1), reduce_buffer_size=2500, lowbit=policy, **kwargs)


def _no_sync_and_clip(rank: int, world: int) -> None:
    """Micro-batches under no_sync are sent once, summed, at the synced backward; the clip's
    norm is the norm of the delivered gradients."""
    policy = LowBit(grads="int4", block_size=BLOCK, min_numel=0)
    sdp = _wrap(policy)
    names = {p: n for n, p in sdp.module.named_parameters()}
    wire = sdp._lowbit.wire
    grads, buckets = _local_grads(sdp, world, 0, micros=3), sdp._router.buckets
    for m in range(2):
        with sdp.no_sync():
            _loss(sdp, _batch(rank, 0, m)).backward()
    assert wire.traffic.step == 0 and sdp.lowbit_traffic is None  # nothing sent yet
    _loss(sdp, _batch(rank, 0, 2)).backward()
    assert wire.traffic.step == 1
    delivered, _, _ = Predict(policy, world).step(buckets, names, grads)
    for p, n in names.items():
        if sdp.param_to_rank[p] == rank:
            assert torch.equal(p.grad, delivered[n]), n
    norm = sdp.clip_grad_norm_(1e9)
    expect = torch.cat([g.reshape(-1) for g in delivered.values()]).norm()
    assert float(norm) == pytest.approx(float(expect), rel=1e-5)


def _shadow(rank: int, world: int) -> dict:
    """check_every=2: steps 0 and 2 report the reduce's error as measured against the exact sum."""
    figures = {}
    for fmt in FORMATS:
        checks = []
        policy = LowBit(grads=fmt, block_size=BLOCK, min_numel=0, check_every=2, on_check=checks.append)
        sdp = _wrap(policy)
        names = {p: n for n, p in sdp.module.named_parameters()}
        predict = Predict(policy, world)
        owns = any(b.owner == rank for b in sdp._router.buckets)
        for step in range(3):
            grads, buckets = _local_grads(sdp, world, step), sdp._router.buckets
            _, _, exact = predict.step(buckets, names, grads)
            sdp.sharded_optimizers[0].zero_grad()
            _loss(sdp, _batch(rank, step)).backward()
            mine = [n for p, n in names.items() if sdp.param_to_rank[p] == rank]
            got = [c for c in checks if c.step == step]
            if step == 1 or not owns:
                assert got == []
            else:
                (check,) = got
                assert check.collective == "reduce" and check.elements == sum(exact[n].numel() for n in mine)
                delivered = torch.cat([dict(sdp.module.named_parameters())[n].grad.reshape(-1) for n in mine])
                reference = torch.cat([exact[n].reshape(-1) for n in mine])
                measured = float((delivered - reference).norm() / reference.norm())
                assert check.relative_error == pytest.approx(measured, rel=1e-3) and measured > 0
                figures.setdefault(fmt, []).append(check.relative_error)
            sdp.sharded_optimizers[0].step()
        sdp.remove_hooks()
    return figures


def _scaler(rank: int, world: int) -> None:
    """An inf in one rank's gradients arrives as NaN blocks: the step is skipped on every rank and
    the residuals of that step dropped; a scale that grows takes the residuals with it."""
    sdp = _wrap(LowBit(grads="int8", block_size=BLOCK, min_numel=0))
    opt, feedback = sdp.sharded_optimizers[0], sdp._lowbit.wire.feedback
    scaler = ShardedGradScaler(init_scale=2.0**8, growth_interval=1, device="cpu")
    before = [p.detach().clone() for p in sdp.module.parameters()]
    x = _batch(rank, 0)
    if rank == 0:
        x[0, 0] = float("inf")
    scaler.scale(_loss(sdp, x)).backward()
    assert len(feedback) > 0
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, sdp.module.parameters()))
    assert scaler.get_scale() == 2.0**7 and len(feedback) == 0
    opt.zero_grad()
    scaler.scale(_loss(sdp, _batch(rank, 1))).backward()
    kept = {k: v.clone() for k, v in feedback.state_dict().items()}
    assert kept and any(bool(v.abs().max() > 0) for v in kept.values())
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**8
    assert all(torch.equal(feedback.state_dict()[k], 2 * v) for k, v in kept.items())
    sdp.remove_hooks()


def _feedback_keeps_the_sum(rank: int, world: int) -> dict:
    """Values below half a step of their block round to zero every time: without error feedback
    they are lost for good, with it the sum delivered over the steps stays within one rounding."""
    errors = {}
    for feedback in (True, False):
        policy = LowBit(grads="int8", block_size=BLOCK, min_numel=0, error_feedback=feedback)
        sdp = _wrap(policy)
        total: dict[str, torch.Tensor] = {}
        steps = 12
        for _ in range(steps):
            sdp.zero_grad()
            for p in sdp.module.parameters():
                g = torch.full_like(p, 1e-3 * (rank + 1))
                g.view(-1)[0] = 1.0
                p.grad = g
            sdp.reduce()
            for n, p in sdp.module.named_parameters():
                if p.grad is not None:
                    total[n] = total.get(n, 0) + p.grad
        mean = sum(1e-3 * (r + 1) for r in range(world)) / world
        worst = 0.0
        for n, s in total.items():
            exact = torch.full_like(s, steps * mean)
            exact.view(-1)[0] = steps * 1.0
            worst = max(worst, float((s - exact).abs().max()))
        errors[feedback] = worst
        sdp.remove_hooks()
    # each rank's residual is at most half a step of a block topped by 1/W: 1/(254 W), W of them
    one_rounding = 1.0 / 254
    assert errors[True] <= one_rounding
    assert errors[False] > 5 * errors[True]
    return errors


def _refresh_and_fallbacks(rank: int, world: int) -> None:
    """A rebuild keeps no residual of a bucket it no longer has; a too small message travels
    exact (warned once, bit for bit the exact reduce) or raises."""
    sdp = _wrap(LowBit(grads="int8", block_size=BLOCK, min_numel=0))
    names = {p: n for n, p in sdp.module.named_parameters()}
    _loss(sdp, _batch(rank, 0)).backward()
    sdp.sharded_optimizers[0].step()
    for p in sdp.module[0].parameters():
        p.requires_grad_(False)
    sdp.sharded_optimizers[0].zero_grad()
    _loss(sdp, _batch(rank, 1)).backward()
    keys = set(sdp._lowbit.wire.feedback.state_dict())
    assert keys == {bucket_message_name(b, names) for b in sdp._router.buckets}
    assert not any("0.weight" in k or "0.bias" in k for k in keys)
    sdp.remove_hooks()

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("sharded.lowbit").addHandler(handler)
    small, exact = _wrap(LowBit(grads="int8", min_numel=10**6)), _wrap(None)
    for step in range(2):
        for model in (small, exact):
            model.sharded_optimizers[0].zero_grad()
            _loss(model, _batch(rank, step)).backward()
        for a, b in zip(small.module.parameters(), exact.module.parameters()):
            assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
        assert small.lowbit_traffic.sent == small.lowbit_traffic.exact
    warned = [r for r in records if "sent exact" in r.getMessage()]
    assert len(warned) == 1 and "below 1000000 elements" in warned[0].getMessage()
    logging.getLogger("sharded.lowbit").removeHandler(handler)

    strict = _wrap(LowBit(grads="int8", min_numel=10**6, fallback="raise"))
    with pytest.raises(ValueError, match=rf"rank {rank}.*low-bit reduce cannot send reduce .*below 1000000"):
        _loss(strict, _batch(rank, 0)).backward()


def _refusals(rank: int, world: int) -> None:
    from sharded.invariant import MicroBatches

    with pytest.raises(ValueError, match=rf"rank {rank}.*params='int8'.*OSS\(\.\.\., lowbit=LowBit\(params"):
        _wrap(LowBit(params="int8", grads="int8"))
    with pytest.raises(ValueError, match=rf"rank {rank}.*reduce_fp16=True"):
        _wrap(LowBit(grads="int8"), reduce_fp16=True)
    with pytest.raises(ValueError, match="grads=None"):
        _wrap(LowBit())
    with pytest.raises(TypeError, match="sharded.LowBit"):
        _wrap("int8")
    sdp = _wrap(LowBit(grads="int4"))
    with pytest.raises(ValueError, match=rf"rank {rank}.*under Join"):
        sdp.join()
    with pytest.raises(NotImplementedError, match="lowbit"):
        MicroBatches(sdp, 6)


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.spare = _model(), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _static_bf16_unused(rank: int, world: int) -> None:
    """bf16 gradients under static_graph, with a parameter no rank uses: the owner's gradient is
    the float32 sum of the decoded messages cast to bf16; the unused one stays None."""
    policy = LowBit(grads="int8", block_size=BLOCK, min_numel=0)
    sdp = _wrap(policy, model=_WithUnused().to(torch.bfloat16), static_graph=True)
    names = {p: n for n, p in sdp.module.named_parameters()}
    predict, ref = Predict(policy, world), _WithUnused().to(torch.bfloat16)
    for step in range(3):
        ref.load_state_dict(sdp.module.state_dict())
        grads = []
        for r in range(world):
            ref.zero_grad(set_to_none=True)
            _loss(ref, _batch(r, step).bfloat16()).backward()
            grads.append({n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None})
        buckets = sdp._router.buckets
        sdp.sharded_optimizers[0].zero_grad()
        _loss(sdp, _batch(rank, step).bfloat16()).backward()
        delivered, _, _ = predict.step(buckets, names, grads)
        if step == 0:  # the first backward re-planned the buckets: their residuals wait per parameter
            names_before = [bucket_message_name(b, names) for b in buckets]
            assert [bucket_message_name(b, names) for b in sdp._router.buckets] != names_before
            assert len(sdp.lowbit_buckets.wire.feedback.carried) > 0
        for p, n in names.items():
            if sdp.param_to_rank[p] != rank or n.startswith("spare"):
                assert p.grad is None, n
            else:
                assert p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, delivered[n].bfloat16()), (step, n)
        sdp.sharded_optimizers[0].step()
    sdp.remove_hooks()


def _behaviours(rank: int, world: int) -> dict:
    _refusals(rank, world)
    _static_bf16_unused(rank, world)
    _no_sync_and_clip(rank, world)
    _scaler(rank, world)
    figures = {"shadow": _shadow(rank, world), "feedback": _feedback_keeps_the_sum(rank, world)}
    _refresh_and_fallbacks(rank, world)  # last: its final backward raises
    return figures


@pytest.mark.parametrize("world", [2, 3])
def test_no_sync_clip_scaler_feedback_shadow_refresh_fallbacks_and_refusals(world):
    figures = run_on_ranks(_behaviours, world)
    print(f"world {world}: {figures}")


def _train(sdp: ShardedDataParallel, rank: int, steps: range) -> None:
    opt = sdp.sharded_optimizers[0]
    for step in steps:
        opt.zero_grad()
        _loss(sdp, _batch(rank, step)).backward()
        opt.step()


def _resume(rank: int, world: int, directory: str) -> None:
    """Residuals saved with sharded.checkpoint come back on the same rank, per parameter, and
    the resumed run's buckets take them: its parameters are the uninterrupted run's, bit for
    bit (without them they differ)."""
    from sharded import checkpoint

    policy = LowBit(grads="int4", block_size=BLOCK, min_numel=0)
    first = _wrap(policy)
    _train(first, rank, range(2))
    checkpoint.save(checkpoint.get_state_dict(first, first.sharded_optimizers[0]), f"{directory}/w{world}")
    _train(first, rank, range(2, 4))
    for keep_residuals in (True, False):
        resumed = _wrap(policy)
        state = checkpoint.get_state_dict(resumed, resumed.sharded_optimizers[0])
        checkpoint.load(state, f"{directory}/w{world}")
        assert sorted(state["lowbit"][f"world{world}_rank{rank}"]) == sorted(n for n, _ in resumed.module.named_parameters())
        if not keep_residuals:
            state["lowbit"][f"world{world}_rank{rank}"].clear()
            state["lowbit"]["debt"].clear()
        checkpoint.set_state_dict(resumed, resumed.sharded_optimizers[0], state)
        assert resumed.lowbit_buckets is not None
        assert len(resumed.lowbit_buckets.wire.feedback.carried) == (6 if keep_residuals else 0)
        _train(resumed, rank, range(2, 4))
        same = all(torch.equal(a, b) for a, b in zip(first.module.parameters(), resumed.module.parameters()))
        assert same == keep_residuals
        resumed.remove_hooks()
    # a checkpoint saved without low-bit loads into a wrapper with it (no residual), and back
    plain = _wrap(None)
    checkpoint.save(checkpoint.get_state_dict(plain, plain.sharded_optimizers[0]), f"{directory}/plain")
    for source, target in ((f"{directory}/plain", _wrap(policy)), (f"{directory}/w{world}", plain)):
        state = checkpoint.get_state_dict(target, target.sharded_optimizers[0])
        checkpoint.load(state, source)
        checkpoint.set_state_dict(target, target.sharded_optimizers[0], state)
        assert target.lowbit_buckets is None or len(target.lowbit_buckets.wire.feedback.carried) == 0
    dist.barrier()


def _owners_gradients(sdp: ShardedDataParallel) -> dict[str, torch.Tensor]:
    """Every parameter's reduced gradient, from its owner, on every rank."""
    out = {}
    for n, p in sdp.module.named_parameters():
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.broadcast(grad, sdp.param_to_rank[p])
        out[n] = grad
    return out


def _resume_elsewhere(rank: int, world: int, directory: str) -> None:
    """At another world size the saved residuals are resharded: the checkpoint's debt (per
    parameter, the sum over the saving ranks of their residuals) is carried 1/W by every rank,
    so the first reduced gradient plus the debt its own rounding leaves equals the exact average
    plus the saved debt. Without the debt the two would differ by it, which is far above the
    float32 rounding the comparison allows."""
    from sharded import checkpoint

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("sharded.lowbit").addHandler(handler)
    logging.getLogger("sharded.lowbit").setLevel(logging.INFO)
    sdp = _wrap(LowBit(grads="int4", block_size=BLOCK, min_numel=0))
    opt = sdp.sharded_optimizers[0]
    state = checkpoint.get_state_dict(sdp, opt)
    checkpoint.load(state, f"{directory}/w2")
    debt = {n: t.clone() for n, t in state["lowbit"]["debt"].items()}
    checkpoint.set_state_dict(sdp, opt, state)
    assert sdp.lowbit_buckets is not None and len(sdp.lowbit_buckets.wire.feedback.carried) == len(debt) == 6
    (line,) = [r.getMessage() for r in records if "resharded" in r.getMessage()]
    assert f"saved at world size 2) are resharded to world size {world}" in line
    local = _local_grads(sdp, world, 2)
    exact = {n: sum(g[n] for g in local) / world for n in debt}
    opt.zero_grad()
    _loss(sdp, _batch(rank, 2)).backward()
    delivered = _owners_gradients(sdp)
    left = checkpoint.get_state_dict(sdp, opt)["lowbit"]["debt"]
    assert len(sdp.lowbit_buckets.wire.feedback.carried) == 0, "the buckets took every carried residual"
    assert_debt_paid(delivered, left, exact, debt, world)
    dist.barrier()


def test_residuals_survive_a_checkpoint_and_reshard_to_another_world_size(tmp_path):
    run_on_ranks(_resume, 2, str(tmp_path))
    run_on_ranks(_resume_elsewhere, 3, str(tmp_path))

