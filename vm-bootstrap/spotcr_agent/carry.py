"""What a checkpoint carries besides CRIU's images and the work dir, and what it checks instead of carrying.

Every file the job holds open or mapped is in one of these places:
- the work dir: snapshotted at the freeze (checkpoint.py);
- the job's storage (EBS, EFS, FSx mount): it outlives the VM by itself;
- the image (the AMI's system: /usr and the like, and any other file the job only reads that has not changed
  since the VM booted): not carried, its identity is recorded and checked at restore;
- VM-local places (/tmp, /var/tmp, /dev/shm): carried whole, since a job also keeps closed files there
  (`sort` spills); any other file the job writes, or reads but that was made after boot, is carried alone.
A restore never replaces or removes a file that was there before it: a fresh VM has none of the carried ones.
Unlinked files travel inside CRIU's images (ghost files, link remaps). Kernel objects CRIU cannot dump, and SQLite
databases written in rollback-journal mode (which cannot be written again after a restore), are named before the dump.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import ipaddress
import os
import shutil
import socket
import stat
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import mounts

LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # noqa: S108 - the VM-local places a fresh VM has empty
IMAGE_DIRS = ("/usr", "/etc", "/opt", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/snap")
KERNEL_DIRS = ("/proc", "/sys", "/dev")  # CRIU restores these descriptors itself; /dev/shm is VM-local instead
SHM_DIR = "/dev/shm"  # noqa: S108 - a path the job uses, not one spotcr writes temp files to
RECORD = "carried.json"  # inside the checkpoint: what was carried and checked; old checkpoints have none
SAMPLE = 64 << 10  # bytes hashed at each end of an image file (ELF headers and build-id notes sit at the start)
SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file

# anon_inode kinds CRIU 4.1 dumps (criu/files.c, dump_one_file); any other one fails the dump.
DUMPABLE_ANON = ("[eventfd]", "[eventpoll]", "inotify", "[fanotify]", "[signalfd]", "[timerfd]", "[pidfd]")
REFUSED = "the job cannot be checkpointed: "  # how a dump refused up front begins (the rehearsal reads it too)
ROLLBACK_JOURNAL = "in rollback-journal mode"
WORKAROUNDS = {
    "[io_uring]": "Node.js: set UV_USE_IO_URING=0 in the job's environment; other programs: turn io_uring off",
    "[userfaultfd]": "turn off the program's userfaultfd use",
    "[perf_event]": "stop profiling (perf) inside the job",
}
# Character devices CRIU dumps: memory devices (/dev/null, /dev/zero, /dev/urandom), terminals, /dev/net/tun.
MEM_MAJOR, MISC_MAJOR, TUN_MINOR = 1, 10, 200
TTY_MAJORS = frozenset({4, 5, *range(136, 144)})
NVIDIA_MAJOR, DRI_MAJOR = 195, 226  # /dev/nvidia* (CRIU's CUDA plugin releases them before the dump), /dev/dri/*
TCP_ESTABLISHED, TCP_LISTEN = "01", "0A"
# The socket tables of the families and protocols CRIU 4.1 dumps (criu/sockets.c, sk-inet.c), with the column
# that holds the inode: a socket in none of them (vsock, SCTP, AF_ALG, ICMP ping, ...) fails the dump.
DUMPABLE_SOCKET_TABLES = {
    "unix": 6,
    "tcp": 9,
    "tcp6": 9,
    "udp": 9,
    "udp6": 9,
    "udplite": 9,
    "udplite6": 9,
    "raw": 9,
    "raw6": 9,
    "packet": 8,
    "netlink": 9,
}


class CarryError(RuntimeError):
    """The job holds something a checkpoint cannot carry; the message names it and what to do."""


@dataclass(frozen=True)
class Layout:
    """Where things live on this VM, which decides how each file the job holds is carried."""

    workdir: str
    storage: str = ""  # mount point of file-system storage; empty for S3
    local_dirs: tuple[str, ...] = LOCAL_DIRS
    image_dirs: tuple[str, ...] = IMAGE_DIRS
    excluded: tuple[str, ...] = ()  # the agent's own dirs (state, scratch): never carried

    def place(self, path: str, use: str = "write") -> str:  # noqa: PLR0911 - one return per place reads best
        """workdir | storage | excluded | local | kernel | image | other (written or made on this VM, elsewhere).

        use: how the job holds the file (JobScan.files): write, new (read, changed since boot) or read."""
        if _under(path, self.workdir):
            return "workdir"
        if self.storage and _under(path, self.storage):
            return "storage"
        if any(_under(path, d) for d in self.excluded):
            return "excluded"
        if any(_under(path, d) for d in self.local_dirs):
            return "local"
        if any(_under(path, d) for d in KERNEL_DIRS) and not _under(path, SHM_DIR):
            return "kernel"
        if any(_under(path, d) for d in self.image_dirs) or use == "read":
            return "image"
        return "other"

    def to_json(self) -> dict[str, Any]:
        return {
            "workdir": self.workdir,
            "storage": self.storage,
            "local_dirs": list(self.local_dirs),
            "image_dirs": list(self.image_dirs),
            "excluded": list(self.excluded),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Layout:
        return cls(
            workdir=data["workdir"],
            storage=data["storage"],
            local_dirs=tuple(data["local_dirs"]),
            image_dirs=tuple(data["image_dirs"]),
            excluded=tuple(data["excluded"]),
        )


def _under(path: str, directory: str) -> bool:
    directory = directory.rstrip("/") or "/"
    return path == directory or path.startswith(directory + "/") or directory == "/"


@dataclass
class JobScan:
    """What the job's processes hold: file paths (open or mapped), TCP endpoints, and what CRIU cannot dump."""

    # path -> write | new (only read, but changed since the VM booted: not the AMI's) | read
    files: dict[str, str] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)  # unlinked files: CRIU carries them in its images
    established: list[str] = field(default_factory=list)  # local addresses of established TCP connections
    listening: list[str] = field(default_factory=list)  # "address port" of listening TCP sockets
    # "local-address local-port remote-address remote-port" of each established TCP connection
    connections: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "deleted": self.deleted,
            "established": self.established,
            "listening": self.listening,
            "connections": self.connections,
            "unsupported": self.unsupported,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobScan:
        return cls(
            files=dict(data["files"]),
            deleted=list(data["deleted"]),
            established=list(data["established"]),
            listening=list(data["listening"]),
            connections=list(data.get("connections", [])),  # checkpoints before it was recorded have none
            unsupported=list(data["unsupported"]),
        )


