"""Taking checkpoints: periodic (the job keeps running) and final (the job stops).

Periodic: CRIU dumps with --leave-running to local scratch, the work dir and the job's VM-local files
(carry.py) are copied while the job is still frozen (CRIU's post-dump script hands over to the agent), then the job runs
on while the images cross the network. Local scratch is a tmpfs sized to the dump when free memory holds it
(scratch.py), so the job is frozen only as long as CRIU writes to memory, not to the disk. Final: the job stops
and what counts is time until durable, so the store reads CRIU's images while CRIU writes them, and the files
where they are once CRIU is done.
Either way a checkpoint exists only once the store has written its manifest, and is committed only when
everything the job holds is either in it, on the job's storage, or on the image (checked at restore).

Where the kernel tracks dirty memory (chosen at run time by `criu check --feature mem_dirty_track`, and said in
each outcome's memory_tracking), periodic checkpoints are a pre-dump plus an incremental dump and the final dump
is incremental on top of the newest periodic one (tracking.py); elsewhere every dump is a full one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import select
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from spotcr_contracts.commands import checkpoint_id
from spotcr_contracts.layout import CRIU_LOGS, job_prefix
from spotcr_contracts.tags import DEFAULT_TCP

from . import aliases, carry, deadline, gpu, inflight, memsample, mounts, tracking
from . import scratch as scratch_room
from .carry import Entry, JobScan, Layout
from .config import DEFAULT_LOCAL_FILES_LIMIT_MB
from .criu import Criu, CriuError, dump_stats
from .host import HostInfo
from .runner import JobFiles, checkpointable_problem, job_alive, open_files, stop_job
from .state import AgentState, FinalDump, StateFile, admit, exclusive, pid_alive
from .store import Backend, CheckpointMeta, ChunkRef, CommitProgress, CommitResult, Manifest

log = logging.getLogger(__name__)

KINDS = ("periodic", "final")
KEEP_CRIU_LOGS = 20
FINAL_MODES = ("stream", "dump-then-ship")
WAIT_POLL_S = 0.2


class CheckpointError(RuntimeError):
    """A checkpoint was not taken; the message says why, log_tail holds the end of CRIU's log when CRIU failed."""

    def __init__(self, message: str, log_tail: str = "", log: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail
        self.log = log  # CRIU's whole log, kept in the job's storage by the agent

    @classmethod
    def of(cls, error: CriuError, log_path: Path) -> CheckpointError:
        return cls(f"{error.reason}; CRIU log: {log_path}", error.log_tail, error.log)


class Store(Protocol):
    """The part of spotcr_agent.store.CheckpointStore that checkpoints and restores use."""

    job_id: str
    backend: Backend

    def check(self) -> None: ...

    def commit(
        self,
        image_dir: Path,
        meta: CheckpointMeta,
        extra_files: Mapping[str, Path] | None = None,
        still_writing: Callable[[], bool] | None = None,
        inherited: Mapping[str, tuple[str, Path]] | None = None,
        *,
        keep_going: Callable[[CommitProgress], bool] | None = None,
    ) -> CommitResult: ...

    def checkpoint_ids(self) -> list[str]: ...

    def load(self, checkpoint_id: str) -> Manifest: ...

    def fetch(self, checkpoint_id: str, dest_dir: Path, later: Collection[str] = ()) -> Manifest: ...

    def read_chunks(self, manifest: Manifest, chunks: list[ChunkRef], path: str) -> list[bytes]: ...

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
    gpu_memory_bytes: int | None = None  # the job's GPU device memory, inside bytes_total (None: no GPU or unknown)
    memory_tracking: str = ""  # how the dump was taken (incremental or full) and why
    scratch: str = ""  # where CRIU wrote the images: memory (a tmpfs) or disk
    # Where the time went, for the deadline's rates (deadline.Sample): CRIU, then the store's stages.
    parent: str | None = None
    criu_seconds: float = 0.0
    store_seconds: float = 0.0
    bytes_new: int = 0
    bytes_changed: int = 0
    read_seconds: float = 0.0
    hash_seconds: float = 0.0
    compress_seconds: float = 0.0
    upload_seconds: float = 0.0
    # The deadline plan after a periodic dump (Agent._plan; deadline.py): 0 and "" before it can plan.
    predicted_final_seconds: float = 0.0
    next_interval_s: int = 0
    deadline_risk: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def keep_criu_log(
    store: Store,
    action: str,
    checkpoint: str,
    text: str,
    *,
    clock: Callable[[], float] = time.time,
    kind: str = CRIU_LOGS,
) -> str:
    """Keep CRIU's log of a failed dump or restore (or, kind AGENT_LOGS, the agent's own lines of it) in the job's
    storage, where it outlives the VM; its location. The newest KEEP_CRIU_LOGS of each kind are kept."""
    prefix = f"{job_prefix(store.job_id)}{kind}/"
    key = f"{prefix}{int(clock() * 1000):013d}-{action}-{checkpoint or 'none'}.log"
    store.backend.put(key, text.encode())
    store.backend.flush()
    old = sorted(obj.key for obj in store.backend.scan(prefix))[:-KEEP_CRIU_LOGS]
    if old:
        store.backend.delete(old)
    return store.backend.describe(key)


def kept_criu_logs(store: Store, newest: int = 5) -> list[dict[str, str]]:
    """The newest kept CRIU logs, each with where it is and the first real error line in it."""
    from .criu import explain

    keys = sorted((obj.key for obj in store.backend.scan(f"{job_prefix(store.job_id)}{CRIU_LOGS}/")), reverse=True)
    logs = []
    for key in keys[:newest]:
        text = store.backend.get(key).decode(errors="replace")
        logs.append({"log": store.backend.describe(key), "error": explain(text)})
    return logs


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
    layout: Layout | None = None  # where VM-local, image and storage files are; None: the work dir is all there is
    local_files_limit_mb: int = DEFAULT_LOCAL_FILES_LIMIT_MB
    tcp: str = DEFAULT_TCP  # AgentConfig.tcp: under close, a listener on the VM's own address cannot come back
    check_gpus: Callable[[list[int], Criu], gpu.JobGpus | None] = gpu.for_dump
    memory_tracking: bool | None = None  # None: where the kernel has it (Criu.memory_tracking)
    memory_scratch_dir: Path | None = None  # where a tmpfs for one dump is mounted when memory allows; None: never
    # The control plane's sequence this dump ranks at (in the checkpoint's id): its order's, or for a dump nobody
    # ordered the highest its VM was given (Agent.fence); None on a VM never given one (commands.checkpoint_order).
    sequence: int | None = None
    # For a final dump: when EC2 reclaims this VM (unix time, from IMDS spot/instance-action; None: not known),
    # asked only of a dump that would read all of memory, which is not begun when it cannot fit the time left even
    # at the job's best measured rates (deadline.cannot_fit).
    reclaim_at: Callable[[], float | None] | None = None
    # Called once a periodic dump's job runs again, before its images are committed (the agents' port answers a
    # coordinated dump then, so the nodes are unlocked while their images go to the store).
    on_resumed: Callable[[], None] = lambda: None
    _scan: JobScan = field(default_factory=JobScan)
    _gpus: gpu.JobGpus | None = None

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = Layout(workdir=str(self.workdir), local_dirs=(), excluded=self._own_dirs())

    def _own_dirs(self) -> tuple[str, ...]:
        return (str(self.state.dir), str(self.scratch_dir))

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

    def _tracking(self) -> tuple[bool, str]:
        """Whether dumps here are incremental, and why."""
        if self.memory_tracking is None:
            return self.criu.memory_tracking()
        return self.memory_tracking, ("memory tracking is on" if self.memory_tracking else "memory tracking is off")

    def _periodic(self, generation: int) -> CheckpointOutcome:
        started = time.monotonic()
        tracked, why = self._tracking()
        if tracked:
            checkpoint = self._new_id(generation, "periodic")
            try:
                with _scratch(self.scratch_dir / checkpoint) as scratch:
                    return self._periodic_tracked(scratch, checkpoint, generation, why)
            except _PreDumpFailed as failed:
                # Nothing was frozen for long, nothing committed: this checkpoint is a full dump instead.
                log.warning("memory tracking: the pre-dump failed, taking a full dump: %s", failed.error)
                why = f"the pre-dump failed ({failed.error})"
        with exclusive(self.state.dir / "dump.lock"):
            # Named for now, right before its freeze, not for when it was asked for: a dump that waited for the
            # lock (another one committing) would otherwise count that wait as time its job had to change memory.
            checkpoint = self._new_id(generation, "periodic")
            with inflight.holding(self.state.dir, checkpoint):
                return self._periodic_full(checkpoint, generation, why, started)

    def _periodic_full(self, checkpoint: str, generation: int, why: str, started: float) -> CheckpointOutcome:
        """Under the dump lock: a full dump, committed."""
        pid, parent = self._running_job(generation)
        self._check_checkpointable(pid)
        # Images (device memory included) and the work dir's copy, in memory when they fit there; refused
        # before the freeze otherwise.
        with (
            scratch_room.dump_scratch(
                self.scratch_dir, self.memory_scratch_dir, pid, self.workdir, gpu_bytes=self._gpu_bytes
            ) as room,
            _scratch(room[0] / checkpoint) as scratch,
        ):
            outcome = self._periodic_into(scratch, checkpoint, generation, pid, parent, started=started)
            return dataclasses.replace(outcome, scratch=room[1], memory_tracking=f"full dump: {why}")

    def _periodic_tracked(self, scratch: Path, checkpoint: str, generation: int, why: str) -> CheckpointOutcome:
        """A pre-dump (short freeze, pages drained after the job thaws), then at once an incremental dump on top of
        it (frozen for the pages dirtied in between), committed with the chain it links to."""
        started = time.monotonic()
        with exclusive(self.state.dir / "dump.lock"), inflight.holding(self.state.dir, checkpoint):
            pid, parent = self._running_job(generation)
            start_time = self._job_start_time()
            self._check_checkpointable(pid)
            if self._gpus is not None:  # before the pre-dump: it would run without the CUDA plugin
                raise _PreDumpFailed("the job holds a GPU, whose memory the kernel does not track")
            scratch_room.require_room(self.scratch_dir, pid, self.workdir)
            meta = self._meta(checkpoint, generation, "periodic", parent, pid)
            base, fresh = self._usable_chain(pid, start_time, parent, room_for=2)
            root = self.scratch_dir / tracking.CHAIN_DIR
            pre, top = root / f"{checkpoint}.pre", root / f"{checkpoint}.dump"
            try:
                frozen_pre, frozen_dump = self._pre_then_dump(pid, pre, top, base, scratch)
                self.on_resumed()
                extra = self._carried(scratch, scratch / "workdir", copied=scratch / "carried")
                extra.update({tracking.images_prefix(1) + n: p for n, p in tracking.dir_files(pre).items()})
                inherited = base.files(shift=2) if base else {}
                result = self.store.commit(
                    top, meta, extra_files=extra, keep_going=self._in_flight(meta), **_inheriting(inherited)
                )
            except BaseException:
                # The pre-dump reset the kernel's dirty bits: the chain no longer covers every change since its top.
                tracking.discard(self.scratch_dir)
                raise
            dirs = (*(base.dirs if base else ()), pre.name, top.name)
            chain = tracking.Chain(root, pid, start_time, checkpoint, dirs)
            chain.save()
            tracking.discard(self.scratch_dir, keep=chain.dirs)
        frozen = frozen_pre + frozen_dump
        how = (
            f"incremental: pre-dump (frozen {frozen_pre:.3f} s), then dump (frozen {frozen_dump:.3f} s) on "
            f"{len(chain.dirs) - 1} parent image dirs ({fresh}; {why})"
        )
        return dataclasses.replace(
            self._committed(meta, result, time.monotonic() - started, frozen), memory_tracking=how, scratch="disk"
        )

    def _pre_then_dump(
        self, pid: int, pre: Path, top: Path, base: tracking.Chain | None, scratch: Path
    ) -> tuple[float, float]:
        """Pre-dump, then dump; how long each held the job frozen (CRIU's own figure where it wrote one)."""
        logs = scratch / "logs"
        prev = tracking.link_target(pre, base.top()) if base else None
        try:
            pre_frozen = _frozen(logs, self.criu.pre_dump(pid, pre, logs, prev_images_dir=prev))
        except CriuError as error:
            raise _PreDumpFailed(error.reason) from error
        with self._at_freeze(scratch, pid, snapshot=scratch / "workdir") as at_freeze:
            try:
                dump_wall = self.criu.dump(
                    pid,
                    top,
                    logs,
                    leave_running=True,
                    prev_images_dir=tracking.link_target(top, pre),
                    action_script=at_freeze.script,
                )
            except CriuError as error:
                at_freeze.raise_own_error()
                raise CheckpointError.of(error, logs / "dump.log") from error
        return pre_frozen, _frozen(logs, dump_wall)

    def _job_start_time(self) -> int:
        with self.state.locked() as state:
            return state.job_start_time

    def _usable_chain(
        self, pid: int, start_time: int, parent: str | None, room_for: int
    ) -> tuple[tracking.Chain | None, str]:
        """The local chain an incremental dump builds on, or None (a fresh start), and why in words."""
        chain = tracking.Chain.load(self.scratch_dir)
        if chain is None:
            return None, "a fresh chain: none on this VM yet"
        problem = chain.problem(pid, start_time, parent)
        if problem is None and len(chain.dirs) + room_for > tracking.MAX_CHAIN_DIRS:
            problem = f"the chain has {len(chain.dirs)} image dirs, the most is {tracking.MAX_CHAIN_DIRS}"
        if problem is not None:
            log.info("memory tracking: starting a fresh chain: %s", problem)
            return None, f"a fresh chain: {problem}"
        return chain, f"on checkpoint {chain.checkpoint}"

    def _periodic_into(
        self, scratch: Path, checkpoint: str, generation: int, pid: int, parent: str | None, *, started: float
    ) -> CheckpointOutcome:
        meta = self._meta(checkpoint, generation, "periodic", parent, pid)
        snapshot = scratch / "workdir"
        with self._at_freeze(scratch, pid, snapshot=snapshot) as at_freeze:
            try:
                frozen = self.criu.dump(
                    pid,
                    scratch / "images",
                    scratch / "logs",
                    leave_running=True,
                    action_script=at_freeze.script,
                    libdir=self._plugin_dir,
                )
            except CriuError as error:
                at_freeze.raise_own_error()
                with self.state.locked() as state:
                    if state.job_status == "stopped":  # by a failed final dump, which did not wait (_hopeless)
                        why = f"the job was stopped for good during this dump: its final dump failed ({error.reason})"
                        raise CheckpointError(why) from error
                raise CheckpointError.of(error, scratch / "logs" / "dump.log") from error
        # The job runs again; the commit stays under the dump lock so periodic dumps never overlap or reorder.
        if self._gpus is None:  # what changes from here on, told at a notice (memsample.py)
            memsample.record(self.state.dir, checkpoint, pid)
        self.on_resumed()
        extra = self._carried(scratch, snapshot, copied=scratch / "carried")
        result = self.store.commit(scratch / "images", meta, extra_files=extra, keep_going=self._in_flight(meta))
        return self._committed(meta, result, time.monotonic() - started, frozen)

    def _in_flight(self, meta: CheckpointMeta) -> Callable[[CommitProgress], bool]:
        """A periodic commit's progress, recorded for a final dump, which may ask it to stop (inflight.py)."""
        first: list[tuple[float, int]] = []

        def keep_going(progress: CommitProgress) -> bool:
            now = time.time()
            if not first:
                first.append((now, progress.done))
            first_at, first_done = first[0]
            commit = inflight.Commit(
                meta.checkpoint_id,
                meta.parent,
                first_at,
                first_done,
                now,
                progress.done,
                progress.total,
                progress.changed,
            )
            inflight.record(self.state.dir, commit)
            if inflight.abandoned(self.state.dir, meta.checkpoint_id):
                log.warning("periodic commit %s stopped: the final dump takes over", meta.checkpoint_id)
                return False
            return True

        return keep_going

    def _final(self, generation: int) -> CheckpointOutcome:
        with self.state.locked() as state:
            admit(state, generation)
            final = state.final_dump()
            if final is not None and final.status == "failed" and state.job_status == "stopped":
                # Another trigger's dump failed (or was not begun) and stopped the job: its reason is the answer.
                reason = final.result.get("reason", "no reason recorded")
                raise CheckpointError(f"the final dump failed and the job is stopped here: {reason}")
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
                stopped = self._stop_for_good(state)
                result = {"reason": str(error), "job_stopped": stopped}
                state.final_dumps[str(generation)] = FinalDump("failed", os.getpid(), result)
            raise
        with self.state.locked() as state:
            state.final_dumps[str(generation)] = FinalDump("done", os.getpid(), outcome.to_json())
            state.job_status = "checkpointed"
        return outcome

    def _stop_for_good(self, state: AgentState) -> bool:
        """At most one live copy: a final dump is ordered only when this VM is going away, and when it fails the
        backup restores an older checkpoint. So the job is killed here (its whole tree, confirmed gone) and fenced:
        a stopped job is never started, restored or dumped on this VM again. True once the job is known gone.

        A job that ended on its own just before (its exit code is recorded) is left to report its end."""
        if state.job_status == "stopped":
            return True
        if state.job_status != "running":
            return False
        if not job_alive(state.job_pid, state.job_start_time) and JobFiles(self.workdir).read_exit_code() is not None:
            return False
        if not stop_job(state.job_pid, state.job_start_time):
            log.error("the job (pid %d) outlived SIGKILL; it is not known to be gone", state.job_pid)
            return False
        log.warning("the final dump failed: the job (pid %d) is stopped here for good", state.job_pid)
        state.job_status = "stopped"
        return True

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
        tracked, why = self._tracking()
        try:
            try:
                return self._take_final_in_scratch(checkpoint, generation, tracked, why)
            except _IncrementalFailed as failed:
                # CRIU resumed the job: a full dump does not depend on the chain, whatever was wrong with it.
                log.warning("the incremental final dump failed, taking a full one: %s", failed.error)
                tracking.discard(self.scratch_dir)
                return self._take_final_in_scratch(
                    checkpoint, generation, False, f"the incremental dump failed ({failed.error})"
                )
        finally:
            if tracked:  # the job is stopped, or its dump failed with the kernel's dirty bits in doubt
                tracking.discard(self.scratch_dir)

    def _take_final_in_scratch(self, checkpoint: str, generation: int, tracked: bool, why: str) -> CheckpointOutcome:
        started = time.monotonic()
        reclaim_at = self.reclaim_at() if self.reclaim_at is not None else None
        if not tracked and reclaim_at is not None and (why_not := self._hopeless(reclaim_at)):
            raise CheckpointError(why_not)
        with exclusive(self.state.dir / "dump.lock", while_held=self._commit_in_the_way(reclaim_at)):
            with self.state.locked() as state:
                if state.job_status != "running" or not job_alive(state.job_pid, state.job_start_time):
                    raise CheckpointError(_not_running(state.job_status, state.exit_code))
                pid, parent, start_time = state.job_pid, state.last_checkpoint, state.job_start_time
                samples = [deadline.Sample.from_json(sample) for sample in state.dump_samples]
            base, on = self._usable_chain(pid, start_time, parent, room_for=0) if tracked else (None, "")
            if base is None and samples and reclaim_at:
                now = time.time()  # EC2's time by this VM's clock (Amazon Time Sync on EC2)
                # None left means this clock runs ahead (EC2 would have taken the VM already): begin the dump.
                seen = self._dirtying_seen(inflight.read(self.state.dir), parent, samples)
                if now < reclaim_at and (why_not := _cannot_fit_from(samples, parent, now, reclaim_at, seen)):
                    raise CheckpointError(why_not)
            self._check_checkpointable(pid)  # after the deadline: it scans the job and asks the store
            if base is not None:
                how = f"incremental: dump on {len(base.dirs)} parent image dirs ({on}; {why})"
            else:
                how = f"full dump: {on.removeprefix('a fresh chain: ') if tracked else why}"
            log.info("final dump %s: %s", checkpoint, how)
            # Streamed or not, CRIU writes the images here: in memory when they fit, refused before the freeze
            # when they fit nowhere.
            with (
                scratch_room.dump_scratch(
                    self.scratch_dir, self.memory_scratch_dir, pid, gpu_bytes=self._gpu_bytes
                ) as room,
                _scratch(room[0] / checkpoint) as scratch,
            ):
                outcome = self._take_final_into(
                    scratch, checkpoint, generation, (pid, start_time), parent, base=base, started=started
                )
                return dataclasses.replace(outcome, scratch=room[1], memory_tracking=how)

    def _hopeless(self, reclaim_at: float) -> str:
        """Why a full final dump is given up at the notice without waiting for the periodic dump that holds the
        dump lock (inflight.holding): neither a final dump begun now nor that periodic dump, from when it took the
        lock, can be durable before the reclaim, even at the job's best measured rates (deadline.cannot_fit; a
        commit with figures of its own ends when its rate says, Commit.ends_at). Waiting for its freeze and its
        first figures would only hold the backup's restore of the newest committed checkpoint back, so it is asked
        to stop, and the job is stopped now. "" otherwise: the final dump waits for the lock as before."""
        dump = inflight.holder(self.state.dir)
        if dump is None:
            return ""
        with self.state.locked() as state:
            if state.job_status != "running" or not job_alive(state.job_pid, state.job_start_time):
                return ""
            parent = state.last_checkpoint
            samples = [deadline.Sample.from_json(sample) for sample in state.dump_samples]
        commit = inflight.in_flight(self.state.dir)
        seen = self._dirtying_seen(commit, parent, samples)
        now = time.time()
        if now >= reclaim_at or not (why_not := _cannot_fit_from(samples, parent, now, reclaim_at, seen)):
            return ""
        ends_at = commit.ends_at() if commit is not None and commit.checkpoint_id == dump.checkpoint_id else None
        if ends_at is not None:
            if ends_at <= reclaim_at:  # at its own rate, it commits in time
                return ""
        elif not _cannot_fit_from(samples, parent, dump.since, reclaim_at, seen):  # from when it took the lock
            return ""
        log.warning(
            "periodic dump %s, holding the dump lock for %.1f s, cannot be durable before the reclaim either:"
            " stopping it, and the job",
            dump.checkpoint_id,
            now - dump.since,
        )
        inflight.abandon(self.state.dir, dump.checkpoint_id)
        return why_not

    def _dirtying_seen(
        self, commit: inflight.Commit | None, parent: str | None, samples: list[deadline.Sample]
    ) -> tuple[list[float], float]:
        """How fast the job dirtied its memory since checkpoint `parent`, outside its periodic dumps' samples: the
        rate a periodic commit on top of it measured before it stopped (inflight.py); and the least rate it is
        known to have reached, from the memory changed or taken since `parent` was dumped here, read from the
        sample taken then (memsample.py) at its low end, as a share of the checkpoint's bytes over the time since its
        freeze (0 without one)."""
        seen = []
        if commit is not None and commit.parent == parent and (rate := commit.dirty_per_s()) is not None:
            seen.append(rate)  # a commit with another parent committed: its sample has the rate
        share = memsample.changed_since(self.state.dir, parent) if parent and samples else None
        since = time.time() - deadline.checkpoint_seconds(parent) if parent else 0.0
        if share is not None and since > 0:
            log.info(
                "memory sampled at %s: %d of its %d pages still held, %d of those changed; %.2f of %.2f GiB at least"
                " changed or new since",
                parent,
                share.held,
                share.sampled,
                share.changed,
                share.least_changed() / deadline.GiB,
                share.memory_now / deadline.GiB,
            )
            return seen, min(1.0, share.least_changed() / max(samples[-1].bytes_total, 1)) / since
        return seen, 0.0

    def _commit_in_the_way(self, reclaim_at: float | None) -> Callable[[], None]:
        """While a periodic commit holds the dump lock: asks it to stop once its end, at its rate so far, falls after
        the reclaim (inflight.py)."""
        asked: set[str] = set()

        def check() -> None:
            commit = inflight.in_flight(self.state.dir)
            ends_at = commit.ends_at() if commit is not None else None
            if commit is None or ends_at is None or reclaim_at is None or commit.checkpoint_id in asked:
                return
            if ends_at > reclaim_at:
                log.warning(
                    "periodic commit %s would end %.0f s after the reclaim (%.0f%% of %.2f GiB, %.1f s since %.0f%%):"
                    " stopping it",
                    commit.checkpoint_id,
                    ends_at - reclaim_at,
                    100 * commit.done / max(commit.total, 1),
                    commit.total / deadline.GiB,
                    commit.at - commit.first_at,
                    100 * commit.first_done / max(commit.total, 1),
                )
                inflight.abandon(self.state.dir, commit.checkpoint_id)
                asked.add(commit.checkpoint_id)

        return check

    def _take_final_into(
        self,
        scratch: Path,
        checkpoint: str,
        generation: int,
        job: tuple[int, int],
        parent: str | None,
        *,
        base: tracking.Chain | None,
        started: float,
    ) -> CheckpointOutcome:
        """job: its PID and start time. CRIU leaves it stopped and exits; the job is killed at once, and the kernel
        frees its memory (0.14 s for 2 GiB here: seconds for tens of GiB) while the commit ends, where CRIU's own kill
        waited for that before it exited. The dump is done once the job is confirmed gone, as before: a job that
        exits closes its files (an NFS client writes back then). A GPU job is still killed by CRIU, after its CUDA
        plugin's own end of the dump."""
        pid, start_time = job
        meta = self._meta(checkpoint, generation, "final", parent, pid)
        images, logs = scratch / "images", scratch / "logs"
        images.mkdir(parents=True, exist_ok=True)
        logs.mkdir(parents=True, exist_ok=True)
        prev = tracking.link_target(images, base.top()) if base else None
        inherited = base.files(shift=1) if base else {}
        # The job is frozen from here and killed when CRIU is done; its files no longer change, so they are
        # read where they are, once CRIU is done (its link remaps are files too).
        with self._at_freeze(scratch, pid, snapshot=None) as at_freeze:
            stopped = self._plugin_dir is None
            argv = self.criu.dump_argv(
                pid,
                images,
                logs,
                leave_running=False,
                leave_stopped=stopped,
                prev_images_dir=prev,
                action_script=at_freeze.script,
                libdir=self._plugin_dir,
            )
            dump = self.criu.start_dump(argv)
            extra = _AfterDump(lambda: self._carried(scratch, self.workdir, copied=None))
            try:
                result, frozen = self._ship_final(
                    dump,
                    meta,
                    extra,
                    started=started,
                    at_freeze=at_freeze,
                    inherited=inherited,
                    dumped=(lambda: stop_job(pid, start_time, timeout_s=0)) if stopped else None,
                )
            except CheckpointError as error:
                if base is not None and error.log:  # CRIU failed (its log came with it), not the store
                    raise _IncrementalFailed(error) from error
                raise
        if stopped and not stop_job(pid, start_time):
            raise CheckpointError("the job outlived SIGKILL after its final dump: it is not known to be gone")
        return self._committed(meta, result, time.monotonic() - started, frozen)

    def _ship_final(
        self,
        dump: subprocess.Popen[bytes],
        meta: CheckpointMeta,
        extra: Mapping[str, Path],
        *,
        started: float,
        at_freeze: _AtFreeze,
        inherited: Mapping[str, tuple[str, Path]] | None = None,
        dumped: Callable[[], object] | None = None,
    ) -> tuple[CommitResult, float]:
        """The final dump's images to the store, read as CRIU writes them (stream) or after; and the frozen time.
        dumped: called once CRIU has exited with the job dumped (and left stopped)."""
        images, logs = at_freeze.scratch / "images", at_freeze.scratch / "logs"
        chain = _inheriting(inherited or {})
        try:
            if self.final_mode == "stream":
                watch = _CriuWatch(self.criu, dump, logs, dumped)
                try:
                    result = self.store.commit(images, meta, extra_files=extra, still_writing=watch, **chain)
                except (CriuError, CheckpointError):
                    raise
                except Exception as error:
                    log.warning("streaming the final dump failed (%s); shipping it from local scratch", error)
                    self._finish(dump, logs)
                    if dumped is not None:
                        dumped()
                    result = self.store.commit(images, meta, extra_files=extra, **chain)
                else:
                    self._finish(dump, logs)
                # Frozen until CRIU exited, not until the upload that overlapped it finished.
                return result, (watch.exited_at or time.monotonic()) - started
            self._finish(dump, logs)
            frozen = time.monotonic() - started
            if dumped is not None:
                dumped()
            return self.store.commit(images, meta, extra_files=extra, **chain), frozen
        except CriuError as error:
            at_freeze.raise_own_error()
            raise CheckpointError.of(error, logs / "dump.log") from error

    def _finish(self, dump: subprocess.Popen[bytes], logs: Path) -> None:
        self.criu.finish_dump(dump, logs)

    def _check_checkpointable(self, pid: int) -> None:
        """Before freezing the job: CRIU would refuse it, its files would not fit, or the images have nowhere to go."""
        problem = checkpointable_problem(pid)
        if problem:
            raise CheckpointError(problem)
        try:
            self._gpus = self.check_gpus(scratch_room.job_tree(pid), self.criu)
        except gpu.GpuUnsupported as error:
            raise CheckpointError(str(error)) from error
        problem = mounts.layout_problem(scratch_room.job_tree(pid))
        if problem:
            raise CheckpointError(problem)
        self._scan = carry.scan_job(pid)
        problem = carry.unsupported_problem(self._scan) or carry.vm_bound_listeners(self._scan, self.tcp)
        if problem:
            raise CheckpointError(problem)
        for path, use in self._scan.files.items():
            if self._layout.place(path, use) == "excluded":
                raise CheckpointError(_agent_own(path))
        problem = carry.too_big(carry.local_inventory(self._layout, self._scan), self.local_files_limit_mb << 20)
        if problem:
            raise CheckpointError(problem)
        self.store.check()

    @property
    def _plugin_dir(self) -> Path | None:
        return self._gpus.plugin_dir if self._gpus else None

    @property
    def _gpu_bytes(self) -> int:
        return (self._gpus.device_memory_bytes or 0) if self._gpus else 0

    @property
    def _layout(self) -> Layout:
        assert self.layout is not None  # set in __post_init__
        return self.layout

    def _at_freeze(self, scratch: Path, pid: int, snapshot: Path | None) -> _AtFreeze:
        """What runs while CRIU holds the job frozen after its dump: the work dir copy (periodic), then, in the agent,
        the record of what the job holds and the copy of its VM-local files (periodic: final dumps read them later)."""
        scratch.mkdir(parents=True, exist_ok=True)
        copy_to = scratch / "carried" if snapshot is not None else None

        def record() -> None:
            scan = carry.scan_job(pid)
            entries = carry.local_inventory(self._layout, scan)
            if copy_to is not None:
                carry.copy_files(entries, copy_to)
            frozen = {
                "scan": scan.to_json(),
                "entries": [e.to_json() for e in entries],
                "mount_points": mounts.workdir_mount_points(scratch_room.job_tree(pid), str(self.workdir)),
                "mounts": mounts.job_mounts(pid),
            }
            (scratch / "frozen.json").write_text(json.dumps(frozen))

        lines = []
        if snapshot is not None:
            lines.append(f"mkdir -p {shlex.quote(str(snapshot))} || exit 1")
            lines.append(
                f"cp -a --reflink=auto {shlex.quote(str(self.workdir))}/. {shlex.quote(str(snapshot))}/ || exit 1"
            )
        return _AtFreeze(scratch, record, lines)

    def _restore_finds(self, path: str, place: str, workdir_root: Path, carried: set[str]) -> bool:
        if place == "workdir":
            return path == str(self.workdir) or (workdir_root / Path(path).relative_to(self.workdir)).exists()
        if place in ("local", "other"):
            return path in carried
        if place == "storage":
            return os.path.exists(path)
        return True  # kernel objects: CRIU restores them itself

    def _carried(self, scratch: Path, workdir_root: Path, copied: Path | None) -> dict[str, Path]:
        """The files a checkpoint holds besides CRIU's images, once the job's state is frozen in them; refuses a
        checkpoint that restore would find incomplete."""
        try:
            frozen = json.loads((scratch / "frozen.json").read_text())
        except (OSError, ValueError) as error:
            raise CheckpointError(f"the post-dump record of the job's files is missing or broken: {error}") from error
        scan = JobScan.from_json(frozen["scan"])
        entries = [Entry.from_json(e) for e in frozen["entries"]]
        layout = self._layout
        files = workdir_files(self.workdir, workdir_root)
        carried = {e.path for e in entries}
        images = []
        for path, use in sorted(scan.files.items()):
            place = layout.place(path, use)
            if place == "excluded":
                raise CheckpointError(_agent_own(path))
            if place == "image":
                with contextlib.suppress(IsADirectoryError):
                    images.append(carry.identity(path))
            elif not self._restore_finds(path, place, workdir_root, carried):
                raise CheckpointError(
                    f"the checkpoint would not restore: the job holds {path} ({place}), which it does not carry"
                )
        for entry in entries:
            if entry.kind == "file":
                name = carry.stored_name(entry.path)
                files[name] = copied / name if copied else Path(entry.path)
        record = {
            "format": 1,
            "layout": layout.to_json(),
            "scan": scan.to_json(),
            "entries": [e.to_json() for e in entries],
            "workdir_mount_points": frozen.get("mount_points", []),
            "image_files": images,
            # The addresses a restore may keep on its loopback for the job's sockets (aliases.py), and no other.
            "vm_addresses": aliases.vm_addresses(self.state.dir),
            # The VM's mounts the job saw, each of which a restore must find (restore.check_mounts).
            "mounts": frozen.get("mounts", []),
        }
        (scratch / carry.RECORD).write_text(json.dumps(record))
        files[carry.RECORD] = scratch / carry.RECORD
        return files

    def _new_id(self, generation: int, kind: str) -> str:
        return checkpoint_id(int(self.clock() * 1000), generation, kind, self.sequence)

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
            gpu=self._gpus.record() if self._gpus else None,
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
            gpu_memory_bytes=meta.gpu.get("device_memory_bytes") if meta.gpu else None,
            parent=meta.parent,
            criu_seconds=round(frozen, 3),
            store_seconds=round(result.seconds, 3),
            bytes_new=result.bytes_new,
            bytes_changed=result.bytes_changed,
            read_seconds=round(result.read_seconds, 3),
            hash_seconds=round(result.hash_seconds, 3),
            compress_seconds=round(result.compress_seconds, 3),
            upload_seconds=round(result.upload_seconds, 3),
        )


