"""The job's own mount namespace, so that it sees a /proc of its own PID namespace, and how CRIU carries it.

The job starts in new PID and mount namespaces with a fresh /proc (runner.start_job): `/proc/self`
and `/proc/<getpid()>` are the job itself, which MPI's shared-memory transport and psutil need.
CRIU then dumps that mount namespace. Every mount in it but the root and /proc is the VM's own
(its system, its /tmp, /var/lib/spotcr, the job's storage): the dump names each one external by its
mount point, and the restore binds the same path of the VM it restores on, so the job finds that
VM's files, never the old VM's. /proc mounts are not external: CRIU mounts them afresh in the
restored PID namespace. The root is the restoring VM's (`--root /`).

A mount the job's VM had and a backup lacks (one made by the instance's own boot script, which backups do not
run) cannot be bound on restore: the checkpoint records the job's mount points, and the restore names what is
missing (restore.MissingMount) before CRIU would fail on it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

ROOT = "/"


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_points(mountinfo: str) -> list[tuple[str, str]]:
    """(mount point, file system type) of each line of a /proc/<pid>/mountinfo."""
    points = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype = line.split(" - ", 1)[1].split()[0]
        points.append((_unescape(fields[4]), fstype))
    return points


def _external(point: str) -> list[str]:
    if any(c in point for c in "[]:"):
        raise ValueError(f"mount point {point!r} cannot be named to CRIU (it holds '[', ']' or ':')")
    return ["--external", f"mnt[{point}]:{point}"]


def job_mounts(pid: int) -> list[str]:
    """The VM's mount points in the mount namespace of the job whose PID 1 has host PID `pid` (what a dump names
    external, so what a restore must find on its VM)."""
    try:
        points = mount_points(Path(f"/proc/{pid}/mountinfo").read_text())
    except OSError:
        return []  # the job is gone: CRIU itself says so, in its own words
    return sorted({point for point, fstype in points if point != ROOT and fstype != "proc"})


def dump_options(pid: int) -> list[str]:
    """`criu dump` options for the mount namespace of the job whose PID 1 has host PID `pid`."""
    return [arg for point in job_mounts(pid) for arg in _external(point)]


def missing_here(points: Iterable[str], mountinfo: str | None = None) -> list[str]:
    """The job's mount points that are no mount point of this VM (`mountinfo`: this process's by default)."""
    text = Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo
    here = {point for point, _ in mount_points(text)}
    return [point for point in points if point not in here]


def restore_options() -> list[str]:
    """`criu restore` options: every mount point of this VM may stand in for the job's mount of the same path."""
    points = mount_points(Path("/proc/self/mountinfo").read_text())
    usable = sorted({point for point, _ in points if point != ROOT and not any(c in point for c in "[]:")})
    return ["--root", ROOT, *(arg for point in usable for arg in _external(point))]