def process_tree(pid: int) -> list[int]:
    """The job's PID 1 and every descendant, from the kernel's children lists."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{current}/task/{task}/children").read_text().split()
            except OSError:
                continue
            todo.extend(int(child) for child in children)
    return tree


def describe_process(pid: int) -> str:
    """'pid 7 (node), host pid 12345': the PID as the job sees it, and the host's."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return f"host pid {pid}"
    inner = next((line.split()[-1] for line in status.splitlines() if line.startswith("NSpid:")), str(pid))
    return f"pid {inner} ({comm}), host pid {pid}" if inner != str(pid) else f"pid {pid} ({comm})"


def scan_job(pid: int) -> JobScan:
    """Everything the job's processes hold, read from /proc (the job is frozen, or about to be)."""
    scan = JobScan()
    sockets: dict[str, int] = {}  # inode -> the process holding it
    held: set[str] = set()
    writers: dict[str, tuple[int, str]] = {}  # path -> (process, its /proc fd link) of files open for writing
    job_ns = _mount_namespace(pid)
    for member in process_tree(pid):
        # In a mount namespace the job made itself, a path may name another file of the VM (a bind mount)
        named = mounts.vm_path(member) if _mount_namespace(member) != job_ns else str
        for fd, link, writes in _fd_targets(member):
            target = named(link)
            _note(scan, member, target, writes, sockets)
            held.add(target)
            if writes and target.startswith("/"):
                writers.setdefault(target, (member, f"/proc/{member}/fd/{fd}"))
        for link, writes in _mapped(member):
            _note(scan, member, named(link), writes, sockets)
    if sockets:
        _tcp_endpoints(pid, set(sockets), scan)
        _undumpable_sockets(pid, sockets, scan)
    scan.unsupported.extend(_rollback_journal_databases(writers, held))
    scan.deleted = sorted(set(scan.deleted))
    scan.unsupported = sorted(set(scan.unsupported))
    return scan


