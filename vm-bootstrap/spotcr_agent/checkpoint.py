"""Taking checkpoints: periodic (the job keeps running) and final (the job stops).

Periodic: CRIU dumps with --leave-running to local scratch, the work dir is copied while the job is
still frozen (a CRIU post-dump action script), then the job runs on while the images cross the network.
Final: the job stops and what counts is time until durable, so the store reads CRIU's images while
CRIU writes them. Either way a checkpoint exists only once the store has written its manifest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from .criu import Criu, CriuError
from .host import HostInfo
from .runner import checkpointable_problem, job_alive, open_files
from .state import FinalDump, StateFile, admit, exclusive, pid_alive
from .store import CheckpointMeta, CommitResult, Manifest

log = logging.getLogger(__name__)

KINDS = ("periodic", "final")
FINAL_MODES = ("stream", "dump-then-ship")
WAIT_POLL_S = 0.2


class CheckpointError(RuntimeError):
    """A checkpoint was not taken; the message says why."""


class Store(Protocol):
    """The part of spotcr_agent.store.CheckpointStore that checkpoints and restores use."""

    def check(self) -> None: ...

    def commit(
        self,
        image_dir: Path,
        meta: CheckpointMeta,
        extra_files: dict[str, Path] | None = None,
        still_writing: Callable[[], bool] | None = None,
    ) -> CommitResult: ...

    def checkpoint_ids(self) -> list[str]: ...

    def fetch(self, checkpoint_id: str, dest_dir: Path) -> Manifest: ...

    def prune(self, keep: int) -> Any: ...


@dataclass(frozen=True)
class CheckpointOutcome:
    checkpoint_id: str
    kind: str
    generation: int
    seconds: float  # dump start to durable
    frozen_seconds: float
    bytes_total: int
    bytes_uploaded: int
    already_taken: bool = False  # another trigger took this final dump; this one reports it

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def checkpoint_id(unix_ms: int, generation: int, kind: str) -> str:
    return f"{unix_ms:013d}-g{generation}-{kind}"


def workdir_files(workdir: Path, root: Path | None = None) -> dict[str, Path]:
    """Every regular file of the job's work dir, named as the manifest names them (workdir/<relative>)."""
    source = root or workdir
    files: dict[str, Path] = {}
    for directory, _, names in os.walk(source):
        for name in names:
            path = Path(directory, name)
            if path.is_file() and not path.is_symlink():
                files[f"workdir/{path.relative_to(source).as_posix()}"] = path
    return files


