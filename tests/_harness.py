"""Run a test body on N real ranks: one OS process per rank, gloo, a FileStore rendezvous.

Ranks are forked from a forkserver that has torch, DDP and sharded preloaded, so a launch costs
a fraction of a second instead of the seconds a fresh interpreter + ``import torch`` costs per
rank (see ../shared/TESTING.md). Every rank gets a fresh process and a fresh process group, so
state never leaks between tests and a failed collective can't poison the next one.

Failures come back with every failing rank's traceback, the root cause first (a rank that died
of "connection reset" is usually reacting to another rank's error). A hang fails the test at its
deadline, naming the ranks that never finished; the parent kills them, so nothing is orphaned.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["RankFailure", "run_on_ranks", "assert_same_on_all_ranks"]

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
GRACE_AFTER_FIRST_ERROR = 3.0  # seconds the other ranks get to report their own errors
_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch.optim", "sharded", "tests._harness"]
_SECONDARY_ERRORS = ("Connection reset", "Connection closed", "Broken pipe", "Socket closed")
_context = None


class RankFailure(AssertionError):
    """One or more ranks raised, died or hung; the message holds every rank's story."""


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh rank processes.

    Each rank has the default process group initialised (gloo, 60 s collective timeout),
    ``torch.set_num_threads(1)`` and ``torch.manual_seed(0)``. Returns the per-rank return
    values in rank order. Raises :class:`RankFailure` if any rank raises, dies, or is still
    running after ``timeout`` seconds.
    """
    ctx = _forkserver()
    store_path = tempfile.mktemp(prefix="sharded-store-")
    pipes, procs = [], []
    for rank in range(world_size):
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_rank_main, args=(rank, world_size, fn, args, kwargs, store_path, sender), daemon=True
        )
        proc.start()
        sender.close()
        pipes.append(receiver)
        procs.append(proc)
    outcomes: dict[int, tuple] = {}
    try:
        outcomes = _collect(pipes, procs, timeout)
    finally:
        all_ok = len(outcomes) == world_size and all(o[0] == "ok" for o in outcomes.values())
        _reap(procs, teardown_seconds=10.0 if all_ok else 0.0)
        if os.path.exists(store_path):
            os.remove(store_path)
    failures = {r: o for r, o in outcomes.items() if o[0] != "ok"}
    if failures or len(outcomes) < world_size:
        raise RankFailure(_describe(failures, outcomes, world_size, timeout))
    return [outcomes[r][1] for r in range(world_size)]


def assert_same_on_all_ranks(tensors: list[torch.Tensor], what: str) -> None:
    """Collective: raise unless every rank's ``tensors`` equal rank 0's bit for bit."""
    world = dist.get_world_size()
    for index, tensor in enumerate(tensors):
        mine = tensor.detach().reshape(-1).to(torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        differing = [r for r in range(world) if not torch.equal(gathered[r], gathered[0])]
        if differing:
            raise AssertionError(f"{what}: tensor {index} differs between rank 0 and ranks {differing}")


# ----------------------------------------------------------------------------- rank side


def _rank_main(rank, world_size, fn, args, kwargs, store_path, sender) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        value = fn(rank, world_size, *args, **kwargs)
    except BaseException:
        sender.send(("error", traceback.format_exc(), time.time()))
        sender.close()
        os._exit(1)  # the group may be poisoned: no teardown collectives
    sender.send(("ok", value, time.time()))
    sender.close()
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- parent side


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _collect(pipes, procs, timeout) -> dict[int, tuple]:
    """Outcomes per rank until all reported, the deadline, or a grace period after an error."""
    deadline = time.monotonic() + timeout
    outcomes: dict[int, tuple] = {}
    waiting = {pipe: rank for rank, pipe in enumerate(pipes)}
    while waiting:
        if any(o[0] != "ok" for o in outcomes.values()):
            deadline = min(deadline, time.monotonic() + GRACE_AFTER_FIRST_ERROR)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        sentinels = {procs[rank].sentinel: pipe for pipe, rank in waiting.items()}
        for ready in wait(list(waiting) + list(sentinels), timeout=remaining):
            pipe = sentinels.get(ready, ready)
            if pipe not in waiting:
                continue
            rank = waiting.pop(pipe)
            outcomes[rank] = _read(pipe, procs[rank])
    return outcomes


def _read(pipe, proc) -> tuple:
    try:
        if pipe.poll(1.0):
            return pipe.recv()
    except EOFError:
        pass
    proc.join(5)
    return ("died", f"exited with code {proc.exitcode} before reporting a result", time.time())


def _reap(procs, teardown_seconds: float) -> None:
    """Give successful ranks time to tear down, then kill what is left. A rank that reported
    success and then aborted in gloo teardown (a known rare crash) still counts as a success."""
    end = time.monotonic() + teardown_seconds
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _describe(failures, outcomes, world_size, timeout) -> str:
    def root_cause_first(item):
        rank, (_, text, when) = item
        return (any(marker in text for marker in _SECONDARY_ERRORS), when)

    parts = [f"rank {rank} {kind}:\n{text}" for rank, (kind, text, _) in sorted(failures.items(), key=root_cause_first)]
    silent = [r for r in range(world_size) if r not in outcomes]
    if silent:
        parts.append(f"ranks {silent} were still running after {timeout:.0f} s (hang or too slow) and were killed")
    return "\n".join(parts)
