"""Run a test body on N real ranks: one OS process per rank, gloo, a FileStore rendezvous.

Each rank's device and backend come from tests/_device.py (``SHARDED_TEST_DEVICE``; on the CPU,
gloo at every world size). Ranks are forked from a forkserver that has torch, DDP and sharded preloaded, so a launch costs
a fraction of a second instead of the seconds a fresh interpreter + ``import torch`` costs per
rank (see ../shared/TESTING.md). Every rank gets a fresh process and a fresh process group, so
state never leaks between tests and a failed collective can't poison the next one.

Failures come back with every failing rank's traceback, the root cause first (a rank that died
of "connection reset" is usually reacting to another rank's error). A hang fails the test at its
deadline, naming the ranks that never finished; the parent kills them, so nothing is orphaned.

A rank that reported success must also exit cleanly, with one exception: gloo's known abort at
exit (SIGABRT, "terminate called without an active exception"; plain torch DDP has it too).
When every rank's body returned and a rank then died of SIGABRT while tearing down, the whole
launch is retried once, with a warning saying so; a second such abort, an abort inside a body,
or any other death fails the test. :func:`run_job` does the same for a job started as a
subprocess (torchrun, Lightning's launcher): one retry when the job failed only by that abort.

The other retry is for torch's rare crash on a gloo worker thread (docs/guides/known-issues.md:
it happens with torch's own ``fully_shard`` in a process that never imports sharded). A launch is
retried once, with a :class:`GlooThreadCrashRetried` warning, when a rank died of SIGABRT with
glibc's heap-corruption message, or of SIGSEGV with no Python thread named as the faulting one,
and every other rank either finished or failed only because that peer was gone. Each rank's
stderr goes to a file the parent reads (and echoes) to tell those deaths apart; a buffer that
sharded frees under a collective dies the same way, which tests/test_no_work_left.py checks in
program order instead.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from tests import _device

__all__ = ["AbortAtExitRetried", "GlooThreadCrashRetried", "RankFailure", "run_on_ranks", "run_job", "assert_same_on_all_ranks"]

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
GRACE_AFTER_FIRST_ERROR = 3.0  # seconds the other ranks get to report their own errors
TEARDOWN_SECONDS = 30.0  # for ranks that reported success to leave the barrier and exit
ABORTED = -signal.SIGABRT  # a process's exitcode when SIGABRT killed it
TEARDOWN_FAILED = 3  # a rank's exit code when its teardown raised (a peer died in the barrier)
# torch.distributed.optim (torch's ZeroRedundancyOptimizer, which sharded's derives from) scripts its
# functional optimizers on import: 2-9 s per rank, paid once here instead of at every launch.
_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch.optim", "torch.distributed.optim", "sharded",
            "tests._device", "tests._harness"]
ABORT_AT_EXIT = "terminate called without an active exception"  # what libstdc++ prints before it
SEGFAULT = -signal.SIGSEGV
HEAP_CORRUPTION = ("malloc(): ", "free(): ", "double free", "corrupted size", "corrupted double-linked",
                   "malloc_consolidate(): ", "unaligned tcache chunk")  # glibc's messages before it aborts
_SECONDARY_ERRORS = ("Connection reset", "Connection closed", "Broken pipe", "Socket closed")
_context = None


class RankFailure(AssertionError):
    """One or more ranks raised, died or hung; the message holds every rank's story."""


class AbortAtExitRetried(UserWarning):
    """A launch was retried because a rank died of SIGABRT after its body returned."""