@dataclass
class Checkpointer:
    job_id: str
    workdir: Path
    scratch_dir: Path
    state: StateFile
    store: Store
    criu: Criu
    host: Callable[[], HostInfo]
    final_mode: str = "stream"
    keep_checkpoints: int = 3
    clock: Callable[[], float] = time.time

    def checkpoint(self, kind: str, generation: int) -> CheckpointOutcome:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        return self._final(generation) if kind == "final" else self._periodic(generation)

    def _running_job(self, generation: int) -> tuple[int, str | None]:
        """Under the state lock: fence, then the job's PID and the parent checkpoint."""
        with self.state.locked() as state:
            admit(state, generation)
            final = state.final_dump()
            if final is not None and final.status in ("running", "done"):
                raise CheckpointError(f"the final dump of generation {generation} is taken; the job is stopped")
            if state.job_status != "running" or not job_alive(state.job_pid, state.job_start_time):
                raise CheckpointError(_not_running(state.job_status, state.exit_code))
            return state.job_pid, state.last_checkpoint

    def _periodic(self, generation: int) -> CheckpointOutcome:
        checkpoint = self._new_id(generation, "periodic")
        with _scratch(self.scratch_dir / checkpoint) as scratch:
            return self._periodic_into(scratch, checkpoint, generation)

    def _periodic_into(self, scratch: Path, checkpoint: str, generation: int) -> CheckpointOutcome:
        started = time.monotonic()
        with exclusive(self.state.dir / "dump.lock"):
            pid, parent = self._running_job(generation)
            self._check_checkpointable(pid)
            meta = self._meta(checkpoint, generation, "periodic", parent, pid)
            snapshot = scratch / "workdir"
            script = _snapshot_script(scratch / "post-dump.sh", self.workdir, snapshot)
            try:
                frozen = self.criu.dump(
                    pid, scratch / "images", scratch / "logs", leave_running=True, action_script=script
                )
            except CriuError as error:
                raise CheckpointError(f"{error.reason}; CRIU log: {scratch / 'logs' / 'dump.log'}") from error
            # The job runs again; the commit stays under the dump lock so periodic dumps never overlap or reorder.
            result = self.store.commit(scratch / "images", meta, extra_files=workdir_files(self.workdir, snapshot))
        return self._committed(meta, result, time.monotonic() - started, frozen)

    def _final(self, generation: int) -> CheckpointOutcome:
        with self.state.locked() as state:
            admit(state, generation)
            final = state.final_dump()
            # A done dump's owner has usually exited (an SSM command): only a running one can be abandoned.
            take = (
                final is None
                or final.status == "failed"
                or (final.status == "running" and not pid_alive(final.owner_pid))
            )
            if take:
                state.final_dumps[str(generation)] = FinalDump(status="running", owner_pid=os.getpid())
        if not take:
            return self._wait_for_final(generation)
        try:
            outcome = self._take_final(generation)
        except Exception as error:
            with self.state.locked() as state:
                state.final_dumps[str(generation)] = FinalDump("failed", os.getpid(), {"reason": str(error)})
            raise
        with self.state.locked() as state:
            state.final_dumps[str(generation)] = FinalDump("done", os.getpid(), outcome.to_json())
            state.job_status = "checkpointed"
        return outcome

    def _wait_for_final(self, generation: int) -> CheckpointOutcome:
        log.info("the final dump of generation %d is already being taken; waiting for it", generation)
        while True:
            with self.state.locked() as state:
                final = state.final_dump()
            if final is None or final.status == "failed":
                reason = final.result.get("reason", "it was abandoned") if final else "it was abandoned"
                raise CheckpointError(f"the final dump taken by another trigger failed: {reason}")
            if final.status == "done":
                return CheckpointOutcome(**{**final.result, "already_taken": True})
            if not pid_alive(final.owner_pid):
                raise CheckpointError(f"the process taking the final dump ({final.owner_pid}) died")
            time.sleep(WAIT_POLL_S)

    def _take_final(self, generation: int) -> CheckpointOutcome:
        checkpoint = self._new_id(generation, "final")
        with _scratch(self.scratch_dir / checkpoint) as scratch:
            return self._take_final_into(scratch, checkpoint, generation)

    def _take_final_into(self, scratch: Path, checkpoint: str, generation: int) -> CheckpointOutcome:
        started = time.monotonic()
        with exclusive(self.state.dir / "dump.lock"):
            with self.state.locked() as state:
                if state.job_status != "running" or not job_alive(state.job_pid, state.job_start_time):
                    raise CheckpointError(_not_running(state.job_status, state.exit_code))
                pid, parent = state.job_pid, state.last_checkpoint
            self._check_checkpointable(pid)
            meta = self._meta(checkpoint, generation, "final", parent, pid)
            images, logs = scratch / "images", scratch / "logs"
            images.mkdir(parents=True, exist_ok=True)
            logs.mkdir(parents=True, exist_ok=True)
            # The job is frozen from here and killed when CRIU is done; its work dir no longer changes.
            extra = workdir_files(self.workdir)
            dump = self.criu.start_dump(self.criu.dump_argv(pid, images, logs, leave_running=False))
            if self.final_mode == "stream":
                watch = _CriuWatch(self.criu, dump, logs)
                try:
                    result = self.store.commit(images, meta, extra_files=extra, still_writing=watch)
                except CriuError as error:
                    raise CheckpointError(f"{error.reason}; CRIU log: {logs / 'dump.log'}") from error
                except Exception as error:
                    log.warning("streaming the final dump failed (%s); shipping it from local scratch", error)
                    self._finish(dump, logs)
                    result = self.store.commit(images, meta, extra_files=extra)
                else:
                    self._finish(dump, logs)
                # Frozen until CRIU exited, not until the upload that overlapped it finished.
                frozen = (watch.exited_at or time.monotonic()) - started
            else:
                self._finish(dump, logs)
                frozen = time.monotonic() - started
                result = self.store.commit(images, meta, extra_files=extra)
        return self._committed(meta, result, time.monotonic() - started, frozen)

    def _finish(self, dump: subprocess.Popen[bytes], logs: Path) -> None:
        try:
            self.criu.finish_dump(dump, logs)
        except CriuError as error:
            raise CheckpointError(f"{error.reason}; CRIU log: {logs / 'dump.log'}") from error

    def _check_checkpointable(self, pid: int) -> None:
        """Before freezing the job: CRIU would refuse it, or the images would have nowhere to go."""
        problem = checkpointable_problem(pid)
        if problem:
            raise CheckpointError(problem)
        self.store.check()

    def _new_id(self, generation: int, kind: str) -> str:
        return checkpoint_id(int(self.clock() * 1000), generation, kind)

    def _meta(self, checkpoint: str, generation: int, kind: str, parent: str | None, pid: int) -> CheckpointMeta:
        host = self.host()
        return CheckpointMeta(
            job_id=self.job_id,
            checkpoint_id=checkpoint,
            generation=generation,
            kind=kind,
            parent=parent,
            criu_version=host.criu_version,
            kernel=host.kernel,
            arch=host.arch,
            cpu_flags=host.cpu_flags,
            open_files=[{"path": path, "size": size} for path, size in open_files(pid)],
        )

    def _committed(
        self, meta: CheckpointMeta, result: CommitResult, seconds: float, frozen: float
    ) -> CheckpointOutcome:
        with self.state.locked() as state:
            state.last_checkpoint = meta.checkpoint_id
        try:
            self.store.prune(keep=self.keep_checkpoints)
        except Exception as error:
            log.warning("pruning old checkpoints failed: %s", error)
        return CheckpointOutcome(
            checkpoint_id=meta.checkpoint_id,
            kind=meta.kind,
            generation=meta.generation,
            seconds=round(seconds, 3),
            frozen_seconds=round(frozen, 3),
            bytes_total=result.bytes_total,
            bytes_uploaded=result.bytes_uploaded,
        )


