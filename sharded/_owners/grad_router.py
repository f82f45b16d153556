"""Layer 2 mechanism: route each gradient, as it becomes ready in backward, to the rank that owns
its parameter.

Gradients are packed into per-owner flat buckets. As soon as a bucket is complete it is reduced
asynchronously to its owner while backward continues; buckets are launched strictly in plan
order so that every rank issues the same collectives in the same sequence. At the end of the
outermost backward one callback launches what is left, waits for everything, and hands out the
results: the owner's ``param.grad`` becomes a view of the reduced bucket, every other rank's
becomes ``None``. That is ZeRO-2: gradient memory per rank is its shard plus the buckets in flight.

When is a gradient complete? A parameter's gradient-ready hook fires once per backward pass
that reaches it, and a backward may contain nested ones (reentrant activation checkpointing runs
one per checkpointed segment), so a parameter shared by several segments fires several times.
The router learns, on each rank, how many times each parameter fired in the previous backward
and treats its gradient as complete after that many; a parameter that fired zero times (unused)
no longer holds its bucket back. The plan itself is rebuilt once, after the first backward,
from the order in which gradients really completed (rank 0's order, so every rank agrees), as
DDP rebuilds its buckets.

A gradient that arrives after its bucket has left (the graph changed: a branch taken for the
first time, one more reuse) is never dropped nor overwritten: it is kept aside and, after one
small all-reduce in which the ranks agree which buckets need it, reduced in a second pass and
added to the owner's result. Reduction is linear, so the result is the same. The agreement is
one small all-reduce at the end of every synced backward; only a step with late gradients pays
the second reduce.

Each bucket carries one extra element per parameter, 1 where the gradient was produced. After the
reduce the owner knows which parameters no rank used, and leaves their gradients alone as DDP does.

With ``static_graph`` (DDP's switch of that name) the first synced backward runs as above and
teaches the graph: each parameter's count of arrivals, and which parameters some rank used. From
then on the agreement is skipped and the owner hands out the learned set instead of reading the
flags back: no collective beyond the bucket reduces, and no host sync at the flush. A gradient
that arrives late, or a count that differs from the learned one at the flush, raises on that
rank instead of being reduced in a pass the other ranks no longer join.
"""

from __future__ import annotations

import enum
import functools
import time
from collections import deque
from dataclasses import dataclass
from typing import NoReturn, Optional, Sequence, cast

import torch
import torch.distributed as dist

from .._common import comm
from .reduce_pass import Fill, Pass
from .reduce_plan import plan_reduce_buckets

# Reduces of other owners' buckets a rank keeps in flight during backward before it waits for
# the oldest: bounds the buffers held when the backward outruns the communication (a starved
# gloo thread), which otherwise grow with every bucket sent.
MAX_SENDS_IN_FLIGHT = 1

__all__ = ["BackwardStats", "GradRouter", "Phase"]


class Phase(enum.Enum):
    """Where the gradients are in the step."""

    IDLE = "idle"  # ready for a synced backward
    BACKWARD = "backward"  # reduces in flight
    REDUCED = "reduced"  # owners hold averaged gradients until step() or zero_grad()