class GlooThreadCrashRetried(UserWarning):
    """A launch was retried because a rank died of torch's crash on a gloo worker thread."""


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0, grace: float = GRACE_AFTER_FIRST_ERROR,
    **kwargs: Any
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh rank processes.

    Each rank has the default process group initialised (the backend of
    :func:`tests._device.backend_for`: gloo on the CPU; 60 s collective timeout), on CUDA its
    device set, ``torch.set_num_threads(1)`` and ``torch.manual_seed(0)``. Returns the per-rank return
    values in rank order. Raises :class:`RankFailure` if any rank raises, dies, is still
    running after ``timeout`` seconds (or ``grace`` seconds after another rank failed: a test
    whose ranks each detect a failed peer within a process group's timeout passes more than
    that), or fails to exit cleanly after reporting success. A
    launch whose only fault is a rank killed by SIGABRT after its body returned (gloo's abort at
    exit) is retried once, with an :class:`AbortAtExitRetried` warning and a line on stderr.
    """
    launch = _launch(fn, world_size, args, kwargs, timeout, grace)
    if launch.aborted_at_exit():
        why = f"{launch.teardown_story()}; gloo's known abort at exit ('terminate called without an active exception')"
        _report_retry(fn, launch, why, AbortAtExitRetried)
        retry = _launch(fn, world_size, args, kwargs, timeout, grace)
        if retry.aborted_at_exit():
            raise RankFailure(f"{retry.teardown_story()}\nthe first launch ended the same way; retried once only")
        return retry.results()
    crashed = launch.crashed_on_a_gloo_thread()
    if crashed is None:
        return launch.results()
    why = f"rank {crashed} {launch.outcomes[crashed][1]}, on a gloo worker thread (torch's rare crash, docs/guides/known-issues.md)"
    _report_retry(fn, launch, why, GlooThreadCrashRetried)
    retry = _launch(fn, world_size, args, kwargs, timeout, grace)
    if retry.crashed_on_a_gloo_thread() is not None:
        failures = {r: o for r, o in retry.outcomes.items() if o[0] != "ok"}
        raise RankFailure(f"{_describe(failures, retry.outcomes, world_size, timeout)}\n"
                          "the first launch ended the same way; retried once only")
    return retry.results()


def run_job(command: list[str], cwd: Path, writes: Optional[Path] = None, timeout: float = 300.0
            ) -> subprocess.CompletedProcess:
    """Run a multi-process job (``command``, its output captured) and return it once it exits 0.

    Raises ``AssertionError`` with the output's tail otherwise. A job that failed only by gloo's
    abort at exit is run once more, with an :class:`AbortAtExitRetried` warning, after the folder
    it ``writes`` is put back as it was (a checkpoint the first run saved would change what a
    second one does): its output holds the abort's message and no Python traceback from the
    job's own code under ``cwd`` (a rank that raised always shows one; the launcher's own
    traceback lies under the environment).
    """
    with tempfile.TemporaryDirectory(prefix="sharded-job-") as saved:
        if writes is not None and writes.exists():
            shutil.copytree(writes, Path(saved) / "before")
        done = _run_once(command, cwd, timeout)
        if done.returncode != 0 and _aborted_at_exit_only(done, cwd):
            script = next((Path(part).name for part in command if part.endswith(".py")), command[0])
            message = (f"{script}: {ABORT_AT_EXIT!r} and no traceback from the job's own code; gloo's "
                       "known abort at exit, running the job once more")
            print(message, file=sys.stderr, flush=True)
            warnings.warn(message, AbortAtExitRetried, stacklevel=2)
            if writes is not None:
                shutil.rmtree(writes, ignore_errors=True)
                if (Path(saved) / "before").exists():
                    shutil.copytree(Path(saved) / "before", writes)
            done = _run_once(command, cwd, timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _run_once(command: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _aborted_at_exit_only(done: subprocess.CompletedProcess, cwd: Path) -> bool:
    output = done.stdout + done.stderr
    own_code = [f'File "{cwd / folder}' for folder in ("examples", "sharded", "tests")]
    return ABORT_AT_EXIT in output and not any(frame in output for frame in own_code)


@dataclass
class _Launch:
    """What one launch's ranks reported, and how those that reported success then exited."""

    world_size: int
    timeout: float
    outcomes: dict[int, tuple]
    exitcodes: dict[int, Optional[int]]  # None: still tearing down at the deadline, killed
    stderr: dict[int, str]  # what each rank wrote to its standard error
    died: dict[int, Optional[int]]  # the exit code of each rank that died before reporting

    def bodies_returned(self) -> bool:
        return len(self.outcomes) == self.world_size and all(o[0] == "ok" for o in self.outcomes.values())

    def aborted_at_exit(self) -> bool:
        """Every body returned, then some rank died of SIGABRT and the others exited cleanly
        or saw their teardown fail because of it: gloo's abort at exit, and nothing else."""
        codes = list(self.exitcodes.values())
        return (
            self.bodies_returned()
            and ABORTED in codes
            and all(code in (0, ABORTED, TEARDOWN_FAILED) for code in codes)
        )

    def crashed_on_a_gloo_thread(self) -> Optional[int]:
        """The rank that died of torch's crash on a gloo worker thread, if that is all that went
        wrong: SIGABRT after one of glibc's heap-corruption messages, or SIGSEGV with Python's
        fault handler naming no thread as the faulting one; every other rank reported success or
        an error that only says a peer went away."""
        crashed = [rank for rank in self.died if self._gloo_thread_death(rank)]
        others = [o for r, o in self.outcomes.items() if o[0] != "ok" and r not in crashed]
        if len(crashed) != 1 or len(self.outcomes) < self.world_size:
            return None
        return crashed[0] if all(any(m in o[1] for m in _SECONDARY_ERRORS) for o in others) else None

    def _gloo_thread_death(self, rank: int) -> bool:
        text = self.stderr.get(rank, "")
        if self.died[rank] == ABORTED:
            return any(message in text for message in HEAP_CORRUPTION)
        if self.died[rank] == SEGFAULT:
            return "Fatal Python error: Segmentation fault" in text and "Current thread" not in text
        return False

    def results(self) -> list[Any]:
        """Every rank's return value; raise :class:`RankFailure` unless all ran and exited cleanly."""
        failures = {r: o for r, o in self.outcomes.items() if o[0] != "ok"}
        if failures or len(self.outcomes) < self.world_size:
            raise RankFailure(_describe(failures, self.outcomes, self.world_size, self.timeout))
        if any(code != 0 for code in self.exitcodes.values()):
            raise RankFailure(self.teardown_story())
        return [self.outcomes[r][1] for r in range(self.world_size)]

    def teardown_story(self) -> str:
        return "\n".join(
            f"rank {rank} reported success, then {_exit_story(code)}"
            for rank, code in sorted(self.exitcodes.items())
            if code != 0
        )


