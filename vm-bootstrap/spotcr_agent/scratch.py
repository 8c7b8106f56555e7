"""Room for a dump on local scratch: checked before CRIU freezes the job, so a dump never fails half-written.

CRIU writes the job's anonymous memory uncompressed (resident, shared-anonymous and swapped pages of
every process in the job's tree), and a periodic dump also copies the work dir there. The estimate
counts those from /proc with a margin; a dump that would not fit is refused with both figures.

When free memory can hold the dump, it goes to a tmpfs the agent mounts for it, sized to the estimate:
the job is then frozen only as long as CRIU takes to write to memory, whatever the disk, and the store
reads the images from memory after the job runs again. Otherwise the dump goes to the scratch dir.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

MARGIN = 1.10  # CRIU's page-map and metadata images, and pages dirtied between the check and the freeze
OVERHEAD_BYTES = 64 << 20  # logs, the post-dump script, small images
GIB = 1 << 30
MEMORY_RESERVE_SHARE = 0.10  # of the VM's memory, left free beside a memory scratch: the job runs on meanwhile
MEMORY_RESERVE_MIN = 512 << 20
TMPFS_MAGIC = 0x01021994
# The memory scratch in large pages, where they lie within each image file (small files stay in 4 KiB pages): Linux
# 6.18 here took folios of 8 KiB to 512 KiB as CRIU wrote (its hugepages-*/stats/shmem_alloc), a few of 2 MiB;
# Debian 12's 6.1 has only 2 MiB ones for tmpfs (not measured here). A 2 GiB job here (transparent huge pages
# "madvise", shmem "never"), twice: CRIU's dump 0.68 and 0.69 s against 1.20 and 0.94 s in 4 KiB pages; the store's
# read of its pages (mapped, XXH3 of each MiB) 0.28 s against 0.42-0.48 s; removing them 0.016 s against 0.18 s.
# huge=always took CRIU 2.0-2.8 s. Where memory is fragmented the kernel falls back to small pages without waiting.
HUGE_PAGES = "huge=within_size"


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


def tree_memory(tree: list[int], proc: Path = Path("/proc")) -> int:
    """What CRIU writes for a process tree (job_tree): memory_bytes of each."""
    return sum(memory_bytes(member, proc) for member in tree)


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
    memory = tree_memory(job_tree(pid, proc), proc)
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


def memory_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{meminfo} has no MemAvailable")


def memory_room(
    pid: int,
    workdir: Path | None = None,
    *,
    estimate: Callable[[int, Path | None], int] = dump_estimate,
    available: Callable[[], int] = memory_available,
    total: Callable[[], int] = memory_total,
) -> int | None:
    """The size of a memory scratch for this dump, or None when free memory cannot hold it beside a reserve."""
    needed = estimate(pid, workdir)
    reserve = max(MEMORY_RESERVE_MIN, int(total() * MEMORY_RESERVE_SHARE))
    return needed if needed + reserve <= available() else None


def on_tmpfs(path: Path) -> bool:
    """Whether path is on a memory file system already (then it is the memory scratch itself)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    result = subprocess.run(["stat", "-f", "-c", "%t", str(path)], capture_output=True, text=True, check=False)
    return result.returncode == 0 and int(result.stdout.strip() or "0", 16) == TMPFS_MAGIC


@contextlib.contextmanager
def dump_scratch(
    disk: Path,
    memory: Path | None,
    pid: int,
    workdir: Path | None = None,
    *,
    gpu_bytes: int = 0,
    room: Callable[[int, Path | None], int | None] = memory_room,
) -> Iterator[tuple[Path, str]]:
    """Where this dump's images go, checked before the freeze: ("memory") a tmpfs mounted at `memory` and sized
    to fit, removed afterwards (CRIU's logs are copied to `disk` first when the dump failed); or ("disk") the
    scratch dir, refused with the figures when the dump would not fit there either. A GPU job's images go to disk:
    the CUDA plugin already copies its device memory into host memory."""
    size = room(pid, workdir) if memory is not None and not gpu_bytes and not on_tmpfs(disk) else None
    if memory is None or size is None or not _mount_tmpfs(memory, size):
        require_room(disk, pid, workdir, gpu_bytes=gpu_bytes)
        yield disk, "memory" if on_tmpfs(disk) else "disk"
        return
    try:
        yield memory, "memory"
    except BaseException:
        for logs in memory.glob("*/logs"):
            shutil.copytree(logs, disk / logs.parent.name / "logs", dirs_exist_ok=True)
        raise
    finally:
        subprocess.run(["umount", str(memory)], capture_output=True, check=False)


def _mount_tmpfs(path: Path, size: int) -> bool:
    """Mount the memory scratch, in large pages where the kernel has them (HUGE_PAGES), else in small ones."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["umount", str(path)], capture_output=True, check=False)  # a mount a killed agent left
    result = None
    for options in (f"size={size},mode=0700,{HUGE_PAGES}", f"size={size},mode=0700"):
        argv = ["mount", "-t", "tmpfs", "-o", options, "spotcr-scratch", str(path)]
        result = subprocess.run(argv, capture_output=True, text=True, check=False)
        if result.returncode == 0:
            return True
    log.warning("no memory scratch (%s); the dump goes to the scratch dir", result.stderr.strip() if result else "")
    return False
