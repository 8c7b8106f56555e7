"""Starting a job so that CRIU can checkpoint it, and watching it.

The job runs in its own session, PID namespace, IPC namespace and mount namespace (with a /proc of
its own PID namespace, see mounts.py) with no terminal, stdin from /dev/null and output appended to files in
its work dir. PID 1 of the namespace is a tiny `sh` wrapper that opens those files inside the new
mount namespace, runs the argv (no shell interpretation), reaps orphans, and appends the job's exit
code to a file; the wrapper is checkpointed with the job, so the exit code is recorded wherever the
job ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from spotcr_contracts.tags import InvalidJobTags, check_result_files, workdir_problem

CONTROL_DIR = ".spotcr"  # inside the job's work dir, so it travels with every checkpoint
# Descriptors opened outside the job's mount namespace cannot be dumped with it: reopen stdio inside.
WRAPPER = 'exec </dev/null >>"$1" 2>>"$2"; f=$3; shift 3; "$@"; echo $? >> "$f"'
MAX_SPEC_BYTES = 64 * 1024
# Its own PID namespace, a mount namespace whose /proc is that PID namespace's (mounts.py), and its own
# IPC namespace (System V shared memory, which MPI uses, can only be dumped in one).
JOB_NAMESPACES = ("unshare", "--pid", "--ipc", "--fork", "--mount", "--propagation", "private", "--mount-proc")


class JobError(RuntimeError):
    """The job cannot be started or inspected; the message says why."""


class InvalidJobSpec(ValueError):
    """A job spec (JSON from S3) that cannot be used; the message names the field."""


@dataclass(frozen=True)
class JobDefinition:
    command: tuple[str, ...]
    workdir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    result_files: tuple[str, ...] = ()  # what the job must leave in its work dir (as spotcr:result)


def parse_job_spec(text: str | bytes) -> JobDefinition:
    """`{"command": [...], "workdir": "/abs", "env": {"K": "V"}, "result": ["out.bin"]}`; anything else is refused."""
    if len(text) > MAX_SPEC_BYTES:
        raise InvalidJobSpec(f"job spec is {len(text)} bytes, at most {MAX_SPEC_BYTES}")
    try:
        data = json.loads(text)
    except ValueError as error:
        raise InvalidJobSpec(f"job spec is not JSON: {error}") from error
    if not isinstance(data, dict):
        raise InvalidJobSpec("job spec must be a JSON object")
    unknown = sorted(set(data) - {"command", "workdir", "env", "result"})
    if unknown:
        raise InvalidJobSpec(f"job spec has unknown fields: {', '.join(unknown)}")
    command = data.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command):
        raise InvalidJobSpec("command: must be a non-empty list of non-empty strings (argv, no shell)")
    if any("\x00" in a for a in command):
        raise InvalidJobSpec("command: arguments must not contain NUL")
    workdir = data.get("workdir")
    if workdir is not None and (
        not isinstance(workdir, str) or not workdir.startswith("/") or ".." in Path(workdir).parts or "\x00" in workdir
    ):
        raise InvalidJobSpec("workdir: must be an absolute path without '..'")
    if workdir is not None and (problem := workdir_problem(workdir)):
        raise InvalidJobSpec(f"workdir: {problem}")
    env = data.get("env", {})
    if not isinstance(env, dict):
        raise InvalidJobSpec("env: must be an object of strings")
    for key, value in env.items():
        if not key or "=" in key or "\x00" in key or not isinstance(value, str) or "\x00" in value:
            raise InvalidJobSpec(f"env: {key[:32]!r} must be a name without '=' and a string value")
    return JobDefinition(
        command=tuple(command), workdir=workdir, env=dict(env), result_files=_result_files(data.get("result", []))
    )


def _result_files(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise InvalidJobSpec("result: must be a list of paths relative to the work dir")
    try:
        return check_result_files(tuple(value), "result")
    except InvalidJobTags as error:
        raise InvalidJobSpec(str(error)) from error


@dataclass(frozen=True)
class JobFiles:
    """Where a job's output and exit code live: inside its work dir."""

    workdir: Path

    @property
    def control(self) -> Path:
        return self.workdir / CONTROL_DIR

    @property
    def stdout(self) -> Path:
        return self.control / "stdout.log"

    @property
    def stderr(self) -> Path:
        return self.control / "stderr.log"

    @property
    def launch_log(self) -> Path:
        """What `unshare` itself says (namespace errors), apart from the job's own stderr."""
        return self.control / "launch.log"

    @property
    def exit_code(self) -> Path:
        return self.control / "exit-code"

    def read_exit_code(self) -> int | None:
        try:
            lines = self.exit_code.read_text().split()
        except FileNotFoundError:
            return None
        return int(lines[-1]) if lines and lines[-1].lstrip("-").isdigit() else None