def _exit_story(code: Optional[int]) -> str:
    if code is None:
        return f"was still tearing down after {TEARDOWN_SECONDS:.0f} s and was killed"
    if code == ABORTED:
        return "died of SIGABRT (exit code -6) after its body returned, in teardown or at exit"
    if code == TEARDOWN_FAILED:
        return "its teardown (barrier, destroy_process_group) raised"
    if code < 0:
        return f"died of {signal.Signals(-code).name} (exit code {code}) after its body returned"
    return f"exited with code {code} after its body returned"


def _launch(fn, world_size, args, kwargs, timeout, grace) -> _Launch:
    device_type = _device.device_type_under_test()
    ctx = _forkserver()
    store_path = tempfile.mktemp(prefix="sharded-store-")
    pipes, procs = [], []
    stderr_paths = [tempfile.mktemp(prefix=f"sharded-rank{rank}-stderr-") for rank in range(world_size)]
    for rank in range(world_size):
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_rank_main, args=(rank, world_size, device_type, fn, args, kwargs, store_path, sender, stderr_paths[rank]),
            daemon=True,
        )
        proc.start()
        sender.close()
        pipes.append(receiver)
        procs.append(proc)
    outcomes: dict[int, tuple] = {}
    try:
        outcomes = _collect(pipes, procs, timeout, grace)
    finally:
        all_ok = len(outcomes) == world_size and all(o[0] == "ok" for o in outcomes.values())
        exitcodes = _reap(procs, teardown_seconds=TEARDOWN_SECONDS if all_ok else 0.0)
        if os.path.exists(store_path):
            os.remove(store_path)
        stderr = {rank: _take_stderr(path) for rank, path in enumerate(stderr_paths)}
    died = {rank: procs[rank].exitcode for rank, outcome in outcomes.items() if outcome[0] == "died"}
    return _Launch(world_size, timeout, outcomes, exitcodes if all_ok else {}, stderr, died)


def _take_stderr(path: str) -> str:
    """A rank's standard error, echoed to ours (where pytest shows it) and its file removed."""
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        data = f.read()
    os.remove(path)
    if data:
        sys.stderr.flush()
        os.write(2, data)
    return data.decode(errors="replace")


