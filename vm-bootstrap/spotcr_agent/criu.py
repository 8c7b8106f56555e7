"""Running CRIU: dump (periodic or final), restore, feature and version detection, clear failures."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import gpu, mounts

# Options every dump and restore takes: jobs may hold file locks and sockets to services outside the job
# (journald, nscd); none runs on a terminal, so never --shell-job.
COMMON_OPTIONS = ("--file-locks", "--ext-unix-sk", "-v4")
# A dump always records TCP connections; the restore decides to re-establish them or to close them.
DUMP_OPTIONS = ("--tcp-established", "--link-remap")
DEFAULT_GHOST_LIMIT_MB = 1024
# Memory tracking (soft-dirty bits, CONFIG_MEM_SOFT_DIRTY): pre-dumps and incremental dumps need it.
MEM_DIRTY_TRACK = "mem_dirty_track"
# userfaultfd with fork and remap events: what `criu restore --lazy-pages` needs (lazy.py).
LAZY_PAGES = "uffd-noncoop"
# A pre-dump reads the job's pages with process_vm_readv after it thaws, instead of pinning them in pipes while
# frozen (splice): a shorter freeze, measured 0.15-0.35 s against 0.35-0.95 s for 512 MiB on Debian's 6.1 kernel.
PRE_DUMP_MODE = "read"
LOG_TAIL_LINES = 15
# Lines every CRIU log here has that are not the cause (no CAP_SYS_RESOURCE for RLIMIT_NOFILE).
_NOISE = re.compile(r"RLIMIT_NOFILE")

# What CRIU's log says, and what it means for the user (first match wins).
_EXPLANATIONS: tuple[tuple[str, str], ...] = (
    (r"is not a session leader|A session leader .* is outside", "root process is not a session leader"),
    (r"tty|Can't dump controlling terminal|--shell-job", "job has a controlling terminal"),
    (r"No such process|Can't attach to \d+|Unable to seize|seize .* failed", "job is not running"),
    (r"has bad size|File .* has bad (size|mode)", "a file the job has open changed size since the dump"),
    (r"Can't dump ghost file", "an unlinked file the job holds is bigger than ghost_limit_mb in the agent config"),
    (
        r"Use link-remap option|Can't create link remap",
        "the job holds a renamed or unlinked file CRIU cannot link back",
    ),
    (
        r"cuda_plugin|cuda-checkpoint|CUDA",
        "CRIU's CUDA plugin could not checkpoint the job's GPU state (UVM managed memory, CUDA IPC memory, MIG and "
        "MPS are not supported)",
    ),
    (r"Unknown shit|[Uu]nsupported|Unknown socket", "the job holds something CRIU cannot checkpoint"),
    (r"Cannot assign requested address", "the job's network address is not on this VM"),
    (r"Can't open file .*|No such file or directory", "a file the job needs is missing"),
    (r"cpuinfo|CPU feature|cpu .* mismatch", "this CPU lacks features the job's CPU had"),
    (r"Connected TCP socket|TCP connection", "job holds TCP connections CRIU cannot dump"),
    (r"(?:unix|Unix) socket", "job holds a unix socket to something outside it"),
    (r"Can't write|No space left", "no space left for the checkpoint images"),
    (r"Address already in use", "a port the job listens on is already taken here"),
    (r"Pid \d+ is (already )?busy|pid .* is busy|Can't fork for \d+", "the job's PID is taken here"),
)


class CriuError(RuntimeError):
    """CRIU failed; `reason` is a one-line explanation, `log_tail` the end of CRIU's log, `log` the whole of it."""

    def __init__(self, action: str, reason: str, log_tail: str = "", log: str = "") -> None:
        super().__init__(f"criu {action} failed: {reason}" + (f"\n{log_tail}" if log_tail else ""))
        self.action = action
        self.reason = reason
        self.log_tail = log_tail
        self.log = log


def error_lines(log_text: str) -> list[str]:
    """CRIU's error lines in order, without the noise every log here has."""
    return [
        line
        for line in log_text.splitlines()
        if ("Error" in line or "error" in line) and not _NOISE.search(line) and line.strip()
    ]


