"""Layer 2 mechanism: route each gradient, as it becomes ready in backward, to the rank that owns
its parameter.

Gradients are packed into per-owner flat buckets. As soon as a bucket is complete it is reduced
asynchronously to its owner while backward continues; buckets are launched strictly in plan
order so that every rank issues the same collectives in the same sequence. At the end of the
outermost backward one callback launches what is left, waits for everything, and hands out the
results: the owner's ``param.grad`` becomes a view of the reduced bucket, every other rank's
becomes ``None``. That is ZeRO-2: gradient memory per rank is its shard plus the buckets in flight.

Each bucket carries one extra element per parameter, 1 where the gradient was produced. After the
reduce the owner knows which parameters no rank used, and leaves their gradients alone as DDP does.

The router only connects its parts, each with one job:

- :class:`~.bucket_index.BucketIndex`: the buckets and where each gradient goes in them,
  re-planned once from the order the first backward really produced the gradients;
- :class:`~.learned_graph.LearnedGraph`: how often each gradient arrives (reentrant
  checkpointing fires a shared parameter's hook once per segment), and with ``static_graph``
  the graph fixed after the first synced backward;
- :class:`~.late_grads.LateGradients`: gradients that arrive after their bucket left, reduced
  again in a second, agreed pass;
- :class:`~.reduce_pass.Pass`: one backward's buffers, sends in flight and arrival counts;
- :class:`~.grad_checks.GradChecks`: gradients no bucket can carry, refused before a collective;
- :class:`~.backward_stats.BackwardStats`: what a finished pass reports.
"""

from __future__ import annotations

import enum
import functools
import time
from typing import Optional, Sequence, cast

import torch
import torch.distributed as dist

from .._common import comm
from .backward_stats import BackwardStats
from .bucket_index import BucketIndex
from .grad_checks import GradChecks
from .late_grads import LateGradients
from .learned_graph import LearnedGraph
from .reduce_pass import MAX_SENDS_IN_FLIGHT, Fill, Pass

__all__ = ["BackwardStats", "GradRouter", "MAX_SENDS_IN_FLIGHT", "Phase"]


class Phase(enum.Enum):
    """Where the router is in the backward pass."""

    IDLE = "idle"  # ready for a synced backward
    BACKWARD = "backward"  # reduces in flight
    REDUCED = "reduced"  # owners hold averaged gradients until step() or zero_grad()