def _cannot_fit_from(
    samples: list[deadline.Sample], parent: str | None, begun: float, reclaim_at: float, seen: tuple[list[float], float]
) -> str:
    """deadline.cannot_fit for a full dump begun at `begun` (unix time) on top of `parent`, EC2 reclaiming the VM
    at `reclaim_at`; `seen`: the dirtying the job showed outside its samples (Checkpointer._dirtying_seen)."""
    since = begun - deadline.checkpoint_seconds(parent) if parent else 0.0
    rates, at_least = seen
    return deadline.cannot_fit(samples, since, reclaim_at - begun, dirty_seen=rates, dirty_at_least=at_least)


@contextlib.contextmanager
def _scratch(path: Path) -> Iterator[Path]:
    """A checkpoint's local scratch: removed once committed; after a failure only CRIU's logs stay, for diagnosis."""
    try:
        yield path
    except BaseException:
        for name in ("images", "workdir", "carried"):
            shutil.rmtree(path / name, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)


class _PreDumpFailed(Exception):
    """CRIU's pre-dump failed: the periodic checkpoint falls back to a full dump."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


class _IncrementalFailed(Exception):
    """CRIU failed the incremental final dump: the final dump is taken again, in full."""

    def __init__(self, error: CheckpointError) -> None:
        super().__init__(str(error))
        self.error = error


def _inheriting(inherited: Mapping[str, tuple[str, Path]]) -> dict[str, Any]:
    """The store's `inherited` argument, passed only when there is something to inherit."""
    return {"inherited": inherited} if inherited else {}


