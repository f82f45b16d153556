"""torch's own ``clip_grad_norm_`` over a ShardedDataParallel model clips by DDP's global norm.

After a ZeRO-2 backward each rank holds only the gradients it owns, so torch's function, left
alone, would clip each rank by the norm of its own share. It is routed (sharded/_owners/torch_clip.py):
the norm is DDP's to float rounding (the squared norms are added in another association: within
(k + 1) ulps for k gradients, as tests/test_sharded_ddp.py derives) and exact at world 1 and for
the inf-norm; the reference clips DDP's gradients by our norm with torch's
``clip_grads_with_norm_``, so the parameters compare bit for bit (rank 0's batches at world 3:
tests/_exact_sums.py). torch's ``get_total_norm`` over owned gradients, and torch's
``clip_grad_norm_`` bound by value before the route existed, raise instead of clipping per rank.
With ``OSS`` alone every rank holds every gradient and torch's function is left as it is.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import clip_grad_norm_ as clip_bound_at_import  # before any wrapper is built

from sharded import OSS, ShardedDataParallel
from tests._exact_sums import batch_rank
from tests._harness import run_on_ranks
from tests._models import gpt, gpt_loss, token_batch

MAX_NORM = 0.05  # well under the gradients' norm: every step clips
NORMS = (2.0, 2.0, float("inf"), 1.0)  # one per step


def _step(model, optimizer, rank, world, step, clip):
    optimizer.zero_grad()
    gpt_loss(model, token_batch(batch_rank(rank, world), step)).backward()
    norm = clip(model)
    optimizer.step()
    return norm


def _assert_equal(ours, ref, what):
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), f"{what}: {name} differs from DDP's by {(a - b).abs().max():.3g}"


def _check_sharded_ddp(rank, world):
    ref_model, our_model = gpt(), gpt()
    ref, ref_opt = DDP(ref_model), torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    our_opt = OSS(our_model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    ours = ShardedDataParallel(our_model, our_opt)
    for step, norm_type in enumerate(NORMS):
        norm = _step(ours, our_opt, rank, world, step, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM, norm_type))

        def clip_by_ours(model):
            grads = [p.grad for p in model.parameters()]
            ref_norm = torch.nn.utils.get_total_norm(grads, norm_type)
            exact = world == 1 or norm_type == float("inf")
            rtol = 0 if exact else (len(grads) + 1) * 2**-24
            torch.testing.assert_close(norm, ref_norm, rtol=rtol, atol=0, msg=f"step {step}: the {norm_type}-norm")
            assert norm > MAX_NORM, "the test must clip"
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), MAX_NORM, norm)

        _step(ref, ref_opt, rank, world, step, clip_by_ours)
        _assert_equal(ours, ref, f"step {step}, torch's clip_grad_norm_ of order {norm_type}")

    # torch's deprecated name calls the routed one; a generator of parameters is taken whole
    our_opt.zero_grad()
    gpt_loss(ours, token_batch(batch_rank(rank, world), 9)).backward()
    with pytest.warns(FutureWarning):
        deprecated = torch.nn.utils.clip_grad_norm(ours.parameters(), float("inf"))
    torch.testing.assert_close(deprecated, ours.clip_grad_norm_(float("inf")), rtol=0, atol=0)

    # from gradients alone no rank can take the model's norm, so torch's function refuses them;
    # torch's clip_grad_norm_ bound before the route existed calls it, and raises rather than clip
    assert clip_bound_at_import is not torch.nn.utils.clip_grad_norm_, "the test needs torch's function bound by value"
    owned = [p.grad for p in ours.parameters() if p.grad is not None]
    if world == 1:  # one rank holds every gradient: torch's functions are right as they are
        unclipped = clip_bound_at_import(ours.parameters(), float("inf"))  # max_norm inf: the 2-norm, nothing scaled
        torch.testing.assert_close(unclipped, torch.nn.utils.get_total_norm(owned), rtol=0, atol=0)
        return
    assert owned, "every rank owns a gradient of this model"
    refusal = rf"rank {rank}: torch.nn.utils.get_total_norm got the gradient of parameter \S+, which a ShardedDataParallel"
    before = [g.clone() for g in owned]
    with pytest.raises(RuntimeError, match=refusal):
        torch.nn.utils.get_total_norm(owned)
    with pytest.raises(RuntimeError, match=refusal + ".*bound before sharded routed it"):
        clip_bound_at_import(ours.parameters(), MAX_NORM)
    assert all(torch.equal(a, b) for a, b in zip(owned, before)), "nothing was clipped"


def _check_oss_alone(rank, world):
    ref_model, our_model = gpt(), gpt()
    ref, ref_opt = DDP(ref_model), torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    ours, our_opt = DDP(our_model), OSS(our_model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    sdp_model = gpt()  # a ShardedDataParallel alive elsewhere installs the route: OSS's clipping stays torch's
    sdp = ShardedDataParallel(sdp_model, OSS(sdp_model.parameters(), torch.optim.SGD, lr=0.1))
    for step, norm_type in enumerate(NORMS):
        norms = [
            _step(model, opt, rank, world, step, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM, norm_type))
            for model, opt in ((ours, our_opt), (ref, ref_opt))
        ]
        assert torch.equal(norms[0], norms[1]) and norms[0] > MAX_NORM, f"step {step}: {norms}"
        _assert_equal(ours, ref, f"OSS step {step}")
    assert sdp.world_size == world


def _check_both(rank, world):
    _check_oss_alone(rank, world)
    _check_sharded_ddp(rank, world)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_torchs_clip_grad_norm_gives_ddps_norm_and_step_over_sharded_ddp_and_stays_torchs_with_oss(world_size):
    run_on_ranks(_check_both, world_size)