def _report_retry(fn, launch: _Launch, why: str, category: type[Warning]) -> None:
    """Say, where a CI log shows it (stderr and pytest's warnings summary), that a launch is retried."""
    message = f"run_on_ranks({getattr(fn, '__qualname__', fn)}, world {launch.world_size}): {why}, retrying the launch once"
    print(message, file=sys.stderr, flush=True)
    warnings.warn(message, category, stacklevel=3)


def assert_same_on_all_ranks(tensors: list[torch.Tensor], what: str) -> None:
    """Collective: raise unless every rank's ``tensors`` equal rank 0's bit for bit."""
    world, device = dist.get_world_size(), _device.collective_device()
    for index, tensor in enumerate(tensors):
        mine = tensor.detach().reshape(-1).to(device, torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        differing = [r for r in range(world) if not torch.equal(gathered[r], gathered[0])]
        if differing:
            raise AssertionError(f"{what}: tensor {index} differs between rank 0 and ranks {differing}")


# ----------------------------------------------------------------------------- rank side


def _rank_main(rank, world_size, device_type, fn, args, kwargs, store_path, sender, stderr_path) -> None:
    _stderr_to(stderr_path)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    try:
        _device.enter_rank(device_type)
        backend = _device.backend_for(world_size, device_type)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        if device_type == "cuda" and backend == "gloo":
            _device.install_gloo_cuda_guard()
    except BaseException:
        sender.send(("error", f"starting the rank ({device_type}):\n{traceback.format_exc()}", time.time()))
        sender.close()
        os._exit(1)
    try:
        value = _run_body(fn, rank, world_size, args, kwargs)
    except BaseException:
        sender.send(("error", traceback.format_exc(), time.time()))
        sender.close()
        os._exit(1)  # the group may be poisoned: no teardown collectives
    sender.send(("ok", value, time.time()))
    sender.close()
    try:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        os._exit(TEARDOWN_FAILED)


def _stderr_to(path: str) -> None:
    """Send this rank's standard error (Python's, C++'s, glibc's) to ``path``, for the parent to
    read, with Python's fault handler on so that a fatal signal says which thread it hit."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(all_threads=True)


def _run_body(fn, rank, world_size, args, kwargs):
    """``fn`` on this rank; with ``SHARDED_TEST_TRACK_WORK`` set, under
    :class:`tests._work_tracking.TrackWork`, failing if a storage was let go of in flight."""
    if not os.environ.get("SHARDED_TEST_TRACK_WORK"):
        return fn(rank, world_size, *args, **kwargs)
    from tests._work_tracking import TrackWork

    with TrackWork() as track:
        value = fn(rank, world_size, *args, **kwargs)
    track.assert_nothing_released(f"the end of {getattr(fn, '__qualname__', fn)} on rank {rank}")
    return value


# ---------------------------------------------------------------------------- parent side


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _collect(pipes, procs, timeout, grace) -> dict[int, tuple]:
    """Outcomes per rank until all reported, the deadline, or a grace period after an error."""
    deadline = time.monotonic() + timeout
    outcomes: dict[int, tuple] = {}
    waiting = {pipe: rank for rank, pipe in enumerate(pipes)}
    while waiting:
        if any(o[0] != "ok" for o in outcomes.values()):
            deadline = min(deadline, time.monotonic() + grace)
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


def _reap(procs, teardown_seconds: float) -> dict[int, Optional[int]]:
    """Give ranks ``teardown_seconds`` to exit, then kill what is left. Returns each rank's exit
    code, ``None`` for the ranks killed here."""
    end = time.monotonic() + teardown_seconds
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    exitcodes: dict[int, Optional[int]] = {}
    for rank, proc in enumerate(procs):
        exitcodes[rank] = proc.exitcode
        if proc.is_alive():
            proc.kill()
            proc.join()
    return exitcodes


def _describe(failures, outcomes, world_size, timeout) -> str:
    def root_cause_first(item):
        rank, (_, text, when) = item
        return (any(marker in text for marker in _SECONDARY_ERRORS), when)

    parts = [f"rank {rank} {kind}:\n{text}" for rank, (kind, text, _) in sorted(failures.items(), key=root_cause_first)]
    silent = [r for r in range(world_size) if r not in outcomes]
    if silent:
        parts.append(f"ranks {silent} were still running after {timeout:.0f} s (hang or too slow) and were killed")
    return "\n".join(parts)