@contextlib.contextmanager
def _scratch(path: Path) -> Iterator[Path]:
    """A checkpoint's local scratch: removed once committed; after a failure only CRIU's logs stay, for diagnosis."""
    try:
        yield path
    except BaseException:
        shutil.rmtree(path / "images", ignore_errors=True)
        shutil.rmtree(path / "workdir", ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)


def _not_running(status: str, exit_code: int | None) -> str:
    if status == "exited":
        return f"the job is not running: it exited with code {exit_code}"
    if status == "checkpointed":
        return "the job is not running: its final dump was taken"
    return "the job is not running on this VM"


@dataclass
class _CriuWatch:
    """`still_writing` for the store: True while CRIU writes; raises if CRIU failed, so nothing is committed."""

    criu: Criu
    dump: subprocess.Popen[bytes]
    logs: Path
    exited_at: float | None = None

    def __call__(self) -> bool:
        if self.dump.poll() is None:
            return True
        if self.exited_at is None:
            self.exited_at = time.monotonic()
        if self.dump.returncode != 0:
            self.criu.finish_dump(self.dump, self.logs)
        return False


def _snapshot_script(path: Path, workdir: Path, snapshot: Path) -> Path:
    """A CRIU action script that copies the work dir after the dump, while the job is still frozen."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\n"
        '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
        f"mkdir -p {shlex.quote(str(snapshot))}\n"
        f"exec cp -a --reflink=auto {shlex.quote(str(workdir))}/. {shlex.quote(str(snapshot))}/\n"
    )
    path.chmod(0o755)
    return path