@dataclass(frozen=True)
class BackwardStats:
    """How the reduction of the last synced backward went on this rank.

    Attributes:
        buckets: reduces in the plan (each backward issues all of them).
        launched_during_backward: how many of those started while gradients were still
            arriving, i.e. overlapped with backward; the rest left with the last gradient or
            at the end-of-backward flush.
        late_reduces: extra reduces for gradients that arrived after their bucket had left.
        peak_bucket_bytes: most bytes of gradient buckets this rank kept at once: its own
            shard, the bucket filling, and buckets for other owners until their send is known
            to be complete (at most ``MAX_SENDS_IN_FLIGHT`` of those, however slow the link).
        overlap: share of the backward's wall time (from its start to the flush) during which
            a reduce was already under way; near 0 when gradients only arrive at the very end
            (e.g. a compiled backward hands all of them over at once). It counts from the first
            reduce's start, so one small early bucket lifts it near 1 even when most bytes leave
            at the end: read it beside ``overlap_bytes``.
        overlap_bytes: the plan's gradient bytes (at the parameters' dtype, whatever the wire
            dtype), each weighted by the share of the backward's gradients still to come when
            its bucket left, over all of them: 1 if every byte left as the backward began, 0
            if all left with the last gradient or at the end-of-backward flush. A bucket that
            leaves three quarters of the way through counts a quarter of its bytes, however
            early a small first bucket left.
        agreed_on_late_gradients: whether this backward ran the small all-reduce in which the
            ranks agree on late gradients; False once ``static_graph`` has learned the graph.
    """

    buckets: int
    launched_during_backward: int
    late_reduces: int
    peak_bucket_bytes: int
    overlap: float
    overlap_bytes: float
    agreed_on_late_gradients: bool


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
            backward that produces other gradients raises (see the module docstring).
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
        self._owner_of = owner_of
        self._bucket_numel = bucket_numel
        self._reduce_fp16 = reduce_fp16
        self._names = names or {}
        self._scale = 1.0 / self.world_size  # pre-divide, as DDP does
        self._expected = [1] * len(self.params)
        self._order_observed = False
        self._static_graph = static_graph
        self._graph_fixed = False  # static_graph, and the first synced backward has taught it
        self._used_here: set[int] = set()  # parameters this rank sent a gradient for, while learning
        self._used: list[bool] = []  # per parameter: some rank used it (once the graph is fixed)
        self._used_slots: list[list[bool]] = []  # the same per bucket slot
        self._index_of = {p: i for i, p in enumerate(self.params)}
        self._plan(self.params)
        self.phase = Phase.IDLE
        self.sync_enabled = True  # False: the last forward ran inside no_sync()
        self.last_backward: Optional[BackwardStats] = None
        self._pass = Pass(len(self.params), [0] * len(self.buckets))
        self._end_queued = False
        self._backward_started_at = 0.0
        self._unreducible: set[int] = set()  # parameters whose hook saw a sparse or graph-carrying gradient
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

    def carry_tracking_from(self, old: GradRouter) -> None:
        """Take over what ``old`` (the router this one replaces) knew of the gradients its last
        reduce handed out, so a rebuild (``refresh_trainable``) does not forget them. Same on
        every rank."""
        def remap(entries: dict) -> dict:
            return {self._index_of[old.params[i]]: v for i, v in entries.items() if old.params[i] in self._index_of}

        self._unzeroed = set(old._unzeroed)
        self._held_after_step = remap(old._held_after_step)
        self._added_to_held = set(remap(dict.fromkeys(old._added_to_held)))
        self._spoiled = remap(old._spoiled)

    def remove_hooks(self) -> None:
        """Detach from the parameters (before a new router replaces this one)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _plan(self, ready_order: Sequence[torch.Tensor]) -> None:
        self.buckets = plan_reduce_buckets(ready_order, self._owner_of, self._bucket_numel, self._reduce_fp16)
        index_of = {p: i for i, p in enumerate(self.params)}
        self._location = [(0, 0)] * len(self.params)
        self._members = []
        for b, bucket in enumerate(self.buckets):
            self._members.append([index_of[p] for p in bucket.params])
            for slot, p in enumerate(bucket.params):
                self._location[index_of[p]] = (b, slot)

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
            index = self._index_of.get(p, -1)
            self._held_after_step.pop(index, None)
            self._added_to_held.discard(index)
            self._spoiled.pop(index, None)

    def before_step(self, params: Sequence[torch.Tensor]) -> None:
        """Collective when some of ``params`` had a spoiled gradient: raise on every rank if one
        still holds it (not released or zeroed since), before the step applies it."""
        if not self._spoiled:
            return
        indices = [i for i in (self._index_of.get(p, -1) for p in params) if i in self._spoiled]
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
                f"{self._name(param)}, to which a backward added after an earlier reduce had handed it "
                f"out on its owner, rank {self._owner_of[param]}, with no zero_grad() in between (a "
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
        self._check_held_grads()
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
            self._queue_end_of_backward()

    def reduce_current_grads(self) -> None:
        """Reduce whatever gradients the parameters hold now (e.g. after ``no_sync`` steps)."""
        if self.world_size == 1:
            return
        self._check_held_grads()
        self._begin_backward(current=None)
        self._flush(after_backward=False)

    # ------------------------------------------------------------------------- hot path

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        grad = cast(torch.Tensor, param.grad)  # a post-accumulate-grad hook: it is set
        if grad.is_sparse or grad.requires_grad:
            self._unreducible.add(index)  # the next forward (or reduce) raises while it is held
            if self.sync_enabled:
                self._check_reducible(param, grad)
        if self._about_to_add:
            self._added(index)
        if not self.sync_enabled:
            if self.phase is Phase.REDUCED:  # no step consumed the last reduce (a skipped one)
                self._leave_reduced(current=param)  # decide before no_sync() refills the grads
            return
        if self.phase is not Phase.BACKWARD:
            self._begin_backward(current=param)
            self._queue_end_of_backward()
        bw = self._pass
        bw.arrivals[index] += 1
        bw.clock += 1
        bw.completed_at[index] = bw.clock
        arrivals, expected = bw.arrivals[index], self._expected[index]
        if arrivals < expected:  # more to come: autograd keeps summing into param.grad
            bw.partial.add(index)
            return
        b, slot = self._location[index]
        if b < bw.next_launch:
            if self._graph_fixed:
                self._raise_graph_changed(index, "arrived after its bucket had been reduced")
            self._keep_late(index, param, grad)
            return
        self._fill(b).add(slot, grad, self._scale)
        param.grad = None
        if arrivals == expected:
            bw.partial.discard(index)
            bw.waiting[b] -= 1
            self._launch_ready_buckets()

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
            if self._owner_of[param] == self.rank:
                self._spoiled[index] = param.grad

    def _launch_ready_buckets(self) -> None:
        bw = self._pass
        while bw.next_launch < len(self.buckets) and bw.waiting[bw.next_launch] == 0:
            bw.launch_clocks.append(bw.clock)
            if bw.first_launch_at is None:
                bw.first_launch_at = time.perf_counter()
            self._launch(bw.next_launch)

    def _keep_late(self, index: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        late = self._pass.late
        if index in late:
            late[index].add_(grad, alpha=self._scale)
        else:
            late[index] = grad.mul(self._scale).to(self.buckets[self._location[index][0]].wire_dtype)
        param.grad = None

    def _check_held_grads(self) -> None:
        """Raise, before any collective, for a held gradient that no reduce could carry.

        On several ranks the hooks note such gradients as they arrive (a synced backward raises
        at once, one inside ``no_sync`` leaves it to here), so only those are looked at; gradients
        set by hand are checked where a bucket takes them in (:meth:`Fill.seal`). One rank has no
        hooks: every held gradient is looked at.
        """
        if self.world_size == 1:
            for p in self.params:
                if p.grad is not None:
                    self._check_reducible(p, p.grad)
            return
        if not self._unreducible:
            return
        for index in sorted(self._unreducible):
            p = self.params[index]
            if p.grad is not None:
                self._check_reducible(p, p.grad)
        self._unreducible.clear()

    def _check_taken_held_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """A gradient the parameter holds without a hook having announced it, about to be taken
        into a bucket: refuse what cannot be reduced, and note a handed-out one taken again."""
        fixed = self._graph_fixed and self._pass.is_backward
        (self._check_held_in_fixed_graph if fixed else self._check_reducible)(param, grad)
        if self._held_after_step:
            self._note_held(self._index_of[param], grad)

    def _check_reducible(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(
                f"rank {self.rank}: parameter {self._name(param)} got a sparse gradient; "
                "ShardedDataParallel reduces dense gradients only. Use sparse=False on the "
                "embedding, or DistributedDataParallel for sparse gradients"
            )
        if grad.requires_grad:
            raise RuntimeError(
                f"rank {self.rank}: the gradient of parameter {self._name(param)} requires grad "
                "(backward with create_graph=True): ShardedDataParallel cannot reduce a "
                "gradient that carries a graph. Use torch.autograd.grad for higher-order "
                "terms, or DistributedDataParallel"
            )

    def _check_held_in_fixed_graph(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """A gradient held but never announced (no_sync, or set by hand) for a parameter the first
        backward left unused: the owner would drop it, since it no longer reads the flags."""
        self._check_reducible(param, grad)
        index = self._index_of[param]
        if not self._used[index]:
            self._raise_graph_changed(index, "is held (accumulated inside no_sync() or set by hand), but no rank produced it in the first synced backward")

    def _raise_graph_changed(self, index: int, what: str) -> NoReturn:
        raise RuntimeError(
            f"rank {self.rank}: the gradient of parameter {self._name(self.params[index])} {what}: "
            "the backward produced other gradients than the first one did. static_graph=True "
            "assumes the same gradients every iteration; construct ShardedDataParallel without it "
            "for a graph that changes"
        )

    def _check_graph_unchanged(self, bw: Pass) -> None:
        """With the graph fixed: every parameter arrived as often as in the first backward."""
        if bw.arrivals != self._expected:
            index, (got, expected) = next(
                (i, pair) for i, pair in enumerate(zip(bw.arrivals, self._expected)) if pair[0] != pair[1]
            )
            self._raise_graph_changed(index, f"arrived {got} time(s) in this backward, {expected} in the first")

    def _name(self, param: torch.Tensor) -> str:
        return self._names.get(param, f"of shape {tuple(param.shape)}")

    # ---------------------------------------------------------------------- bucket life

    def _begin_backward(self, current: Optional[torch.Tensor]) -> None:
        if self.phase is Phase.REDUCED:
            self._leave_reduced(current)
        self.phase = Phase.BACKWARD
        waiting = [sum(1 for i in members if self._expected[i] > 0) for members in self._members]
        self._pass = Pass(len(self.params), waiting, is_backward=current is not None)

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

    def _queue_end_of_backward(self) -> None:
        if not self._end_queued:
            self._end_queued = True
            self._backward_started_at = time.perf_counter()
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

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

    def _launch(self, b: int) -> None:
        bw = self._pass
        fill = self._fill(b)
        fill.seal(self._scale, check=self._check_taken_held_grad)
        if self._static_graph and not self._graph_fixed and bw.is_backward:
            self._used_here.update(self._members[b][slot] for slot, w in enumerate(fill.written) if w)
        bw.fills[b] = None
        bw.next_launch = b + 1
        self._send(fill, is_correction=False)
        self._release_sent_buckets()

    def _send(self, fill: Fill, is_correction: bool) -> None:
        with torch.profiler.record_function("sharded::reduce_bucket"):
            work = comm.start_reduce(fill.buffer, fill.bucket.owner, self.group)
        self._pass.in_flight.append((fill, work, is_correction))

    def _release_sent_buckets(self) -> None:
        """Free the buffers of buckets this rank has finished sending to another owner, and wait
        for the older ones so that at most ``MAX_SENDS_IN_FLIGHT`` are held: the next bucket
        fills beside them, so a rank holds at most that many plus one buckets of other owners'
        gradients however far the communication lags behind the backward.

        Owned buckets wait for the flush: reading their 'used' flags would make an accelerator
        synchronise in the middle of backward.
        """
        bw = self._pass
        sending = sum(1 for fill, _, _ in bw.in_flight if fill.bucket.owner != self.rank)
        still_in_flight: deque[tuple[Fill, dist.Work, bool]] = deque()
        for entry in bw.in_flight:
            fill, work, _ = entry
            if fill.bucket.owner != self.rank and (sending > MAX_SENDS_IN_FLIGHT or work.is_completed()):
                self._finish(*entry)
                sending -= 1
            else:
                still_in_flight.append(entry)
        bw.in_flight = still_in_flight

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
        fixed = after_backward and self._graph_fixed
        if fixed:
            self._check_graph_unchanged(bw)
        with torch.profiler.record_function("sharded::flush_pending_reduces"):
            for index in bw.partial:  # fewer arrivals than last time: what came is complete
                b, slot = self._location[index]
                param = self.params[index]
                self._fill(b).add(slot, cast(torch.Tensor, param.grad), self._scale)
                param.grad = None
            for b in range(bw.next_launch, len(self.buckets)):
                self._launch(b)
            if after_backward and not fixed:
                self._reduce_late_gradients()
            while bw.in_flight:
                self._finish(*bw.in_flight.popleft(), fixed=fixed)
        if spoiled:
            self._remember_hand_outs(spoiled)
        self._unzeroed = set(self._optimizer_keys)
        self.phase = Phase.REDUCED
        if after_backward:
            self._learn_from(bw, agreed=not fixed)

    def _reduce_late_gradients(self) -> None:
        """Agree which buckets received gradients after they left, then reduce those again."""
        bw = self._pass
        needs = torch.zeros(len(self.buckets), dtype=torch.int32)
        for index in bw.late:
            needs[self._location[index][0]] = 1
        needs = needs.to(comm.comm_device(self.group))
        comm.all_reduce(needs, self.group, dist.ReduceOp.MAX)
        for b in needs.nonzero().flatten().tolist():
            fill = Fill(self.buckets[b], b)
            bw.hold(fill.nbytes)
            for slot, index in enumerate(self._members[b]):
                if index in bw.late:
                    self._used_here.add(index)
                    fill.add(slot, bw.late.pop(index), 1.0)
            fill.seal(self._scale, take_held_grads=False)
            bw.late_reduces += 1
            self._send(fill, is_correction=True)

    def _finish(
        self, fill: Fill, work: dist.Work, is_correction: bool, fixed: bool = False
    ) -> None:
        """Wait for a bucket's reduce; the owner takes the results, everyone else lets go.

        With the graph ``fixed`` the owner hands out the learned set of used gradients instead
        of reading the flags.
        """
        with torch.profiler.record_function("sharded::wait_reduce"):
            work.wait()
        if fill.bucket.owner == self.rank:
            handed = fill.hand_out(is_correction, self._used_slots[fill.index] if fixed else None)
            members = self._members[fill.index]
            for slot in handed:
                index = members[slot]
                self._held_after_step[index] = cast(torch.Tensor, self.params[index].grad)
        else:
            self._pass.held_bytes -= fill.nbytes

    def _learn_from(self, bw: Pass, agreed: bool) -> None:
        """Expect as many arrivals per parameter as this backward had; re-plan once by its order;
        with ``static_graph``, fix the graph after the first."""
        self._expected = list(bw.arrivals)
        self.last_backward = BackwardStats(
            buckets=len(self.buckets),
            launched_during_backward=sum(1 for clock in bw.launch_clocks if clock < bw.clock),
            late_reduces=bw.late_reduces,
            peak_bucket_bytes=bw.peak_bytes,
            overlap=self._overlap_share(bw),
            overlap_bytes=self._overlap_bytes_share(bw),
            agreed_on_late_gradients=agreed,
        )
        if not self._order_observed:
            self._order_observed = True
            self._plan(self._agreed_ready_order(bw))
        if self._static_graph and not self._graph_fixed:
            self._graph_fixed = True
            used = torch.zeros(len(self.params), dtype=torch.int32)
            used[list(self._used_here)] = 1
            used = used.to(comm.comm_device(self.group))
            comm.all_reduce(used, self.group, dist.ReduceOp.MAX)  # once: every rank learns the set
            self._used = [bool(flag) for flag in used.tolist()]
            self._used_slots = [[self._used[i] for i in members] for members in self._members]
            self._used_here = set()

    def _overlap_share(self, bw: Pass) -> float:
        started = min(self._backward_started_at, bw.started_at)
        if bw.first_launch_at is None or bw.flushed_at <= started:
            return 0.0
        return (bw.flushed_at - bw.first_launch_at) / (bw.flushed_at - started)

    def _overlap_bytes_share(self, bw: Pass) -> float:
        """Gradient bytes weighted by the share of the backward's gradients still to come when
        their bucket left (see ``BackwardStats.overlap_bytes``)."""
        sizes = [bucket.grad_nbytes for bucket in self.buckets]
        total = sum(sizes)
        if not total or not bw.clock:
            return 0.0
        # Hooks launch buckets in plan order, so launch_clocks[b] belongs to bucket b; the
        # buckets after them left at the flush and count nothing.
        hidden = sum(size * (bw.clock - clock) for size, clock in zip(sizes, bw.launch_clocks))
        return hidden / (total * bw.clock)

    def _agreed_ready_order(self, bw: Pass) -> list[torch.Tensor]:
        """Rank 0's observed completion order (then the parameters it never saw), sent to all."""
        position = {p: i for i, p in enumerate(p for bucket in self.buckets for p in bucket.params)}
        never = len(self.params) + 1
        seen_at = [bw.completed_at[i] or never for i in range(len(self.params))]
        order = sorted(range(len(self.params)), key=lambda i: (seen_at[i], position[self.params[i]]))
        agreed = torch.tensor(order, dtype=torch.int64, device=comm.comm_device(self.group))
        comm.broadcast(agreed, 0, self.group, async_op=False)
        return [self.params[i] for i in agreed.tolist()]

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