def _frozen(log_dir: Path, wall: float) -> float:
    """How long the (pre-)dump that just wrote its stats into log_dir held the job frozen, by CRIU's own stats;
    else how long CRIU ran. Read at once: the next one in the same directory replaces them."""
    stats = dump_stats(log_dir)
    (log_dir / "stats-dump.img").unlink(missing_ok=True)
    return stats.frozen_seconds if stats is not None else wall


def _agent_own(path: str) -> str:
    return f"the job cannot be checkpointed: it holds {path}, inside the agent's own directories, which are not carried"


def _not_running(status: str, exit_code: int | None) -> str:
    if status == "exited":
        return f"the job is not running: it exited with code {exit_code}"
    if status == "checkpointed":
        return "the job is not running: its final dump was taken"
    if status == "stopped":
        return "the job is not running: it was stopped here after its final dump failed"
    if status == "replaced":
        return "the job's share here was ended for the job's restore"
    return "the job is not running on this VM"


@dataclass
class _CriuWatch:
    """`still_writing` for the store: True while CRIU writes; raises if CRIU failed, so nothing is committed."""

    criu: Criu
    dump: subprocess.Popen[bytes]
    logs: Path
    dumped: Callable[[], object] | None = None  # called once, when CRIU has exited with the job dumped
    exited_at: float | None = None

    def __call__(self) -> bool:
        if self.dump.poll() is None:
            return True
        if self.exited_at is None:
            self.exited_at = time.monotonic()
            if self.dump.returncode == 0 and self.dumped is not None:
                self.dumped()
        if self.dump.returncode != 0:
            self.criu.finish_dump(self.dump, self.logs)
        return False


