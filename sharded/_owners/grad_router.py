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
- :class:`~.held_averages.HeldAverages`: averages an earlier reduce left in ``param.grad``,
  set aside when a backward adds to them and added back after the reduce, so that loops that
  do not zero between backward passes get DDP's sums;
- :class:`~.reduce_pass.Pass`: one backward's buffers, sends in flight and arrival counts;
- :class:`~.grad_checks.GradChecks`: gradients no bucket can carry, refused before a collective;
- :class:`~.backward_stats.BackwardStats`: what a finished pass reports.
"""

from __future__ import annotations

import enum
import time
import weakref
from typing import Optional, Sequence, cast

import torch

from .._common import comm
from .._common.weak_hooks import weak_method_hook
from .backward_stats import BackwardStats
from .bucket_index import BucketIndex
from .grad_checks import GradChecks
from .held_averages import HeldAverages
from .late_grads import LateGradients
from .learned_graph import LearnedGraph
from .lowbit_reduce import LowBitBuckets
from .reduce_pass import Fill, Pass

__all__ = ["BackwardStats", "GradRouter", "Phase"]


class Phase(enum.Enum):
    """Where the router is in a synced backward."""

    IDLE = "idle"  # none under way
    ARMED = "armed"  # a backward reached the module's outputs; the flush is queued on it
    REDUCING = "reducing"  # gradients arriving, reduces in flight; the flush ends it


class GradRouter:
    """Reduces gradients to their owners during backward, in buckets, overlapped with backward.

    It registers the hooks, keeps the phase and sends each event to the part that handles it.

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
        lowbit: send the buckets in fewer bits (see :mod:`.lowbit_reduce`); ``None``: exact.
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
        lowbit: Optional[LowBitBuckets] = None,
    ) -> None:
        self.group = group
        self._lowbit = lowbit
        self.rank = comm.group_rank(group)
        self.world_size = comm.group_size(group)
        self.params = tuple(params)
        self._names = names or {}
        self._scale = 1.0 / self.world_size  # pre-divide, as DDP does (see set_divisor)
        self.bucket_index = BucketIndex(self.params, owner_of, bucket_numel, reduce_fp16)
        self._graph = LearnedGraph(len(self.params), static_graph, self._name_of, self.rank)
        self._checks = GradChecks(self.params, self._name_of, self.rank, hooked=self.world_size > 1)
        self._held = HeldAverages(self.params)
        self.phase = Phase.IDLE
        self.sync_enabled = True  # False: the last forward ran inside no_sync()
        self.last_backward: Optional[BackwardStats] = None
        self._pass = Pass(len(self.params), [0] * len(self.buckets), self.rank)
        self._late = LateGradients()
        self._armed_at = 0.0
        hooks = self._register_hooks() if self.world_size > 1 else []  # one rank: nothing to route
        # The hooks hold the router weakly (a strong hold is a cycle torch hides from the
        # collector: see _common.weak_hooks); a router its wrapper dropped takes them off.
        self._detach = weakref.finalize(self, _remove_all, hooks)

    def _register_hooks(self) -> list:
        return [
            hook
            for index, p in enumerate(self.params)
            for hook in (
                p.register_hook(weak_method_hook(self._before_accumulate, index)),
                p.register_post_accumulate_grad_hook(weak_method_hook(self._on_grad_ready, index)),
            )
        ]

    @property
    def buckets(self) -> tuple:
        """The reduce buckets, in launch order."""
        return self.bucket_index.buckets

    def carry_held_from(self, old: GradRouter) -> None:
        """Take over the averages ``old`` (the router this one replaces, after
        ``refresh_trainable``) knew this rank holds. Collective."""
        self._held.carry_from(old._held, self.bucket_index.owner_of, self.group)

    def remove_hooks(self) -> None:
        """Detach from the parameters now (before a new router replaces this one); a router
        that is freed detaches by itself."""
        self._detach()

    def _name_of(self, index: int) -> str:
        param = self.params[index]
        return self._names.get(param, f"of shape {tuple(param.shape)}")

    # ------------------------------------------------------------------- from the wrapper

    def before_forward(self) -> None:
        """Check the gradients held from earlier passes, and start clean after a failed backward.

        Called outside any backward only: a backward still marked as running then has died (it
        raised), so its bookkeeping is dropped rather than mixed into the next one.
        """
        if torch._C._current_graph_task_id() != -1:
            return  # recomputation inside a backward (reentrant checkpointing)
        self._checks.check_held()
        self._held.restore_awaiting()
        self.phase = Phase.IDLE

    def on_output_grad(self) -> None:
        """A gradient reached one of the wrapped module's outputs: backward has begun there.

        The end-of-backward flush is queued on *this* backward, the outermost one that runs
        through the module, so that nested backward passes (reentrant checkpointing) that
        produce the parameters' gradients never end the reduction early.
        """
        if self.sync_enabled and self.phase is Phase.IDLE:
            self._arm()

    def set_divisor(self, divisor: int) -> None:
        """Divide the gradients of the next reduces by ``divisor`` (default: the world size).

        Under ``Join`` with ``divide_by_initial_world_size=False`` it is the number of ranks
        that still have data, as in DDP: the joined ranks' zeros are left out of the average.
        """
        self._scale = 1.0 / divisor

    def shadow_backward(self) -> None:
        """On a rank out of data (under ``Join``): take part in every collective the other
        ranks' synced backward runs, contributing zeros, and hand out the gradients this rank
        owns (the others' average), as DDP's join hook shadows its all-reduces. Collective.

        What this rank held is released first: its gradients never join the others' sums
        (a joined DDP rank contributes zeros too), and what it owns after the pass is exactly
        the others' average, ready for its optimizer's step.
        """
        if self.world_size == 1:
            return
        for param in self.params:
            param.grad = None
        self._held = HeldAverages(self.params)
        self._begin_pass(is_backward=True)
        self._flush(after_backward=True, shadow=True)

    def reduce_current_grads(self) -> None:
        """Reduce whatever gradients the parameters hold now (e.g. after ``no_sync`` steps)."""
        if self.world_size == 1:
            return
        self._checks.check_held()
        self._begin_pass(is_backward=False)
        self._flush(after_backward=False)

    # ------------------------------------------------------------------------- hot path

    def _before_accumulate(self, index: int) -> None:
        self._held.before_accumulate(index)

    def _on_grad_ready(self, index: int) -> None:
        grad = cast(torch.Tensor, self.params[index].grad)  # a post-accumulate-grad hook: it is set
        self._held.after_accumulate(index, synced=self.sync_enabled)
        self._checks.note_arrival(index, grad, raise_now=self.sync_enabled)
        if not self.sync_enabled:
            return  # inside no_sync(): autograd's sum stays in param.grad
        if self.phase is not Phase.REDUCING:
            if self.phase is Phase.IDLE:  # a backward that did not pass the outputs' hooks
                self._arm()
            self._begin_pass(is_backward=True)
        arrivals, expected = self._pass.arrive(index), self._graph.expected[index]
        if arrivals < expected:  # more to come: autograd keeps summing into param.grad
            self._pass.partial.add(index)
        elif self.bucket_index.location[index][0] < self._pass.next_launch:
            self._graph.check_not_late(index)
            self._late.keep(index, self._take(index), self._scale, self.bucket_index.wire_dtype_of(index))
        else:
            self._add_to_bucket(index, complete=arrivals == expected)

    def _add_to_bucket(self, index: int, complete: bool) -> None:
        """Put parameter ``index``'s gradient in its bucket; launch the buckets that are ready."""
        b, slot = self.bucket_index.location[index]
        self._fill(b).add(slot, self._take(index), self._scale)
        if complete:
            self._pass.partial.discard(index)
            self._pass.waiting[b] -= 1
            self._launch_ready_buckets()

    def _take(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s gradient, which leaves the parameter for a bucket."""
        param = self.params[index]
        grad = cast(torch.Tensor, param.grad)
        param.grad = None
        return grad

    # ---------------------------------------------------------------------- bucket life

    def _arm(self) -> None:
        """Queue the end-of-backward flush on the backward under way."""
        self.phase = Phase.ARMED
        self._armed_at = time.perf_counter()
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _begin_pass(self, is_backward: bool) -> None:
        self.phase = Phase.REDUCING
        expected = self._graph.expected
        waiting = [sum(1 for i in members if expected[i] > 0) for members in self.bucket_index.members]
        self._pass = Pass(len(self.params), waiting, self.rank, is_backward)
        self._late = LateGradients()

    def _on_backward_end(self) -> None:
        if self.phase is Phase.REDUCING:
            self._flush(after_backward=True)
        self.phase = Phase.IDLE

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
            self._graph.note_sent(self._written(fill))
        bw.fills[b] = None
        bw.next_launch = b + 1
        bw.send(fill, self.group, lowbit=self._lowbit)
        bw.release_sent()

    def _written(self, fill: Fill) -> list[int]:
        """The parameter indices whose gradients this rank put in ``fill``."""
        members = self.bucket_index.members[fill.index]
        return [members[slot] for slot, written in enumerate(fill.written) if written]

    def _take_unannounced(self, b: int, fill: Fill) -> None:
        """Gradients the parameters hold but no hook announced in this pass (kept from ``no_sync``
        steps, set by hand, or zeros left by ``zero_grad(set_to_none=False)``) join the bucket,
        each checked (which may raise) before any is taken. An average an earlier reduce handed
        out is not reduced again: it is set aside and given back after the flush."""
        members = self.bucket_index.members[b]
        held = []
        for slot in fill.empty_slots():
            index = members[slot]
            if not self._held.set_aside_if_average(index) and self.params[index].grad is not None:
                held.append(slot)
        for slot in held:
            self._check_unannounced(members[slot])
        for slot in held:
            fill.add(slot, self._take(members[slot]), self._scale)
            self._held.joins_reduce(members[slot])

    def _check_unannounced(self, index: int) -> None:
        self._checks.check(index, cast(torch.Tensor, self.params[index].grad))
        if self._graph.is_fixed and self._pass.is_backward:
            self._graph.check_held(index)

    def _flush(self, after_backward: bool, shadow: bool = False) -> None:
        """End of backward: launch what is left, reduce late gradients, hand out the results.
        Only a real backward (``after_backward``) can have late gradients or teach the order;
        an explicit ``reduce()`` skips the agreement on late gradients, since no hook fired.
        Once ``static_graph`` has fixed the graph, a backward checks its arrival counts instead
        (before the flush launches anything, so ranks that all see the change all raise alike)
        and hands out the learned set of used gradients. A ``shadow`` pass (a joined rank's, no
        arrivals) skips that check and keeps the arrivals it expects for its own backward."""
        bw = self._pass
        bw.flushed_at = time.perf_counter()
        fixed = after_backward and self._graph.is_fixed
        if fixed and not shadow:
            self._graph.check_arrivals(bw.arrivals)
        handed_out: list[int] = []
        with torch.profiler.record_function("sharded::flush_pending_reduces"):
            for index in bw.partial:  # fewer arrivals than last time: what came is complete
                b, slot = self.bucket_index.location[index]
                self._fill(b).add(slot, self._take(index), self._scale)
            for b in range(bw.next_launch, len(self.buckets)):
                self._launch(b)
            if after_backward and not fixed:
                self._send_corrections()
            for sent in bw.wait_all():
                handed_out += self._hand_out(sent.fill, sent.is_correction, fixed)
        self._held.after_flush(handed_out)
        self.phase = Phase.IDLE
        if after_backward:
            self._learn_from(bw, agreed=not fixed, arrivals=self._graph.expected if shadow else bw.arrivals)
        if self._lowbit is not None:
            self._lowbit.end_step()

    def _send_corrections(self) -> None:
        """Reduce again the buckets some rank's late gradients need (after agreeing which)."""
        bw = self._pass
        for fill in self._late.corrections(self.bucket_index, self.group):
            self._graph.note_sent(self._written(fill))
            bw.hold(fill.nbytes)
            bw.late_reduces += 1
            bw.send(fill, self.group, is_correction=True, lowbit=self._lowbit)

    def _hand_out(self, fill: Fill, is_correction: bool, fixed: bool) -> list[int]:
        """On the owner: the reduced results become the parameters' gradients (with the graph
        ``fixed``, the learned set of used ones). Returns their indices."""
        members = self.bucket_index.members[fill.index]
        used = self._graph.used_slots(members) if fixed else None
        return [members[slot] for slot in fill.hand_out(is_correction, used)]

    def _learn_from(self, bw: Pass, agreed: bool, arrivals: Sequence[int]) -> None:
        """Report the pass; re-plan once by its order; learn its arrivals (and, with
        ``static_graph``, fix the graph after the first)."""
        self.last_backward = BackwardStats.of(bw, self.buckets, self._armed_at, agreed)
        if not self.bucket_index.from_observed_order:
            self.bucket_index.replan_from(bw.completed_at, self.group)
            if self._lowbit is not None:
                self._lowbit.keep_only(self.buckets)  # residuals of buckets the new plan lacks
        self._graph.learn(arrivals, self.group)


def _remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()