@dataclass(frozen=True)
class RunningJob:
    pid: int  # host PID of the job's PID 1 (the wrapper): what `criu dump -t` takes; 0 if it already ended
    start_time: int  # from /proc/<pid>/stat, so a reused PID is not mistaken for the job
    launcher: subprocess.Popen[bytes] | None = None  # the `unshare` parent, reaped by whoever started it


def start_job(command: tuple[str, ...], workdir: Path, env: Mapping[str, str]) -> RunningJob:
    """Start the job in its own session and PID namespace; returns once its PID 1 exists."""
    if not command:
        raise JobError("the job has no command")
    workdir.mkdir(parents=True, exist_ok=True)
    files = JobFiles(workdir)
    files.control.mkdir(exist_ok=True)
    files.exit_code.unlink(missing_ok=True)
    program = command[0]
    resolved = str(workdir / program) if "/" in program and not program.startswith("/") else program
    if shutil.which(resolved, path=env.get("PATH", os.defpath)) is None:
        raise JobError(f"command {program!r} is not an executable file (PATH={env.get('PATH', os.defpath)})")
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
    launch_log = os.open(files.launch_log, flags, 0o644)
    try:
        # The inner setsid makes the wrapper a session leader inside its own namespace, as CRIU needs.
        wrapper = ["sh", "-c", WRAPPER, "spotcr-init", str(files.stdout), str(files.stderr), str(files.exit_code)]
        launcher = subprocess.Popen(
            [*JOB_NAMESPACES, "setsid", *wrapper, *command],
            stdin=subprocess.DEVNULL,
            stdout=launch_log,
            stderr=launch_log,
            cwd=workdir,
            env=dict(env),
            close_fds=True,
            start_new_session=True,
        )
    finally:
        os.close(launch_log)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        children = [pid for pid, ppid in _parents().items() if ppid == launcher.pid]
        if children:
            pid = children[0]
            start_time = process_start_time(pid)
            if start_time is not None:
                return RunningJob(pid=pid, start_time=start_time, launcher=launcher)
        if launcher.poll() is not None:
            if files.read_exit_code() is not None:
                return RunningJob(pid=0, start_time=0, launcher=launcher)  # it ran and ended already
            said = files.launch_log.read_text(errors="replace").strip()[-300:]
            raise JobError(f"the job's namespaces could not be created (unshare exited {launcher.returncode}: {said})")
        time.sleep(0.005)
    launcher.kill()
    raise JobError("the job's PID 1 did not appear within 5 s")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the command name, which may itself contain spaces and parentheses.
    return raw.rsplit(")", 1)[1].split()


def process_start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    if fields is None or fields[0] == "Z":
        return None
    return int(fields[19])


def job_alive(pid: int, start_time: int) -> bool:
    return process_start_time(pid) == start_time


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                parents[int(entry)] = int(fields[1])
    return parents


def process_tree(pid: int) -> list[int]:
    """The job's PID 1 and all its descendants (host PIDs)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


STOP_CONFIRM_S = 10.0  # SIGKILL is not deferrable: a tree still there after this is stuck in the kernel (D state)


def stop_job(pid: int, start_time: int, timeout_s: float = STOP_CONFIRM_S) -> bool:
    """Kill the job's whole process tree and confirm it is gone; False when some process outlived the wait.

    SIGKILL to the job's PID 1 ends its PID namespace (the kernel kills every process in it); each process of the
    tree is killed as well, in case one was moved out of it. Gone means no process of the tree runs any more (a
    zombie runs nothing)."""
    if not pid or not job_alive(pid, start_time):
        return True
    tree = [(member, process_start_time(member)) for member in process_tree(pid)]
    for member, _ in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while True:
        left = [member for member, started in tree if started is not None and process_start_time(member) == started]
        if not left:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def checkpointable_problem(pid: int) -> str | None:
    """Why CRIU would refuse this job, found before freezing it; None when it looks fine."""
    fields = _stat_fields(pid)
    if fields is None:
        return "job is not running"
    if int(fields[3]) != pid:
        return "root process is not a session leader (start the job with spotcr-agent)"
    for member in process_tree(pid):
        member_fields = _stat_fields(member)
        if member_fields is not None and int(member_fields[4]) != 0:
            return f"job has a controlling terminal (process {member}); jobs must run without a terminal"
    return None


def open_files(pid: int) -> list[tuple[str, int]]:
    """Regular files the job's processes hold open, with their current sizes."""
    found: dict[str, int] = {}
    for member in process_tree(pid):
        fd_dir = Path(f"/proc/{member}/fd")
        try:
            fds = list(fd_dir.iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if not target.startswith("/") or target.startswith(("/dev/", "/proc/")) or target.endswith(" (deleted)"):
                continue
            try:
                stat = os.stat(target)
            except OSError:
                continue
            if os.path.isfile(target):
                found[target] = stat.st_size
    return sorted(found.items())