def explain(log_text: str) -> str:
    """What went wrong, in the user's words where known, always with the first real error line CRIU wrote."""
    errors = error_lines(log_text)
    if not errors:
        return "no error in CRIU's log"
    first = _strip_prefix(errors[0])
    for pattern, meaning in _EXPLANATIONS:
        for line in errors:
            if re.search(pattern, line):
                cause = _strip_prefix(line)
                return f"{meaning} ({cause})" if cause == first else f"{meaning} ({cause}; first error: {first})"
    return first


def _strip_prefix(line: str) -> str:
    # "(00.012345) Error (criu/tty.c:123): message" -> "message"
    return re.sub(r"^\(\s*[\d.]+\)\s*(?:\d+:\s*)?Error\s*\([^)]*\):\s*", "", line.strip())[:300]


def failure(action: str, log_path: Path, stderr: str) -> CriuError:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        text = stderr
    return CriuError(action, explain(text), log_tail(text), text)


def log_tail(text: str) -> str:
    """The log's end, preceded by the lines up to its first real error, which CRIU often writes much earlier."""
    lines = [line for line in text.splitlines() if not _NOISE.search(line)]
    tail = lines[-LOG_TAIL_LINES:]
    errors = error_lines("\n".join(lines))
    if errors and errors[0] not in tail:
        first = lines.index(errors[0])
        return "\n".join([*lines[max(0, first - 2) : first + 1], "...", *tail])
    return "\n".join(tail)