class _AfterDump(Mapping[str, Path]):
    """The final dump's extra files, listed on first use: the store reads them only after CRIU has exited."""

    def __init__(self, build: Callable[[], dict[str, Path]]) -> None:
        self._build = build
        self._files: dict[str, Path] | None = None

    def _get(self) -> dict[str, Path]:
        if self._files is None:
            self._files = self._build()
        return self._files

    def __getitem__(self, key: str) -> Path:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


class _AtFreeze:
    """Runs `work` in the agent while CRIU holds the job frozen after its dump (post-dump).

    CRIU's action script hands over through one FIFO and waits on another for the answer, so the work runs in
    the agent's own interpreter, already started, and the job stays frozen only as long as the work takes. A
    failed work answers "fail": CRIU then fails the dump and lets the job run on.
    """

    def __init__(self, scratch: Path, work: Callable[[], None], before: list[str]) -> None:
        self.scratch = scratch
        self._ready, self._answer = scratch / "frozen.fifo", scratch / "thawed.fifo"
        for fifo in (self._ready, self._answer):
            fifo.unlink(missing_ok=True)
            os.mkfifo(fifo, 0o600)
        self._work = work
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="spotcr-at-freeze", daemon=True)
        self.script = scratch / "post-dump.sh"
        ready, answer = shlex.quote(str(self._ready)), shlex.quote(str(self._answer))
        lines = [
            "#!/bin/sh",
            '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0',
            *before,
            f"printf x > {ready} || exit 1",
            f"read answer < {answer} || exit 1",
            '[ "$answer" = ok ]',
        ]
        self.script.write_text("\n".join(lines) + "\n")
        self.script.chmod(0o755)

    def __enter__(self) -> _AtFreeze:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def raise_own_error(self) -> None:
        """After CRIU failed: when the work at the freeze failed, that is the cause to report."""
        if self.error is not None:
            raise CheckpointError(f"recording the job's files at the freeze failed: {self.error}") from self.error

    def _serve(self) -> None:
        """Wait for the script, do the work, answer. The script always gets an answer once it asked (CRIU would
        wait for it forever): anything that goes wrong here is this dump's error and the answer is "fail"."""
        try:
            if not self._wait_for_script():
                return  # CRIU ended without reaching post-dump
            self._work()
            answer = b"ok\n"
        except BaseException as error:
            log.error("the work at the freeze failed: %s", error, exc_info=True)
            self.error = error
            answer = b"fail\n"
        self._answer_script(answer)

    def _wait_for_script(self) -> bool:
        fd = os.open(self._ready, os.O_RDONLY | os.O_NONBLOCK)
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            while not self._stop.is_set():
                if not poller.poll(50):
                    continue
                try:
                    if os.read(fd, 1):
                        return True
                except BlockingIOError:
                    continue
            return False
        finally:
            os.close(fd)

    def _answer_script(self, answer: bytes) -> None:
        while not self._stop.is_set():
            try:
                out = os.open(self._answer, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as error:
                if error.errno != errno.ENXIO:  # ENXIO: the script has not opened its end yet
                    log.error("the freeze's answer cannot reach CRIU's action script: %s", error)
                    self.error = self.error or error
                    return
                time.sleep(0.001)
                continue
            try:
                os.write(out, answer)
            finally:
                os.close(out)
            return