def _mount_namespace(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return ""


def _fd_targets(pid: int) -> Iterable[tuple[str, str, bool]]:
    """(fd, target, opened for writing) of each descriptor."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            flags = Path(f"/proc/{pid}/fdinfo/{fd}").read_text().split("flags:", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        yield fd, target, int(flags, 8) & os.O_ACCMODE != os.O_RDONLY


def _rollback_journal_databases(writers: Mapping[str, tuple[int, str]], held: set[str]) -> list[str]:
    """SQLite databases written in rollback-journal mode (no <db>-wal held): SQLite checks its database file's
    inode, and every restored file is a new one, so after a restore each write fails with 'attempt to write a
    readonly database'. WAL mode does not have that check."""
    problems = []
    for path, (holder, link) in sorted(writers.items()):
        if path.endswith(" (deleted)") or f"{path}-wal" in held:
            continue
        try:
            if not stat.S_ISREG(os.stat(link).st_mode):
                continue  # never open a FIFO or a device: that could block or act
            with open(link, "rb") as database:  # through /proc: the file the job holds, whatever its path shows
                header = database.read(len(SQLITE_HEADER))
        except OSError:
            continue
        if header == SQLITE_HEADER:
            problems.append(
                f"{describe_process(holder)} holds the SQLite database {path} {ROLLBACK_JOURNAL}, which "
                "cannot be written after a restore (SQLite finds a new inode: 'attempt to write a readonly "
                "database'); switch it to WAL once with PRAGMA journal_mode=WAL"
            )
    return problems


def _mapped(pid: int) -> Iterable[tuple[str, bool]]:
    """(path, mapped shared and writable) of each file mapping."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and (parts[5].startswith("/") or parts[5].startswith("anon_inode:")):
            yield parts[5], parts[1][1] == "w" and parts[1][3] == "s"


def _note(scan: JobScan, pid: int, target: str, writes: bool, sockets: dict[str, int]) -> None:
    if target.startswith("socket:["):
        sockets[target[8:-1]] = pid
        return
    if target.startswith("anon_inode:"):
        kind = target.removeprefix("anon_inode:")
        if kind not in DUMPABLE_ANON:
            hint = WORKAROUNDS.get(kind, "close it before the checkpoint or run the job without it")
            scan.unsupported.append(f"{describe_process(pid)} holds {target}, which CRIU cannot checkpoint ({hint})")
        return
    if not target.startswith("/"):
        return  # pipes and other kernel objects CRIU dumps itself
    if target.endswith(" (deleted)"):
        scan.deleted.append(target.removesuffix(" (deleted)"))
        return
    if target.startswith("/dev/") and not _under(target, SHM_DIR):
        problem = _device_problem(target)
        if problem:
            scan.unsupported.append(f"{describe_process(pid)} holds {target}: {problem}")
        return
    if writes:
        scan.files[target] = "write"
    elif target not in scan.files:
        scan.files[target] = "new" if _changed_since_boot(target) else "read"


def _changed_since_boot(path: str) -> bool:
    try:
        return os.stat(path).st_ctime > _boot_time()
    except OSError:
        return False


@functools.cache
def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


def _device_problem(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return ""
    if not stat.S_ISCHR(st.st_mode):
        return ""
    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    if major == NVIDIA_MAJOR or major in nvidia_majors():
        return ""  # the CUDA plugin suspends the job's GPU work first; gpu.check_job refuses what it cannot do
    if major == DRI_MAJOR:
        return "the job holds a DRM device (/dev/dri); only NVIDIA GPUs used through CUDA are checkpointed"
    if major == MEM_MAJOR or major in TTY_MAJORS or (major == MISC_MAJOR and minor == TUN_MINOR):
        return ""
    return f"CRIU cannot checkpoint the character device {major}:{minor}; close it before the checkpoint"


@functools.cache
def nvidia_majors(proc: Path = Path("/proc")) -> frozenset[int]:
    """The character majors the NVIDIA driver registered (/proc/devices): nvidia-uvm and nvidia-caps get dynamic ones.

    A CUDA job holds /dev/nvidia-uvm and, with driver 580, /dev/nvidia-caps/nvidia-cap1 and -cap2 even with MIG
    disabled (seen on an H100, Linux 6.18: majors 238 and 241); CRIU's CUDA plugin takes care of all of them.
    """
    try:
        lines = (proc / "devices").read_text().split("Block devices:")[0].splitlines()
    except OSError:
        return frozenset()
    majors = set()
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].startswith("nvidia"):
            majors.add(int(parts[0]))
    return frozenset(majors)


def _undumpable_sockets(pid: int, sockets: Mapping[str, int], scan: JobScan) -> None:
    known: set[str] = set()
    for table, column in DUMPABLE_SOCKET_TABLES.items():
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        known.update(parts[column] for parts in map(str.split, lines) if len(parts) > column)
    for inode, holder in sorted(sockets.items()):
        if inode not in known:
            scan.unsupported.append(
                f"{describe_process(holder)} holds socket:[{inode}], of a kind CRIU cannot checkpoint "
                "(only unix, TCP, UDP, raw, packet and netlink sockets; not vsock, SCTP, AF_ALG or ICMP ping)"
            )


def _tcp_endpoints(pid: int, sockets: set[str], scan: JobScan) -> None:
    """Local addresses of the job's TCP sockets, from its network namespace's tables."""
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10 or parts[9] not in sockets:
                continue
            address, port = _endpoint(parts[1], family)
            if parts[3] == TCP_ESTABLISHED:
                scan.established.append(address)
                remote, remote_port = _endpoint(parts[2], family)
                scan.connections.append(f"{address} {port} {remote} {remote_port}")
            elif parts[3] == TCP_LISTEN:
                scan.listening.append(f"{address} {port}")
    scan.established = sorted(set(scan.established))
    scan.listening = sorted(set(scan.listening))
    scan.connections = sorted(set(scan.connections))


def _endpoint(text: str, family: int) -> tuple[str, int]:
    """'0100007F:1F90' -> ('127.0.0.1', 8080): the kernel prints each 32-bit word in host byte order."""
    hex_address, hex_port = text.split(":")
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    return socket.inet_ntop(family, words), int(hex_port, 16)


def unsupported_problem(scan: JobScan) -> str | None:
    """The message a checkpoint fails with when the job holds what CRIU cannot dump; None when all can be."""
    if not scan.unsupported:
        return None
    return REFUSED + "; ".join(scan.unsupported[:5])


def vm_bound_listeners(scan: JobScan, tcp: str) -> str | None:
    """Listeners bound to this VM's own address, which no backup has (each gets a new private address). Under the
    established policy the restore keeps that address on the backup's loopback (aliases.py), so they come back;
    under close it does not, so the checkpoint is refused. Wildcard and loopback listeners restore anywhere."""
    if tcp != "close":
        return None
    bound = []
    for listener in scan.listening:
        address, port = listener.rsplit(" ", 1)
        parsed = ipaddress.ip_address(address)
        if not (parsed.is_unspecified or parsed.is_loopback):
            bound.append(f"{address}:{port}" if parsed.version == 4 else f"[{address}]:{port}")
    if not bound:
        return None
    return (
        f"the job cannot be checkpointed: it listens on {', '.join(bound[:3])}, an address only this VM has, and "
        "its TCP policy (spotcr:tcp) is close, so no backup could restore it; have the job listen on 0.0.0.0 or :: "
        "(all addresses) or on 127.0.0.1, or use spotcr:tcp=established (the backup then keeps this address)"
    )


def address_here(address: str) -> bool:
    """Whether this VM has the address (a wildcard always is): binding to it fails with EADDRNOTAVAIL if not."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError as error:
            if error.errno == errno.EADDRNOTAVAIL:
                return False
            raise
    return True


def identity(path: str) -> dict[str, Any]:
    """An image file's identity: size and a hash of its first and last 64 KiB (mtimes differ between AMI builds)."""
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        size = os.fstat(source.fileno()).st_size
        digest.update(source.read(SAMPLE))
        if size > 2 * SAMPLE:
            source.seek(size - SAMPLE)
            digest.update(source.read(SAMPLE))
        elif size > SAMPLE:
            digest.update(source.read())
    return {"path": path, "size": size, "sample_sha256": digest.hexdigest()}


def image_differences(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Image files the job used that this VM lacks or has in another version, each named with how it differs."""
    problems = []
    for record in records:
        path = str(record["path"])
        try:
            here = identity(path)
        except FileNotFoundError:
            problems.append(f"{path} is missing")
            continue
        except OSError as error:
            problems.append(f"{path} cannot be read ({error.strerror})")
            continue
        if here["size"] != record["size"]:
            problems.append(f"{path} is {here['size']} bytes here, {record['size']} where the job ran")
        elif here["sample_sha256"] != record["sample_sha256"]:
            problems.append(f"{path} has other contents here than where the job ran")
    return problems


@dataclass(frozen=True)
class Entry:
    """One thing carried from a VM-local place: a file (its bytes travel in the checkpoint), a dir, a symlink or a
    FIFO (its name and mode: the bytes in the pipe travel in CRIU's images)."""

    path: str
    kind: str  # file | dir | symlink | fifo
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int = 0
    target: str = ""  # symlink target

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "mode": self.mode,
            "uid": self.uid,
            "gid": self.gid,
            "mtime_ns": self.mtime_ns,
            "size": self.size,
            "target": self.target,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Entry:
        return cls(**{key: data[key] for key in cls.__dataclass_fields__})


def _entry(path: str, st: os.stat_result) -> Entry | None:
    if stat.S_ISREG(st.st_mode):
        kind, size, target = "file", st.st_size, ""
    elif stat.S_ISDIR(st.st_mode):
        kind, size, target = "dir", 0, ""
    elif stat.S_ISLNK(st.st_mode):
        kind, size, target = "symlink", 0, os.readlink(path)
    elif stat.S_ISFIFO(st.st_mode):
        kind, size, target = "fifo", 0, ""  # Open MPI's mpirun holds one in its session dir under /tmp
    else:
        return None  # sockets and device nodes: nothing a restore could put back
    mode = stat.S_IMODE(st.st_mode)
    return Entry(path, kind, mode, st.st_uid, st.st_gid, st.st_mtime_ns, size, target)


def local_inventory(layout: Layout, scan: JobScan) -> list[Entry]:
    """The VM-local things a restore needs: every local dir's contents, and each 'other' file the job holds."""
    entries: dict[str, Entry] = {}
    for root in layout.local_dirs:
        for directory, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if layout.place(os.path.join(directory, d)) == "local"]
            for name in [*dirs, *names]:
                path = os.path.join(directory, name)
                if layout.place(path) != "local":
                    continue
                try:
                    found = _entry(path, os.lstat(path))
                except OSError:
                    continue  # removed since the listing: it cannot be held open, or the job would pin it
                if found is not None:
                    entries[path] = found
    for path, use in scan.files.items():
        if layout.place(path, use) == "other":
            for parent in reversed(Path(path).parents):
                if str(parent) != "/" and str(parent) not in entries:
                    with _ignored_os_error():
                        found = _entry(str(parent), os.lstat(parent))
                        if found is not None:
                            entries[str(parent)] = found
            with _ignored_os_error():
                found = _entry(path, os.stat(path))
                if found is not None:
                    entries[path] = found
    return sorted(entries.values(), key=lambda e: e.path)


class _ignored_os_error:  # reads as contextlib.suppress(OSError)
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, OSError)


def stored_name(path: str) -> str:
    """A VM-local file's name inside the checkpoint: local/<absolute path without its leading slash>."""
    return "local/" + path.lstrip("/")


def copy_files(entries: Iterable[Entry], dest: Path) -> None:
    """Copy the files among entries under dest (as their stored names): run while the job is frozen."""
    for entry in entries:
        if entry.kind == "file":
            target = dest / stored_name(entry.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(entry.path, target, follow_symlinks=False)


def too_big(entries: Iterable[Entry], limit_bytes: int) -> str | None:
    files = sorted((e for e in entries if e.kind == "file"), key=lambda e: e.size, reverse=True)
    total = sum(e.size for e in files)
    if total <= limit_bytes:
        return None
    biggest = ", ".join(f"{e.path} ({e.size >> 20} MiB)" for e in files[:3])
    return (
        f"the job's VM-local files take {total >> 20} MiB, more than local_files_limit_mb "
        f"({limit_bytes >> 20} MiB) in the agent config; the biggest: {biggest}"
    )


def put_back(entries: Iterable[Entry], fetched: Path) -> list[str]:
    """Put VM-local things back at their paths, owners, modes and times; returns the paths it created (to undo).

    What is already there is left alone, never replaced: on a fresh VM nothing is, and on any other machine the
    path is not the job's to overwrite (CRIU then names a file whose size differs).
    """
    created: list[Entry] = []
    for entry in sorted(entries, key=lambda e: e.path):
        path = Path(entry.path)
        if os.path.lexists(path):
            continue
        if not path.parent.is_dir():
            raise FileNotFoundError(f"{path.parent} (the parent of {path}) is not on this VM")
        if entry.kind == "dir":
            path.mkdir()
        elif entry.kind == "symlink":
            path.symlink_to(entry.target)
        elif entry.kind == "fifo":
            os.mkfifo(path, entry.mode)
        else:
            source = fetched / stored_name(entry.path)
            with open(source, "rb") as data, open(path, "xb") as out:
                shutil.copyfileobj(data, out, 1 << 20)
        created.append(entry)
        if entry.kind != "symlink":
            os.chown(path, entry.uid, entry.gid)
            os.chmod(path, entry.mode)
    # Times last, deepest first: placing files in a directory changes its time.
    for entry in reversed(created):
        if entry.kind != "symlink":
            os.utime(entry.path, ns=(entry.mtime_ns, entry.mtime_ns))
    return [entry.path for entry in created]


def take_back(created: Iterable[str]) -> None:
    """Undo put_back: remove what it created and nothing else, deepest first (a failed restore leaves no trace)."""
    for path in sorted(created, reverse=True):
        target = Path(path)
        try:
            if target.is_dir() and not target.is_symlink():
                target.rmdir()
            else:
                target.unlink()
        except OSError:
            continue
