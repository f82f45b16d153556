"""The most data a process has held since a starting point, on Linux, from /proc/self/status.

The peak is the rise of the resident set's high-water mark (VmHWM) over the resident set at the
start, less the rise of the file-backed resident pages (RssFile): the pages of torch's libraries
a step runs for the first time count into VmHWM, and how many a process maps first varies with
the machine and the process (50-60 MiB more in a fresh clone's venv, whose libraries were just
written to disk; 10 MiB more in a forked process than a fresh one). File pages are not given back
during a run, so their rise at the end is their rise at the peak. What remains is the data a step
holds, what ``RLIMIT_DATA`` limits and what ``sharded.estimate_memory`` estimates.

It follows live tensors only when the process started with ``MALLOC_MMAP_THRESHOLD_=65536``:
glibc then maps every block of 64 KiB or more and gives it back on free; with its default
threshold freed tensors stay in the heap and the high-water mark keeps them.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

__all__ = ["DataPeak", "status_kib"]


def status_kib() -> dict[str, int]:
    """The ``Vm*`` and ``Rss*`` lines of /proc/self/status, in KiB."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError as e:
        raise RuntimeError(f"peak memory is measured from /proc/self/status, on Linux only: {e}") from None
    return {key: int(value) for key, value in re.findall(r"((?:Vm|Rss)\w+):\s+(\d+) kB", text)}


class DataPeak:
    """Measures the data peak from its creation or the last :meth:`reset` (bytes)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start from here: collect garbage, then set VmHWM to the current resident set."""
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")
        self.start = status_kib()

    def rise(self) -> int:
        """VmHWM's rise since the start, less RssFile's."""
        now = status_kib()
        return (now["VmHWM"] - self.start["VmRSS"] - (now["RssFile"] - self.start["RssFile"])) * 1024