@dataclass
class Criu:
    binary: str = "criu"
    ghost_limit_mb: int = DEFAULT_GHOST_LIMIT_MB  # unlinked files up to this size travel inside the images
    _features: dict[str, bool] = field(default_factory=dict)
    _version: str = ""

    def version(self) -> str:
        """CRIU's version, e.g. '4.1.1'."""
        if not self._version:
            try:
                result = subprocess.run([self.binary, "--version"], capture_output=True, text=True, check=False)
            except FileNotFoundError as error:
                raise CriuError("--version", f"CRIU is not installed ({self.binary} not found)") from error
            match = re.search(r"Version:\s*([0-9][0-9.]*)", result.stdout)
            if result.returncode != 0 or not match:
                output = f"{result.stdout.strip()} {result.stderr.strip()}"
                raise CriuError("--version", f"cannot read CRIU's version: {output}")
            self._version = match.group(1)
        return self._version

    def supports(self, feature: str) -> bool:
        """`criu check --feature`: e.g. mem_dirty_track, which incremental dumps need."""
        if feature not in self._features:
            result = subprocess.run(
                [self.binary, "check", "--feature", feature], capture_output=True, text=True, check=False
            )
            self._features[feature] = result.returncode == 0
        return self._features[feature]

    def memory_tracking(self) -> tuple[bool, str]:
        """Whether dumps here can be incremental, and why, in words for the agent's log and events."""
        if self.supports(MEM_DIRTY_TRACK):
            return True, f"the kernel tracks dirty memory (criu check --feature {MEM_DIRTY_TRACK} passes)"
        kernel = os.uname().release
        return False, (
            f"kernel {kernel} has no dirty-memory tracking (criu check --feature {MEM_DIRTY_TRACK} fails: "
            "no CONFIG_MEM_SOFT_DIRTY)"
        )

    def pre_dump_argv(self, pid: int, images_dir: Path, log_dir: Path, *, prev_images_dir: Path | None) -> list[str]:
        """A pre-dump: the job's memory only, with tracking turned on; the job is frozen only while its memory
        map is read, its pages are drained after it thaws (PRE_DUMP_MODE)."""
        argv = [self.binary, "pre-dump", "-t", str(pid), "-D", str(images_dir), "-W", str(log_dir)]
        argv += ["-o", "pre-dump.log", *COMMON_OPTIONS, *mounts.dump_options(pid)]
        argv += ["--track-mem", "--pre-dump-mode", PRE_DUMP_MODE]
        if prev_images_dir is not None:
            argv += ["--prev-images-dir", str(prev_images_dir)]
        return argv

    def pre_dump(self, pid: int, images_dir: Path, log_dir: Path, *, prev_images_dir: Path | None = None) -> float:
        """Pre-dump the job's memory (it keeps running); returns the seconds CRIU ran."""
        images_dir.mkdir(parents=True, exist_ok=True)
        log_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        argv = self.pre_dump_argv(pid, images_dir, log_dir, prev_images_dir=prev_images_dir)
        result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise failure("pre-dump", log_dir / "pre-dump.log", result.stderr)
        return time.monotonic() - started

    def dump_argv(
        self,
        pid: int,
        images_dir: Path,
        log_dir: Path,
        *,
        leave_running: bool,
        leave_stopped: bool = False,
        prev_images_dir: Path | None = None,
        action_script: Path | None = None,
        libdir: Path | None = None,
    ) -> list[str]:
        """leave_running: the job runs on after the dump; else leave_stopped: CRIU exits leaving it stopped, for
        the caller to kill (CRIU's own kill waits while the kernel frees the job's memory: 0.14 s for 2 GiB here);
        else CRIU kills it."""
        argv = [self.binary, "dump", "-t", str(pid), "-D", str(images_dir), "-W", str(log_dir), "-o", "dump.log"]
        argv += [*COMMON_OPTIONS, *DUMP_OPTIONS, "--ghost-limit", f"{self.ghost_limit_mb}M", *mounts.dump_options(pid)]
        if leave_running:
            argv.append("--leave-running")
        elif leave_stopped:
            argv.append("--leave-stopped")
        if prev_images_dir is not None:
            argv += ["--track-mem", "--prev-images-dir", str(prev_images_dir)]
        if action_script is not None:
            argv += ["--action-script", str(action_script)]
        return argv + gpu.criu_options(libdir)  # the CUDA plugin, only for a job that holds a GPU

    def start_dump(self, argv: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def finish_dump(self, process: subprocess.Popen[bytes], log_dir: Path) -> None:
        _, stderr = process.communicate()
        if process.returncode != 0:
            raise failure("dump", log_dir / "dump.log", stderr.decode(errors="replace"))

    def dump(
        self,
        pid: int,
        images_dir: Path,
        log_dir: Path,
        *,
        leave_running: bool,
        prev_images_dir: Path | None = None,
        action_script: Path | None = None,
        libdir: Path | None = None,
    ) -> float:
        """Dump the job's process tree; returns the seconds CRIU ran (the job is frozen about that long)."""
        images_dir.mkdir(parents=True, exist_ok=True)
        log_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        argv = self.dump_argv(
            pid,
            images_dir,
            log_dir,
            leave_running=leave_running,
            prev_images_dir=prev_images_dir,
            action_script=action_script,
            libdir=libdir,
        )
        process = self.start_dump(argv)
        self.finish_dump(process, log_dir)
        return time.monotonic() - started

    def restore(
        self,
        images_dir: Path,
        log_dir: Path,
        *,
        tcp_close: bool = False,
        reset: Sequence[str] = (),
        libdir: Path | None = None,
    ) -> int:
        """Restore detached (-d) into a fresh PID namespace; returns the host PID of the job's PID 1.

        tcp_close: the job's TCP connections come back closed (it sees them reset) instead of re-established.
        reset: connections ("local-address port remote-address port") destroyed before the job resumes, so that
        the job sees them reset and the others come back established.
        libdir: the CUDA plugin's directory, for a checkpoint that holds GPU state.
        """
        log_dir.mkdir(parents=True, exist_ok=True)
        pidfile = log_dir / "restore.pid"
        pidfile.unlink(missing_ok=True)
        argv = self.restore_argv(images_dir, log_dir, tcp_close=tcp_close, libdir=libdir, reset=reset)
        result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise failure("restore", log_dir / "restore.log", result.stderr)
        return int(pidfile.read_text().strip())

    def restore_argv(
        self,
        images_dir: Path,
        log_dir: Path,
        *,
        tcp_close: bool = False,
        libdir: Path | None = None,
        reset: Sequence[str] = (),
        lazy: bool = False,
    ) -> list[str]:
        """The options are restore's; lazy: the job's anonymous memory comes from a `criu lazy-pages` daemon
        listening in log_dir (lazy.py)."""
        argv = [self.binary, "restore", "-d", "-D", str(images_dir), "-W", str(log_dir), "-o", "restore.log"]
        tcp = "--tcp-close" if tcp_close else "--tcp-established"
        argv += [*COMMON_OPTIONS, tcp, *mounts.restore_options(), "--pidfile", str(log_dir / "restore.pid")]
        if reset:
            argv += ["--action-script", str(_reset_script(log_dir / "reset.sh", reset))]
        if lazy:
            argv.append("--lazy-pages")
        return argv + gpu.criu_options(libdir)


@dataclass(frozen=True)
class DumpStats:
    """What CRIU measured of one dump or pre-dump (its stats-dump image)."""

    frozen_seconds: float
    pages_scanned: int
    pages_skipped_parent: int
    pages_written: int


def dump_stats(work_dir: Path) -> DumpStats | None:
    """CRIU's own figures from stats-dump.img in its work dir (-W); None where it wrote none or it is unreadable.

    The image: two 32-bit magics, a 32-bit length, then a StatsEntry protobuf whose field 1 is a DumpStatsEntry
    (2: frozen_time in microseconds, 5: pages_scanned, 6: pages_skipped_parent, 7: pages_written)."""
    try:
        data = (work_dir / "stats-dump.img").read_bytes()
        (size,) = struct.unpack_from("<I", data, 8)
        entry = protobuf_fields(data[12 : 12 + size])
        dump = entry.get(1)
        if not isinstance(dump, bytes):
            return None
        fields = protobuf_fields(dump)
        values = [fields.get(n, 0) for n in (2, 5, 6, 7)]
        if not all(isinstance(v, int) for v in values):
            return None
        frozen_us, scanned, skipped, written = (int(v) for v in values)
    except (OSError, struct.error, ValueError, IndexError):
        return None
    return DumpStats(frozen_us / 1e6, scanned, skipped, written)


def protobuf_fields(data: bytes) -> dict[int, int | bytes]:
    """The top-level fields of a protobuf message: varints as ints, length-delimited ones as bytes."""
    fields: dict[int, int | bytes] = {}
    offset = 0
    while offset < len(data):
        key, offset = _varint(data, offset)
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields[number], offset = _varint(data, offset)
        elif wire == 2:
            length, offset = _varint(data, offset)
            fields[number] = data[offset : offset + length]
            offset += length
        elif wire in (1, 5):
            offset += 8 if wire == 1 else 4
        else:
            raise ValueError(f"protobuf wire type {wire} in a CRIU stats image")
    return fields


def _varint(data: bytes, offset: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, offset
        shift += 7


def _endpoint(address: str, port: str) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _reset_script(path: Path, connections: Sequence[str]) -> Path:
    """CRIU's action script that destroys the given connections (sock_destroy, as `ss -K`) before the job resumes;
    it fails the restore, naming the connection, where the kernel cannot (no CONFIG_INET_DIAG_DESTROY)."""
    lines = ["#!/bin/sh", '[ "$CRTOOLS_SCRIPT_ACTION" = pre-resume ] || exit 0']
    for connection in connections:
        local, local_port, remote, remote_port = connection.split()
        match = f"state established src {_endpoint(local, local_port)} dst {_endpoint(remote, remote_port)}"
        lines.append(f"ss -K -tn {match} >/dev/null || exit 1")
        lines.append(
            f'[ -z "$(ss -tnH {match})" ] || '
            f'{{ echo "Error (spotcr): cannot reset the connection {connection}: '
            'the kernel lacks sock_destroy (CONFIG_INET_DIAG_DESTROY)" >&2; exit 1; }'
        )
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return path
