"""The agent's operations, shared by the daemon and the commands SSM runs: each one fenced, logged, evented."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spotcr_contracts import tags
from spotcr_contracts.events import (
    UNKNOWN_EXIT_CODE,
    AgentEvent,
    AgentReady,
    BootstrapFailed,
    CheckpointCompleted,
    CheckpointFailed,
    FinalDumpAtRisk,
    JobExited,
    JobStarted,
    RestoreCompleted,
    RestoreFailed,
)
from spotcr_contracts.layout import AGENT_LOGS
from spotcr_contracts.results import StatusResult

from . import agentlog, aliases, deadline, launch, nodeport, nodes, result, storage
from .carry import Layout
from .checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointOutcome,
    Store,
    keep_criu_log,
    kept_criu_logs,
)
from .config import AgentConfig
from .criu import Criu
from .events import Publisher, now_iso
from .host import HostInfo, read_host
from .restore import STOPPED_HERE, RestoreError, RestoreOutcome, Restorer
from .runner import JobError, JobFiles, job_alive, start_job, stop_job
from .state import AgentState, StaleGeneration, StateFile, admit, exclusive
from .store.backends import Backend
from .store.store import CheckpointStore, other_runs

log = logging.getLogger(__name__)

LOG_TAIL_CHARS = 4000  # an event's log tail: EventBridge entries stay far below their 256 KiB limit
COMMAND_NOT_STARTED = 127  # as a shell reports a command it could not run
# Node 0 of a job over several VMs: how long a failure waits while another node does not answer (Agent._exit_held):
# past the time EC2 takes to say an instance went and the recovery to fence the job.
EXIT_HOLD_S = 120.0


class WrongJob(ValueError):
    """A command for a job this VM does not run."""


@dataclass
class Agent:
    config: AgentConfig
    publisher: Publisher
    job_env: dict[str, str]
    criu: Criu = field(default_factory=Criu)
    store_factory: Callable[[AgentConfig], Store] = storage.open_store
    result_backend: Callable[[AgentConfig, Backend], Backend] = storage.result_backend
    _store: Store | None = None
    _store_run: str = ""
    _launchers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _exit_held_since: float | None = None  # node 0: when a failure first waited for an unreachable node

    @property
    def state(self) -> StateFile:
        return StateFile(self.config.state_dir)

    def run_id(self) -> str:
        """The run of the job this VM serves: the one it started or restored, else the spotcr:run it booted with."""
        with self.state.locked() as state:
            return state.run_id or self.config.run_id

    def store(self) -> Store:
        """The store of this VM's run: a name reused for a new run never sees the earlier run's checkpoints."""
        run_id = self.run_id()
        if self._store is None or self._store_run != run_id:
            self._store = self.store_factory(dataclasses.replace(self.config, run_id=run_id))
            self._store_run = run_id
        return self._store

    def host(self) -> HostInfo:
        return read_host(self.criu.version())

    def check_job(self, job_id: str, run_id: str = "") -> None:
        """Refuse a command for another job, or for another run of this job's name (a command without a run id
        is one sent by hand, or by the release step, which is harmless for any run)."""
        if job_id != self.config.job_id:
            raise WrongJob(f"this VM runs job {self.config.job_id!r}, not {job_id!r}")
        served = self.run_id()
        if run_id and run_id != served:
            raise WrongJob(f"this VM serves run {served or 'none'} of job {job_id!r}, not run {run_id}")

    def served_generation(self) -> int:
        with self.state.locked() as state:
            return max(state.generation, self.config.generation)

    def emit(self, cls: type[AgentEvent], generation: int, **fields: Any) -> None:
        config = self.config
        event = cls(
            job_id=config.job_id,
            instance_id=config.instance_id,
            generation=generation,
            at=now_iso(),
            run_id=self.run_id(),
            event_id=uuid.uuid4().hex,
            **fields,
        )
        self.publisher.publish(event)

    def ready(self) -> None:
        """The daemon starts (again): it serves the newest generation it admitted, which a bump may have raised
        above the tag it booted with; a restart after a bump is not a stale command."""
        with self.state.locked() as state:
            admit(state, max(state.generation, self.config.generation))
            state.job_id = self.config.job_id
            generation = state.generation
        self.emit(AgentReady, generation, mode=self.config.mode)

    def fence(self, generation: int, sequence: int | None = None) -> int | None:
        """Refuse a stale generation before touching the job or its storage. Returns the sequence a dump takes: the
        order's `sequence`, kept as the highest this VM was given (a dump or restore order's), or for a dump
        nobody ordered that highest one (None on a VM never given one): commands.checkpoint_order."""
        with self.state.locked() as state:
            admit(state, generation)
            if sequence is not None:
                state.sequence = max(state.sequence or 0, sequence)
                return sequence
            return state.sequence

    def layout(self) -> Layout:
        """Where the job's files live on this VM: what a checkpoint carries, checks, or leaves to storage."""
        config = self.config
        return Layout(
            workdir=str(config.workdir),
            storage=str(config.mount_point) if config.storage != "s3" else "",
            local_dirs=config.local_dirs,
            image_dirs=config.image_dirs,
            excluded=(str(config.state_dir), str(config.scratch_dir)),
        )

    def checkpoint(
        self,
        kind: str,
        generation: int,
        sequence: int | None = None,
        reclaim_at: Callable[[], float | None] | None = None,
        on_resumed: Callable[[], None] = lambda: None,
    ) -> CheckpointOutcome:
        """Take a checkpoint; a job that has ended is reported (JobExited, again if need be) instead. `sequence` is
        the control plane's for an ordered dump, None for one nobody ordered (the final dump on the IMDS notice),
        which takes the highest sequence this VM was given (fence). `reclaim_at` says when EC2 takes the VM back (the
        notice's time), for a final dump, which is not begun when it cannot fit (Checkpointer.reclaim_at).
        `on_resumed` is called once a periodic dump's job runs again, before the commit (Checkpointer.on_resumed).

        Every dump order after the job's end re-sends its exit, so a lost or unrecorded JobExited is healed by
        the scheduler's next order: the control plane records the end once and stops ordering dumps."""
        sequence = self.fence(generation, sequence)
        reported = self.watch_job()
        with self.state.locked() as state:
            exited = state.job_status == "exited"
            exit_code = state.exit_code
            stored = {
                "result": state.result,
                "result_error": state.result_error,
                "result_missing": state.result_missing,
            }
        if exited and exit_code is not None:
            if reported is None:
                self.emit(JobExited, generation, exit_code=exit_code, **stored)
            if kind == "final" and exit_code == UNKNOWN_EXIT_CODE:
                reason = "the job's processes are gone with no exit code recorded (the VM stopped under it)"
                self.emit(CheckpointFailed, generation, kind=kind, reason=reason)
            raise CheckpointError(f"the job is not running: it exited with code {exit_code}")
        try:
            checkpointer = Checkpointer(
                job_id=self.config.job_id,
                workdir=self.config.workdir,
                scratch_dir=self.config.scratch_dir,
                state=self.state,
                store=self.store(),
                criu=dataclasses.replace(self.criu, ghost_limit_mb=self.config.ghost_limit_mb),
                host=self.host,
                final_mode=self.config.final_dump,
                keep_checkpoints=self.config.keep_checkpoints,
                layout=self.layout(),
                local_files_limit_mb=self.config.local_files_limit_mb,
                tcp=self.config.tcp,
                memory_scratch_dir=self.config.state_dir / "memory-scratch" if self.config.memory_scratch else None,
                sequence=sequence,
                reclaim_at=reclaim_at if kind == "final" else None,
                on_resumed=on_resumed,
            )
            outcome = checkpointer.checkpoint(kind, generation)
        except Exception as error:
            log.error("%s checkpoint failed: %s", kind, error)
            if not _is_fencing(error):
                tail, kept = "", ""
                if isinstance(error, CheckpointError) and error.log:
                    tail, kept = error.log_tail[-LOG_TAIL_CHARS:], self._keep_log(f"dump-{kind}", "", error.log)
                # A failed final dump stopped the job for good (Checkpointer._stop_for_good): say it is gone.
                stopped = kind == "final" and self.state.read().job_status == "stopped"
                self.emit(
                    CheckpointFailed,
                    generation,
                    kind=kind,
                    reason=str(error)[:1000],
                    log_tail=tail,
                    criu_log=kept,
                    job_stopped=stopped,
                )
            raise
        # A final dump this VM took on its own notice is reported again to the generation that now asks for it.
        if not outcome.already_taken or generation > outcome.generation:
            log.info(
                "checkpoint %s committed in %.2f s (frozen %.2f s); %s",
                outcome.checkpoint_id,
                outcome.seconds,
                outcome.frozen_seconds,
                outcome.memory_tracking,
            )
            plan = self._plan(outcome) if outcome.kind == "periodic" else None
            if plan is not None:
                outcome = dataclasses.replace(
                    outcome,
                    predicted_final_seconds=plan.predicted_final_s,
                    next_interval_s=plan.interval_s,
                    deadline_risk="" if plan.fits else plan.reason[:1000],
                )
            self.emit(
                CheckpointCompleted,
                generation,
                checkpoint_id=outcome.checkpoint_id,
                kind=outcome.kind,
                seconds=outcome.seconds,
                frozen_seconds=outcome.frozen_seconds,
                bytes_total=outcome.bytes_total,
                bytes_uploaded=outcome.bytes_uploaded,
                memory_tracking=outcome.memory_tracking,
                predicted_final_seconds=outcome.predicted_final_seconds,
                next_interval_s=outcome.next_interval_s,
                deadline_risk=outcome.deadline_risk,
            )
            if plan is not None and not plan.fits:
                self.emit(
                    FinalDumpAtRisk,
                    generation,
                    checkpoint_id=outcome.checkpoint_id,
                    predicted_final_seconds=plan.predicted_final_s,
                    budget_seconds=plan.budget_s,
                    interval_s=plan.interval_s,
                    reason=plan.reason[:1000],
                )
        return outcome

    def _plan(self, outcome: CheckpointOutcome) -> deadline.Plan | None:
        """Record a periodic dump's figures and plan the interval to the next one (deadline.py)."""
        with self.state.locked() as state:
            previous = state.dump_samples[-1]["checkpoint_id"] if state.dump_samples else None
            # The dirty rate only between consecutive periodic dumps of this run: a restored parent's age counts
            # time the job was stopped.
            consecutive = outcome.parent is not None and outcome.parent == previous
            since = deadline.since_parent(outcome.checkpoint_id, outcome.parent) if consecutive else 0.0
            sample = deadline.Sample.of(outcome, since)
            state.dump_samples = deadline.remember(state.dump_samples, sample)
            samples = [deadline.Sample.from_json(s) for s in state.dump_samples]
        plan = deadline.plan(
            samples,
            interval_s=self.config.interval_s,
            notice_s=self.config.notice_s,
            margin_s=self.config.deadline_margin_s,
        )
        if plan is not None and plan.reason:
            (log.info if plan.fits else log.warning)("deadline: %s", plan.reason)
        return plan

    def mount_handed_over(self) -> None:
        """A backup's EBS volume reaches it only with its restore (storage.handed_over_at_restore): mounted before
        anything reads the store, once its device appears; a storage already mounted is used as is."""
        if storage.handed_over_at_restore(self.config):
            storage.prepare(self.config)

    def restore(
        self,
        generation: int,
        checkpoint_id: str | None = None,
        attempt: str = "",
        sequence: int | None = None,
        *,
        exact: bool = False,
    ) -> RestoreOutcome:
        """Restore the job; the answer (RestoreCompleted or RestoreFailed) names the workflow's `attempt`. The
        restore order's `sequence` ranks every dump this VM takes after the replaced instance's (fence). `exact`:
        only `checkpoint_id`, never an older one nor a start from scratch (a node's part of a job over several VMs)."""
        self.fence(generation, sequence)
        with self.state.locked() as state:
            state.run_id = state.run_id or self.config.run_id  # a backup serves the run it was launched for
        try:
            self.mount_handed_over()
            restorer = Restorer(
                job_id=self.config.job_id,
                workdir=self.config.workdir,
                scratch_dir=self.config.scratch_dir,
                state=self.state,
                store=self.store(),
                criu=self.criu,
                host=self.host,
                tcp=self.config.tcp,
                lazy=self.config.lazy_restore,
            )
            try:
                outcome = restorer.restore(generation, checkpoint_id, exact=exact)
            except RestoreError as error:
                if exact or not (error.nothing_restorable and self.config.restart_from_scratch):
                    raise
                outcome = self._start_from_scratch(generation, str(error))
        except Exception as error:
            log.error("restore failed: %s", error)
            if not _is_fencing(error):
                failed = getattr(error, "checkpoint_id", None) or checkpoint_id or ""
                tail, kept = "", ""
                if isinstance(error, RestoreError):
                    tail = error.log_tail[-LOG_TAIL_CHARS:]
                    for candidate, text in error.logs.items():
                        kept = self._keep_log("restore", candidate, text) or kept
                self.emit(
                    RestoreFailed,
                    generation,
                    checkpoint_id=failed,
                    reason=str(error)[:1000],
                    log_tail=tail,
                    criu_log=kept,
                    attempt=attempt,
                )
            raise
        self.emit(
            RestoreCompleted,
            generation,
            attempt=attempt,
            checkpoint_id=outcome.checkpoint_id,
            seconds=outcome.seconds,
            pid=outcome.pid,
            skipped=outcome.skipped[:1000],
            running_seconds=outcome.running_seconds,
            lazy=outcome.lazy,
        )
        return outcome

    def _keep_log(self, action: str, checkpoint: str, text: str) -> str:
        """Keep a failed CRIU run's log in the job's storage; best effort: a broken store must not hide the error."""
        try:
            store = self.store()
            kept = keep_criu_log(store, action, checkpoint, text)
            keep_criu_log(store, action, checkpoint, agentlog.RECENT.text(), kind=AGENT_LOGS)
            return kept
        except Exception as error:
            log.warning("could not keep CRIU's log in the job's storage: %s", error)
            return ""

    def _start_from_scratch(self, generation: int, why: str) -> RestoreOutcome:
        """No checkpoint can ever be restored: the job starts over from the beginning (the user is told)."""
        started = time.monotonic()
        log.warning("no checkpoint to restore (%s); starting the job from the beginning", why)
        with exclusive(self.config.state_dir / "dump.lock"), self.state.locked() as state:
            admit(state, generation)
            if state.job_status == "running" and job_alive(state.job_pid, state.job_start_time):
                raise RestoreError(f"the job already runs on this VM (pid {state.job_pid}); it never runs twice")
            if state.job_status == "stopped":
                raise RestoreError(STOPPED_HERE)
            shutil.rmtree(self.config.workdir, ignore_errors=True)  # what a failed restore may have placed
            aliases.release(self.config.state_dir)
            env = {**self.job_env, **self._launcher_env(), **self.config.env}
            job = start_job(self.config.command, self.config.workdir, env)
            if job.launcher is not None:
                self._launchers.append(job.launcher)
            state.job_id = self.config.job_id
            state.job_pid, state.job_start_time = job.pid, job.start_time
            state.job_status, state.exit_code, state.last_checkpoint = "running", None, None
            state.result, state.result_error, state.result_missing = "", "", ""
            state.final_dumps = {k: v for k, v in state.final_dumps.items() if int(k) > generation}
        return RestoreOutcome(
            checkpoint_id="",
            generation=generation,
            seconds=round(time.monotonic() - started, 3),
            pid=job.pid,
            skipped=f"{why}: started from the beginning"[:1000],
        )

    def release(self, generation: int) -> str:
        with exclusive(self.config.state_dir / "dump.lock"), self.state.locked() as state:
            admit(state, generation)
            if state.job_status == "running" and job_alive(state.job_pid, state.job_start_time):
                raise RuntimeError("the job still runs here: take a final dump before releasing its storage")
            return storage.release(self.config)

    def status(self) -> StatusResult:
        with self.state.locked() as state:
            alive = state.job_status == "running" and job_alive(state.job_pid, state.job_start_time)
            status = StatusResult(
                job_id=self.config.job_id,
                run_id=state.run_id or self.config.run_id,
                instance_id=self.config.instance_id,
                storage=self.config.storage,
                mode=self.config.mode,
                generation=max(state.generation, self.config.generation),
                job_status=state.job_status,
                job_pid=state.job_pid,
                job_alive=alive,
                exit_code=state.exit_code,
                result=state.result,
                result_error=state.result_error,
                result_missing=state.result_missing,
                last_checkpoint=state.last_checkpoint,
                final_dumps={k: v.status for k, v in state.final_dumps.items()},
            )
        try:
            return dataclasses.replace(status, criu_logs=kept_criu_logs(self.store()))
        except Exception as error:
            return dataclasses.replace(status, criu_logs_error=f"the job's storage cannot be read: {error}")

    def start_job(self, run_id: str = "", share: tuple[str, ...] = ()) -> int | None:
        """Start the job unless this VM already started it (a job never runs twice); returns its PID.

        `run_id` is the run the control plane registered this VM for (its spotcr:run tag; the config's when
        empty): the daemon calls this only once that tag is on the instance, never on a refused one. `share`: on
        a node other than node 0 of a job over several VMs, the command node 0's launcher asked for (launch.py),
        started as this node's job instead of the job's own command.

        A job that cannot start (a missing program, an unusable work dir) is recorded as ended here and reported
        as BootstrapFailed with the reason, so the control plane marks it FAILED instead of leaving it PENDING."""
        with self.state.locked() as state:
            admit(state, max(state.generation, self.config.generation))
            generation = state.generation
            if state.job_status != "none":
                log.info("the job was already started here (%s); not starting it again", state.job_status)
                return None
            state.run_id = run_id or state.run_id or self.config.run_id
            env = {**self.job_env, **self._launcher_env(), **self.config.env}
            try:
                job = start_job(share or self.config.command, self.config.workdir, env)
            except (JobError, OSError) as error:
                state.job_id = self.config.job_id
                state.job_status, state.exit_code = "exited", COMMAND_NOT_STARTED
                reason = str(error)
                state.result_error = f"the job never started: {reason}"[:1000]  # no work to keep
            else:
                reason = ""
                if job.launcher is not None:
                    self._launchers.append(job.launcher)
                state.job_id = self.config.job_id
                state.job_pid, state.job_start_time, state.job_status = job.pid, job.start_time, "running"
        if reason:
            log.error("job %s could not start: %s", self.config.job_id, reason)
            self.emit(BootstrapFailed, generation, step="start-job", reason=reason[:1000])
            return None
        log.info("job %s started as pid %d", self.config.job_id, job.pid)
        self.emit(JobStarted, generation, pid=job.pid)
        return job.pid

    def end_share_for_restore(self, generation: int) -> bool:
        """A node of a job over several VMs whose share still runs when the job's restore is ordered (another node
        was lost without a warning, so no final dump ended this one): the share is killed here, its whole tree
        confirmed gone, its connections destroyed (nodes.drop_connections), and recorded as "replaced", never
        reported as the job's exit, since its restore follows at once. True when a share was ended; False when none
        ran (a final dump ended it, or it never started).

        A share that ended by itself (MPI ends the others when a node goes) and whose end was not reported yet (node
        0 holds a failure: Agent._exit_held) is "replaced" too: reported now, at the generation just admitted, its
        failure would end the job that this restore brings back."""
        with exclusive(self.config.state_dir / "dump.lock"), self.state.locked() as state:
            admit(state, generation)
            if state.job_status != "running":
                if self._result_due(state):
                    log.warning(
                        "node %d: the share's unreported exit is replaced by the restore", self.config.node_index
                    )
                    state.job_status = "replaced"
                # Its connections are closing too: CRIU cannot put them back while the kernel holds them.
                nodes.drop_connections(self.config.nodes[self.config.node_index])
                return False
            if job_alive(state.job_pid, state.job_start_time) and not stop_job(state.job_pid, state.job_start_time):
                raise RestoreError(f"the share (pid {state.job_pid}) outlived SIGKILL; it is not known to be gone")
            nodes.drop_connections(self.config.nodes[self.config.node_index])
            log.warning(
                "node %d: the share (pid %d) ended for the job's restore", self.config.node_index, state.job_pid
            )
            state.job_status = "replaced"
            return True

    def _launcher_env(self) -> dict[str, str]:
        """On node 0 of a job over several VMs: what makes `mpiexec` start its processes on every node through
        spotcr-launch (launch.job_env), with the node list in a hosts file it names, and Hydra's own options in a
        config file it names (launch.hydra_options)."""
        config = self.config
        if not config.nodes or config.node_index != 0:
            return {}
        hosts, hydra = config.state_dir / "hosts", config.state_dir / "hydra.conf"
        hosts.write_text("".join(f"{address}\n" for address in config.nodes))
        hydra.write_text(launch.hydra_options(config.nodes[config.node_index]))
        key, launcher = config.launch_key, config.launcher
        return launch.job_env(config.nodes, config.node_index, key, launcher, hosts_file=hosts, hydra_file=hydra)

    def delete_earlier_runs(self) -> list[str]:
        """Old runs are pruned: once this VM started a new run of the job name, the checkpoints of the name's earlier
        runs in this store are deleted, their results kept (each under its run's result/). Nothing restores them
        again: the control plane registers a new run only once the earlier one ended, and a run's checkpoints are
        never seen by another run. Each run goes by CheckpointStore.delete_run (safe against a late commit of it);
        a failure only leaves that run for the next new run to delete. Returns the runs deleted."""
        with self.state.locked() as state:
            run_id = state.run_id if state.job_status != "none" else ""
        if not run_id:
            return []  # this VM never started a run (refused, or a backup waiting to restore)
        deleted = []
        try:
            backend = self.store().backend
            runs = other_runs(backend, self.config.job_id, run_id)
        except Exception as error:
            log.warning("listing the job name's earlier runs failed: %s", error)
            return []
        for other in runs:
            try:
                done = CheckpointStore(backend, self.config.job_id, run_id=other).delete_run()
            except Exception as error:
                log.warning("deleting the checkpoints of the earlier run %s failed: %s", other, error)
                continue
            if done.deleted_checkpoints or done.deleted_chunks or not done.kept:
                deleted.append(other)
                log.info(
                    "the earlier run %s's checkpoints are deleted (%d); its result is kept",
                    other,
                    len(done.deleted_checkpoints),
                )
        return deleted

    def watch_job(self) -> int | None:
        """If the job has ended, record it, commit its work dir as its result and report JobExited with where
        the result is (not after a final dump); returns its exit code when this call reported it.

        The result is committed before JobExited, so the control plane may let go of this VM once it reads the
        event; a commit that fails is reported with its reason instead, and the VM keeps the work dir."""
        self._launchers = [launcher for launcher in self._launchers if launcher.poll() is None]
        with self.state.locked() as state:
            running = state.job_status == "running"
            if running and job_alive(state.job_pid, state.job_start_time):
                self._exit_held_since = None  # a job that runs (again) has no failure held
            elif running:
                final = state.final_dump()
                if final is not None and final.status in ("running", "done"):
                    return None  # CRIU stopped the job for its final dump: it continues on another VM
                code = JobFiles(self.config.workdir).read_exit_code()
                state.exit_code = UNKNOWN_EXIT_CODE if code is None else code
                state.job_status = "exited"
                log.info("job %s exited with code %d", self.config.job_id, state.exit_code)
            if not self._result_due(state):
                return None
            ended_with = state.exit_code
        if self._exit_held(ended_with):  # asks the other nodes: never while holding the state
            return None
        # One commit at a time: the daemon and a dump order's process may both see the end.
        with exclusive(self.config.state_dir / "result.lock"):
            with self.state.locked() as state:
                if not self._result_due(state):
                    return None
                generation, exit_code, ended = state.generation, state.exit_code, (state.job_pid, state.job_start_time)
            assert exit_code is not None  # _result_due
            # Only a success needs its declared files: a failed job's work dir is stored as it is, for its diagnosis.
            missing = result.missing_files(self.config.workdir, self.config.result_files) if exit_code == 0 else []
            if missing:
                error = f"the job ended without its declared result ({tags.RESULT}): missing {', '.join(missing)}"
                location = ""
                log.error("%s; the result is not stored, the VM keeps the work dir", error)
            else:
                location, error = self._commit_result(exit_code, generation)
            with self.state.locked() as state:
                if not self._result_due(state) or (state.job_pid, state.job_start_time) != ended:
                    # A restore brought the job back here while its share's end was committed (a node of a job over
                    # several VMs, ended by MPI when another node went): that end, and its result, are not the job's.
                    log.warning("the job was restored here while its exit was stored: that exit is not reported")
                    return None
                state.result, state.result_error, state.result_missing = location, error, ",".join(missing)
        aliases.release(self.config.state_dir)  # the old VM's address is no longer the job's to shadow
        self.emit(
            JobExited,
            generation,
            exit_code=exit_code,
            result=location,
            result_error=error,
            result_missing=",".join(missing),
        )
        return exit_code

    def _exit_held(self, exit_code: int | None) -> bool:
        """Node 0 of a job over several VMs: a failure while another node's agent does not answer is most likely MPI
        ending the job for that node's loss, which the control plane recovers from the job's checkpoint once EC2
        says the node went. The failure is held (EXIT_HOLD_S at most), so that the recovery's fencing comes before
        it: a restore ordered meanwhile brings the job back, and the failure is never reported."""
        config = self.config
        if not config.nodes or config.node_index != 0 or exit_code == 0:
            return False
        now = time.monotonic()
        self._exit_held_since = self._exit_held_since or now
        if now - self._exit_held_since > EXIT_HOLD_S:
            return False
        key = bytes.fromhex(config.launch_key)
        unreachable = [a for i, a in enumerate(config.nodes) if i and not nodeport.answers(i, a, key)]
        if unreachable:
            log.warning("the job failed while node(s) %s do not answer: its exit waits for their recovery", unreachable)
        return bool(unreachable)

    @staticmethod
    def _result_due(state: AgentState) -> bool:
        """An end this VM recorded whose result was not tried yet."""
        ended = state.job_status == "exited" and state.exit_code is not None
        return ended and not state.result and not state.result_error

    def _commit_result(self, exit_code: int, generation: int) -> tuple[str, str]:
        """(where the result is, ""), or ("", why it is not stored): a failure must not hide the job's end."""
        try:
            backend = self.result_backend(self.config, self.store().backend)
            location = result.commit_result(
                backend, self.config.job_id, self.config.workdir, exit_code, generation, run_id=self.run_id()
            )
        except Exception as error:
            log.error("the job's result could not be stored: %s", error)
            return "", f"{type(error).__name__}: {error}"[:1000]
        log.info("the job's result is stored at %s", location)
        return location, ""


def _is_fencing(error: Exception) -> bool:
    return isinstance(error, StaleGeneration)


def base_job_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """What a job inherits from the agent's environment: enough to find programs and speak a locale."""
    keep = ("PATH", "LANG", "LC_ALL", "TZ", "HOME", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")
    env = {key: environ[key] for key in keep if key in environ}
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env.setdefault("HOME", "/root")
    return env
