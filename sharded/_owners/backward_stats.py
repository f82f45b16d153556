"""How the reduction of a finished backward went: statistics read from its :class:`Pass`.

``ShardedDataParallel.backward_stats`` shows the last one; the benchmarks and the overlap tests
read it. Computed once per synced backward, from bookkeeping the pass keeps anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .reduce_pass import Pass
from .reduce_plan import ReduceBucket

__all__ = ["BackwardStats"]


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

    @classmethod
    def of(cls, bw: Pass, buckets: Sequence[ReduceBucket], armed_at: float, agreed: bool) -> BackwardStats:
        """The statistics of the finished pass ``bw`` over ``buckets`` (the plan it ran);
        ``armed_at``: when the backward reached the module's outputs."""
        return cls(
            buckets=len(buckets),
            launched_during_backward=sum(1 for clock in bw.launch_clocks if clock < bw.clock),
            late_reduces=bw.late_reduces,
            peak_bucket_bytes=bw.peak_bytes,
            overlap=_overlap_share(bw, armed_at),
            overlap_bytes=_overlap_bytes_share(bw, buckets),
            agreed_on_late_gradients=agreed,
        )


def _overlap_share(bw: Pass, armed_at: float) -> float:
    started = min(armed_at, bw.started_at)
    if bw.first_launch_at is None or bw.flushed_at <= started:
        return 0.0
    return (bw.flushed_at - bw.first_launch_at) / (bw.flushed_at - started)


def _overlap_bytes_share(bw: Pass, buckets: Sequence[ReduceBucket]) -> float:
    """Gradient bytes weighted by the share of the backward's gradients still to come when their
    bucket left (see ``BackwardStats.overlap_bytes``)."""
    sizes = [bucket.grad_nbytes for bucket in buckets]
    total = sum(sizes)
    if not total or not bw.clock:
        return 0.0
    # Hooks launch buckets in plan order, so launch_clocks[b] belongs to bucket b; the buckets
    # after them left at the flush and count nothing.
    hidden = sum(size * (bw.clock - clock) for size, clock in zip(sizes, bw.launch_clocks))
    return hidden / (total * bw.clock)

