"""The job's own mount namespace, so that it sees a /proc of its own PID namespace, and how CRIU carries it.

The job starts in new PID and mount namespaces with a fresh /proc (runner.start_job): `/proc/self`
and `/proc/<getpid()>` are the job itself, which MPI's shared-memory transport and psutil need.
CRIU then dumps that mount namespace. Every mount in it but the root and /proc is the VM's own
(its system, its /tmp, /var/lib/spotcr, the job's storage): the dump names each one external by its
mount point, and the restore binds the same path of the VM it restores on, so the job finds that
VM's files, never the old VM's. /proc mounts are not external: CRIU mounts them afresh in the
restored PID namespace. The root is the restoring VM's (`--root /`).

A job may make mount namespaces of its own (`unshare --mount`, MPI launchers, sandboxes). CRIU can name
external mounts only in the job's first one; a mount of a nested one is restored as a bind of the external
mount (or of the root) of the same file system, at the same place in it. So every mount of every namespace
of the job must be either a view of a file system the VM has (restored from the restoring VM's) or one CRIU
carries itself (proc, sysfs, tmpfs, ...); anything else (a disk the job mounted) is refused before the dump.
What a process of a nested namespace holds is named by the VM's path of the same file (`vm_path`).

A mount the job's VM had and a backup lacks (one made by the instance's own boot script, which backups do not
run) cannot be bound on restore: the checkpoint records the job's mount points, and the restore names what is
missing (restore.MissingMount) before CRIU would fail on it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = "/"
# File systems whose mounts CRIU makes afresh or dumps with their contents (criu/filesystems.c).
CARRIED_FSTYPES = frozenset({"proc", "sysfs", "tmpfs", "devpts", "mqueue", "binfmt_misc", "cgroup", "cgroup2"})


@dataclass(frozen=True)
class Mount:
    device: str  # major:minor of the file system
    root: str  # the directory of that file system mounted here
    point: str
    fstype: str


def mounts(mountinfo: str) -> list[Mount]:
    """Each line of a /proc/<pid>/mountinfo."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype = line.split(" - ", 1)[1].split()[0]
        found.append(Mount(fields[2], unescape(fields[3]), unescape(fields[4]), fstype))
    return found


def _under(path: str, top: str) -> str | None:
    """path relative to top ('' for top itself), or None when path is not under top."""
    if top in (ROOT, path):
        return path.removeprefix(top).lstrip("/") if top != ROOT else path.lstrip("/")
    return path[len(top) + 1 :] if path.startswith(top + "/") else None


def _containing(path: str, table: Iterable[Mount]) -> Mount | None:
    """The mount a path is on: the last one mounted at its deepest mount point."""
    best: Mount | None = None
    for mount in table:
        if _under(path, mount.point) is not None and (best is None or len(mount.point) >= len(best.point)):
            best = mount
    return best


def _vm_view(mount: Mount, relative: str, vm: Iterable[Mount]) -> str | None:
    """Where the VM sees `relative` under `mount` (a mount of the job's namespace), or None when it does not."""
    inside = os.path.join(mount.root, relative) if relative else mount.root
    best: Mount | None = None
    for candidate in vm:
        under = candidate.device == mount.device and _under(inside, candidate.root) is not None
        if under and (best is None or len(candidate.root) > len(best.root)):
            best = candidate
    if best is None:
        return None
    rest = _under(inside, best.root) or ""
    return os.path.join(best.point, rest) if rest else best.point


def _namespaces(tree: Iterable[int]) -> dict[str, int]:
    """Each mount namespace of the job, with one process in it."""
    found: dict[str, int] = {}
    for member in tree:
        try:
            found.setdefault(os.readlink(f"/proc/{member}/ns/mnt"), member)
        except OSError:
            continue
    return found


def layout_problem(tree: list[int]) -> str | None:
    """Why a mount of the job's namespaces could not be restored on another VM; None when each can."""
    vm = mounts(Path("/proc/self/mountinfo").read_text())
    for member in _namespaces(tree).values():
        try:
            table = mounts(Path(f"/proc/{member}/mountinfo").read_text())
        except OSError:
            continue  # the process is gone: CRIU itself says so, in its own words
        for mount in table:
            if mount.point == ROOT or mount.fstype in CARRIED_FSTYPES or _vm_view(mount, "", vm) is not None:
                continue
            return (
                f"the job mounted {mount.fstype} {mount.root} at {mount.point} (process {member}), a file system "
                "this VM does not have: a restore on another VM cannot mount it again; put the job's data on its "
                "storage or in its work dir, and mount only those (bind mounts of them are carried)"
            )
    return None


def vm_path(pid: int) -> Callable[[str], str]:
    """Names a path that process `pid` sees (in a mount namespace of its own) by the VM's path of the same file."""
    try:
        table = mounts(Path(f"/proc/{pid}/mountinfo").read_text())
        vm = mounts(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return lambda path: path

    def translate(path: str) -> str:
        if not path.startswith("/"):
            return path
        plain = path.removesuffix(" (deleted)")
        mount = _containing(plain, table)
        seen = _vm_view(mount, _under(plain, mount.point) or "", vm) if mount is not None else None
        return path if seen is None else seen + path[len(plain) :]

    return translate


def unescape(field: str) -> str:
    """A path as /proc/<pid>/mountinfo and /proc/<pid>/mounts write it: space, tab, newline and backslash as
    3-digit octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_points(mountinfo: str) -> list[tuple[str, str]]:
    """(mount point, file system type) of each line of a /proc/<pid>/mountinfo."""
    points = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype = line.split(" - ", 1)[1].split()[0]
        points.append((unescape(fields[4]), fstype))
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


def workdir_mount_points(tree: list[int], workdir: str) -> list[str]:
    """Mount points of the job's own mount namespaces inside its work dir, relative to it: the directories a restore
    must find there (a copy of the work dir carries only files)."""
    found = set()
    for member in _namespaces(tree).values():
        try:
            table = mounts(Path(f"/proc/{member}/mountinfo").read_text())
        except OSError:
            continue
        named = vm_path(member)
        for mount in table:
            if mount.point == ROOT:
                continue
            parent, name = os.path.split(mount.point)
            relative = _under(os.path.join(named(parent), name), workdir)
            if relative:
                found.add(relative)
    return sorted(found)
