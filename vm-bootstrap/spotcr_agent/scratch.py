"""Room for a dump on local scratch: checked before CRIU freezes the job, so a dump never fails half-written.

CRIU writes the job's anonymous memory uncompressed (resident, shared-anonymous and swapped pages of
every process in the job's tree), and a periodic dump also copies the work dir there. The estimate
counts those from /proc with a margin; a dump that would not fit is refused with both figures.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

MARGIN = 1.10  # CRIU's page-map and metadata images, and pages dirtied between the check and the freeze
OVERHEAD_BYTES = 64 << 20  # logs, the post-dump script, small images
GIB = 1 << 30


class ScratchTooSmall(RuntimeError):
    """The dump would not fit on local scratch."""


def job_tree(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The job's process and its descendants (each thread's children included)."""
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        for task in (proc / str(current) / "task").glob("*/children"):
            try:
                pending += [int(child) for child in task.read_text().split()]
            except OSError:
                continue  # the thread or process ended meanwhile
    return tree


def memory_bytes(pid: int, proc: Path = Path("/proc")) -> int:
    """What CRIU writes for one process: its anonymous resident, shared-anonymous and swapped pages."""
    fields = {"RssAnon:", "RssShmem:", "VmSwap:"}
    total = 0
    try:
        lines = (proc / str(pid) / "status").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] in fields:
            total += int(parts[1]) * 1024  # the kernel reports these in kB
    return total


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def dump_estimate(pid: int, workdir: Path | None = None, proc: Path = Path("/proc")) -> int:
    memory = sum(memory_bytes(member, proc) for member in job_tree(pid, proc))
    files = tree_bytes(workdir) if workdir is not None else 0
    return int((memory + files) * MARGIN) + OVERHEAD_BYTES


def free_bytes(path: Path) -> int:
    """Free space for an unprivileged-style write (root's reserve not counted) where `path` lives."""
    while not path.exists() and path != path.parent:
        path = path.parent
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def require_room(
    scratch_dir: Path,
    pid: int,
    workdir: Path | None = None,
    *,
    estimate: Callable[[int, Path | None], int] = dump_estimate,
    free: Callable[[Path], int] = free_bytes,
    gpu_bytes: int = 0,
) -> None:
    """gpu_bytes: the job's GPU device memory, which CRIU's CUDA plugin copies into host memory for the dump."""
    needed, available = estimate(pid, workdir) + int(gpu_bytes * MARGIN), free(scratch_dir)
    if needed > available:
        held = "the job's memory, GPU memory and work dir" if gpu_bytes else "the job's memory and work dir"
        raise ScratchTooSmall(
            f"not enough local scratch for the dump: it needs about {needed / GIB:.2f} GiB "
            f"({held}, with a margin) and {scratch_dir} has {available / GIB:.2f} GiB free; "
            "give job VMs a larger root volume (root_volume_gib) or point scratch_dir at a larger disk"
        )


def memory_total(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{meminfo} has no MemTotal")


def capacity_warning(scratch_dir: Path, *, memory: int | None = None, free: int | None = None) -> str | None:
    """At bootstrap: a job that grows to this instance's memory would not fit on scratch; None when it would."""
    memory = memory_total() if memory is None else memory
    free = free_bytes(scratch_dir) if free is None else free
    needed = int(memory * MARGIN) + OVERHEAD_BYTES
    if needed <= free:
        return None
    return (
        f"local scratch {scratch_dir} has {free / GIB:.1f} GiB free but this instance has {memory / GIB:.1f} GiB "
        f"of memory: a job using more than about {max(0, free - OVERHEAD_BYTES) / MARGIN / GIB:.1f} GiB cannot be "
        "checkpointed here (raise root_volume_gib)"
    )