class GradRouter:
    """Reduces gradients to their owners during backward, in buckets, overlapped with backward.

    Args:
        params: trainable parameters in expected gradient-ready order (reverse of definition).
        owner_of: parameter -> owner rank in ``group``.
        group: the process group shared with the sharded optimizers.
        bucket_numel: most elements per bucket; larger gradients travel alone.
        reduce_fp16: reduce fp32/fp64 gradients in fp16 (bf16 and fp16 stay as they are).
        names: parameter -> its name in the module, for error messages.
        static_graph: learn the gradients from the first synced backward, then skip the
            per-backward agreement on late gradients and the read of the 'used' flags; a later
            backward that produces other gradients raises (see :mod:`.learned_graph`).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        owner_of: dict[torch.Tensor, int],
        group: comm.ProcessGroup,
        bucket_numel: int,
        reduce_fp16: bool,
        names: Optional[dict[torch.Tensor, str]] = None,
        static_graph: bool = False,
        optimizer_keys: Sequence[int] = (),
    ) -> None:
        self.group = group
        self.rank = comm.group_rank(group)
        self.world_size = comm.group_size(group)
        self.params = tuple(params)
        self._names = names or {}
        self._scale = 1.0 / self.world_size  # pre-divide, as DDP does
        self.bucket_index = BucketIndex(self.params, owner_of, bucket_numel, reduce_fp16)
        self._graph = LearnedGraph(len(self.params), static_graph, self._name_of, self.rank)
        self._checks = GradChecks(self.params, self._name_of, self.rank, hooked=self.world_size > 1)
        self.phase = Phase.IDLE
        self.sync_enabled = True  # False: the last forward ran inside no_sync()
        self.last_backward: Optional[BackwardStats] = None
        self._pass = Pass(len(self.params), [0] * len(self.buckets), self.rank)
        self._late = LateGradients()
        self._end_queued = False
        self._armed_at = 0.0
        # A backward that runs before the reduced gradients are zeroed (after a step, or with
        # several optimizers before some stepped) adds to what the reduce handed out on each
        # owner, where DDP adds to every rank's copy: the owner's sum then lacks the other ranks'
        # share. Harmless unless a step applies it (a GAN's generator backward reaches the
        # critic's gradients, zeroed before the critic's next step). Tracked here: the gradients
        # the last reduce handed out on this rank; the optimizers (keys) not zeroed since (the
        # same on every rank); the handed-out gradients a backward added to (this rank's); and,
        # agreed by all ranks, the parameters whose gradient is so spoiled (on the owner: the
        # tensor handed out, until it is released or zeroed).
        self._optimizer_keys = frozenset(optimizer_keys)
        self._held_after_step: dict[int, torch.Tensor] = {}
        self._unzeroed: set[int] = set()
        self._added_to_held: set[int] = set()
        self._about_to_add: set[int] = set()  # the same, until autograd really accumulates
        self._spoiled: dict[int, Optional[torch.Tensor]] = {}
        # On one rank every gradient is already complete where autograd put it.
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, index))
            for index, p in enumerate(self.params)
            if self.world_size > 1
        ] + [
            p.register_hook(functools.partial(self._before_accumulate, index))
            for index, p in enumerate(self.params)
            if self.world_size > 1
        ]

    @property
    def buckets(self) -> tuple:
        """The reduce buckets, in launch order."""
        return self.bucket_index.buckets

    def carry_tracking_from(self, old: GradRouter) -> None:
        """Take over what ``old`` (the router this one replaces) knew of the gradients its last
        reduce handed out, so a rebuild (``refresh_trainable``) does not forget them. Same on
        every rank."""
        index_of = self.bucket_index.index_of

        def remap(entries: dict) -> dict:
            return {index_of[old.params[i]]: v for i, v in entries.items() if old.params[i] in index_of}

        self._unzeroed = set(old._unzeroed)
        self._held_after_step = remap(old._held_after_step)
        self._added_to_held = set(remap(dict.fromkeys(old._added_to_held)))
        self._spoiled = remap(old._spoiled)

    def remove_hooks(self) -> None:
        """Detach from the parameters (before a new router replaces this one)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _name_of(self, index: int) -> str:
        param = self.params[index]
        return self._names.get(param, f"of shape {tuple(param.shape)}")

    # ----------------------------------------------------------------------- phase changes

    def mark_grads_consumed(self) -> None:
        """An optimizer stepped or gradients were zeroed: the next backward starts afresh (one
        that adds to reduced gradients still held is told by the spoiled-gradient tracking)."""
        if self.phase is Phase.REDUCED:
            self.phase = Phase.IDLE

    def after_zero_grad(self, optimizer_key: Optional[int] = None, params: Optional[Sequence[torch.Tensor]] = None
                        ) -> None:
        """``params``' gradients (``None``: every one, the wrapper's ``zero_grad``) were zeroed."""
        self.mark_grads_consumed()
        if params is not None:
            self._unzeroed.discard(cast(int, optimizer_key))
        if params is None or not self._unzeroed:  # every optimizer zeroed since the last reduce
            self._unzeroed.clear()
            self._held_after_step.clear()
            self._added_to_held.clear()
            self._about_to_add.clear()
            self._spoiled.clear()
            return
        for p in params:  # a zeroing voids what was added to a gradient, as DDP's does
            index = self.bucket_index.index_of.get(p, -1)
            self._held_after_step.pop(index, None)
            self._added_to_held.discard(index)
            self._spoiled.pop(index, None)

    def before_step(self, params: Sequence[torch.Tensor]) -> None:
        """Collective when some of ``params`` had a spoiled gradient: raise on every rank if one
        still holds it (not released or zeroed since), before the step applies it."""
        if not self._spoiled:
            return
        indices = [i for i in (self.bucket_index.index_of.get(p, -1) for p in params) if i in self._spoiled]
        if not indices:
            return
        held = [i for i in indices if self._still_spoiled(i)]
        flag = torch.tensor([max(held, default=-1)], dtype=torch.int64, device=comm.comm_device(self.group))
        comm.all_reduce(flag, self.group, dist.ReduceOp.MAX)
        for i in indices:
            del self._spoiled[i]
        index = int(flag.item())
        if index >= 0:
            param = self.params[index]
            raise RuntimeError(
                f"rank {self.rank}: optimizer.step() would apply the gradient of parameter "
                f"{self._name_of(index)}, to which a backward added after an earlier reduce had handed it "
                f"out on its owner, rank {self.bucket_index.owner_of[param]}, with no zero_grad() in between (a "
                "step without zero_grad(), or a second backward before this optimizer stepped). DDP "
                "adds the new average to the old one on every rank, but the other ranks had released "
                "theirs, so this sum lacks their share. Zero this optimizer's gradients before each "
                "backward that should not add to them; accumulate over several backward passes "
                "inside no_sync()."
            )

    def _still_spoiled(self, index: int) -> bool:
        handed = self._spoiled[index]
        grad = self.params[index].grad
        return handed is not None and grad is handed and bool(grad.any())

    def before_forward(self) -> None:
        """Check the gradients held from earlier passes, and start clean after a failed backward.

        Called outside any backward only: a backward still marked as running then has died (it
        raised), so its bookkeeping is dropped rather than mixed into the next one.
        """
        if torch._C._current_graph_task_id() != -1:
            return  # recomputation inside a backward (reentrant checkpointing)
        self._checks.check_held()
        self._end_queued = False
        if self.phase is Phase.BACKWARD:
            self.phase = Phase.IDLE

    def on_output_grad(self) -> None:
        """A gradient reached one of the wrapped module's outputs: backward has begun there.

        The end-of-backward flush is queued on *this* backward, the outermost one that runs
        through the module, so that nested backward passes (reentrant checkpointing) that
        produce the parameters' gradients never end the reduction early.
        """
        if self.sync_enabled and self.phase is not Phase.BACKWARD:
            self._arm()

    def reduce_current_grads(self) -> None:
        """Reduce whatever gradients the parameters hold now (e.g. after ``no_sync`` steps)."""
        if self.world_size == 1:
            return
        self._checks.check_held()
        self._begin_pass(current=None)
        self._flush(after_backward=False)

    # ------------------------------------------------------------------------- hot path

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        grad = cast(torch.Tensor, param.grad)  # a post-accumulate-grad hook: it is set
        self._checks.note_arrival(index, grad, raise_now=self.sync_enabled)
        if self._about_to_add:
            self._added(index)
        if not self.sync_enabled:
            if self.phase is Phase.REDUCED:  # no step consumed the last reduce (a skipped one)
                self._leave_reduced(current=param)  # decide before no_sync() refills the grads
            return
        if self.phase is not Phase.BACKWARD:
            self._begin_pass(current=param)
            self._arm()
        bw = self._pass
        arrivals, expected = bw.arrive(index), self._graph.expected[index]
        if arrivals < expected:  # more to come: autograd keeps summing into param.grad
            bw.partial.add(index)
            return
        b, slot = self.bucket_index.location[index]
        if b < bw.next_launch:
            self._graph.check_not_late(index)
            self._late.keep(index, self._take(index), self._scale, self.bucket_index.wire_dtype_of(index))
            return
        self._fill(b).add(slot, self._take(index), self._scale)
        if arrivals == expected:
            bw.partial.discard(index)
            bw.waiting[b] -= 1
            self._launch_ready_buckets()

    def _take(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s gradient, which leaves the parameter for a bucket."""
        param = self.params[index]
        grad = cast(torch.Tensor, param.grad)
        param.grad = None
        return grad

    def _before_accumulate(self, index: int, incoming: torch.Tensor) -> None:
        """Before autograd adds to a parameter's gradient: does it add to the one the last reduce
        handed out, still non-zero? A release gives a new tensor; a zeroing, by any route (the
        inner module's ``zero_grad(set_to_none=False)``, ``.data.zero_()``), leaves zeros, and
        what is added after it is new: forget that gradient (and a spoiling it carried). Values,
        not version counters: the handed-out gradients share their bucket's counter, and
        ``.data`` changes none."""
        if not (self._held_after_step or self._about_to_add):
            return
        self._about_to_add.discard(index)
        held = self._held_after_step.get(index)
        if held is None or self.params[index].grad is not held:
            return
        if not bool(held.any()):
            self._forget_zeroed(index)
        elif self.sync_enabled:  # inside no_sync() it stays put: a later zeroing or the flush's scan decides
            self._about_to_add.add(index)

    def _forget_zeroed(self, index: int) -> None:
        del self._held_after_step[index]
        self._added_to_held.discard(index)
        if index in self._spoiled:  # the entry stays (every rank has it); its owner holds nothing spoiled
            self._spoiled[index] = None

    def _added(self, index: int) -> None:
        """Autograd did accumulate (``torch.autograd.grad`` fires the pre-hook, not this)."""
        if index in self._about_to_add:
            self._about_to_add.discard(index)
            self._held_after_step.pop(index, None)
            self._added_to_held.add(index)

    def _note_held(self, index: int, grad: Optional[torch.Tensor]) -> None:
        """``grad``, about to be reduced again: is it the handed-out one, non-zero?"""
        held = self._held_after_step.pop(index, None)
        if held is not None and grad is held and bool(held.any()):
            self._added_to_held.add(index)

    def _agree_on_spoiled(self) -> list[int]:
        """Collective, at a reduce while some optimizer was not zeroed since the last one: every
        rank learns which handed-out gradients some owner's backward added to, or that this
        reduce takes again (held and not reached by the backward, its bucket still to leave)."""
        for index in list(self._held_after_step):
            self._note_held(index, self.params[index].grad)
        flags = torch.zeros(len(self.params), dtype=torch.int32, device=comm.comm_device(self.group))
        flags[sorted(self._added_to_held)] = 1
        comm.all_reduce(flags, self.group, dist.ReduceOp.MAX)
        spoiled = flags.nonzero().flatten().tolist()
        self._spoiled.update((i, None) for i in spoiled)
        self._added_to_held.clear()
        return spoiled

    def _remember_hand_outs(self, spoiled: Sequence[int]) -> None:
        """On the owners: the reduced gradient just handed out for each newly spoiled parameter."""
        for index in spoiled:
            param = self.params[index]
            if self.bucket_index.owner_of[param] == self.rank:
                self._spoiled[index] = param.grad

    # ---------------------------------------------------------------------- bucket life

    def _arm(self) -> None:
        """Queue the end-of-backward flush on the backward under way (once)."""
        if not self._end_queued:
            self._end_queued = True
            self._armed_at = time.perf_counter()
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _begin_pass(self, current: Optional[torch.Tensor]) -> None:
        if self.phase is Phase.REDUCED:
            self._leave_reduced(current)
        self.phase = Phase.BACKWARD
        expected = self._graph.expected
        waiting = [sum(1 for i in members if expected[i] > 0) for members in self.bucket_index.members]
        self._pass = Pass(len(self.params), waiting, self.rank, is_backward=current is not None)
        self._late = LateGradients()

    def _leave_reduced(self, current: Optional[torch.Tensor]) -> None:
        """A backward (synced or inside no_sync) starts while the last reduce was not consumed
        by a step: go on only if zero_grad() cleared the gradients since (a skipped step)."""
        if not self._grads_cleared_on_every_rank(current):
            raise RuntimeError(
                f"rank {self.rank}: backward ran again after the gradients were reduced and "
                "before optimizer.step() (every optimizer's, with several) or zero_grad(); "
                "non-owner ranks have already released theirs, so they cannot be accumulated. "
                "Accumulate inside no_sync(), or step and zero the gradients between backward "
                "passes."
            )
        self.phase = Phase.IDLE

    def _on_backward_end(self) -> None:
        self._end_queued = False
        if self.phase is Phase.BACKWARD:
            self._flush(after_backward=True)

    def _fill(self, b: int) -> Fill:
        bw = self._pass
        fill = bw.fills[b]
        if fill is None:
            fill = bw.fills[b] = Fill(self.buckets[b], b)
            bw.hold(fill.nbytes)
        return fill

    def _launch_ready_buckets(self) -> None:
        bw = self._pass
        while bw.next_launch < len(self.buckets) and bw.waiting[bw.next_launch] == 0:
            bw.launch_clocks.append(bw.clock)
            if bw.first_launch_at is None:
                bw.first_launch_at = time.perf_counter()
            self._launch(bw.next_launch)

    def _launch(self, b: int) -> None:
        bw = self._pass
        fill = self._fill(b)
        self._take_unannounced(b, fill)
        fill.seal()
        if bw.is_backward:
            members = self.bucket_index.members[b]
            self._graph.note_sent(members[slot] for slot, written in enumerate(fill.written) if written)
        bw.fills[b] = None
        bw.next_launch = b + 1
        bw.send(fill, self.group)
        bw.release_sent()

    def _take_unannounced(self, b: int, fill: Fill) -> None:
        """Gradients the parameters hold but no hook announced in this pass (kept from ``no_sync``
        steps, set by hand, or zeros left by ``zero_grad(set_to_none=False)``) join the bucket,
        each checked (which may raise) before any is taken."""
        members = self.bucket_index.members[b]
        held = [slot for slot in fill.empty_slots() if self.params[members[slot]].grad is not None]
        for slot in held:
            self._check_unannounced(members[slot])
        for slot in held:
            fill.add(slot, self._take(members[slot]), self._scale)

    def _check_unannounced(self, index: int) -> None:
        """Refuse what cannot be reduced, and note a handed-out gradient taken again."""
        grad = cast(torch.Tensor, self.params[index].grad)
        self._checks.check(index, grad)
        if self._graph.is_fixed and self._pass.is_backward:
            self._graph.check_held(index)
        if self._held_after_step:
            self._note_held(index, grad)

    def _flush(self, after_backward: bool) -> None:
        """End of backward: launch what is left, reduce late gradients, hand out the results.
        Only a real backward (``after_backward``) can have late gradients or teach the order;
        an explicit ``reduce()`` skips the agreement on late gradients, since no hook fired.
        Once ``static_graph`` has fixed the graph, a backward checks its arrival counts instead
        (before the flush launches anything, so ranks that all see the change all raise alike)
        and hands out the learned set of used gradients."""
        spoiled = self._agree_on_spoiled() if self._unzeroed else []
        self._held_after_step.clear()
        bw = self._pass
        bw.flushed_at = time.perf_counter()
        fixed = after_backward and self._graph.is_fixed
        if fixed:
            self._graph.check_arrivals(bw.arrivals)
        with torch.profiler.record_function("sharded::flush_pending_reduces"):
            for index in bw.partial:  # fewer arrivals than last time: what came is complete
                b, slot = self.bucket_index.location[index]
                self._fill(b).add(slot, self._take(index), self._scale)
            for b in range(bw.next_launch, len(self.buckets)):
                self._launch(b)
            if after_backward and not fixed:
                self._send_corrections()
            for sent in bw.wait_all():
                self._hand_out(sent.fill, sent.is_correction, fixed)
        if spoiled:
            self._remember_hand_outs(spoiled)
        self._unzeroed = set(self._optimizer_keys)
        self.phase = Phase.REDUCED
        if after_backward:
            self._learn_from(bw, agreed=not fixed)

    def _send_corrections(self) -> None:
        """Reduce again the buckets some rank's late gradients need (after agreeing which)."""
        bw = self._pass
        for fill in self._late.corrections(self.bucket_index, self.group):
            members = self.bucket_index.members[fill.index]
            self._graph.note_sent(members[slot] for slot, written in enumerate(fill.written) if written)
            bw.hold(fill.nbytes)
            bw.late_reduces += 1
            bw.send(fill, self.group, is_correction=True)

    def _hand_out(self, fill: Fill, is_correction: bool, fixed: bool) -> None:
        """On the owner: the reduced results become the parameters' gradients. With the graph
        ``fixed`` the learned set of used gradients replaces the flags."""
        members = self.bucket_index.members[fill.index]
        used = self._graph.used_slots(members) if fixed else None
        for slot in fill.hand_out(is_correction, used):
            index = members[slot]
            self._held_after_step[index] = cast(torch.Tensor, self.params[index].grad)

    def _learn_from(self, bw: Pass, agreed: bool) -> None:
        """Report the pass; re-plan once by its order; learn its arrivals (and, with
        ``static_graph``, fix the graph after the first)."""
        self.last_backward = BackwardStats.of(bw, self.buckets, self._armed_at, agreed)
        if not self.bucket_index.from_observed_order:
            self.bucket_index.replan_from(bw.completed_at, self.group)
        self._graph.learn(bw.arrivals, self.group)

    def _grads_cleared_on_every_rank(self, except_param: Optional[torch.Tensor]) -> bool:
        """Whether zero_grad() ran since the last reduce: every gradient it handed out on this
        rank that no step consumed is gone or zero (one it did not reach, such as a generator's
        held from its own step while a critic's backward ran, is not its concern).

        Only reached when a backward starts without a step since the last one (e.g. GradScaler
        skipped it), so the one small collective that makes all ranks decide alike is cheap.
        """
        handed = (self.params[i] for i in self._held_after_step)
        cleared = all(p.grad is None or not p.grad.any() for p in handed if p is not except_param)
        flag = torch.tensor([float(cleared)], device=comm.comm_device(self.group))
        comm.all_reduce(flag, self.group, dist.ReduceOp.MIN)
        return bool(flag.item())
