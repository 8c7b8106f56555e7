"""Simulated agents: the VMs of a wave that do not exist, answering the control plane as the real agent would.

A wave of a hundred jobs does not fit one machine as real VMs. For the VMs that are not real, a `SimulatedAgents`
watches the ControlPlane's in-process moto (rehearsal/controlplane.py) and plays each agent's part through the
control plane's own paths, after the delays a real VM takes:
- an interruption notice in a VM's IMDS (`notice`) is seen at the VM's next poll (every `notice_poll_s`, the
  real agent's spotcr_agent.daemon.POLL_S, at a phase of its own), which begins the final dump at once: the agent
  reports it (CheckpointCompleted) `dump_s` later;
- a final-dump command sent to a job's instance is answered `dump_s` later (one result line on stdout, SSM's
  status-change event, the agent's CheckpointCompleted), or, where the notice began the dump, once that dump is
  in, with its checkpoint (one dump either way, as the real agent answers);
- a backup instance spotcr launched reports AgentReady in restore mode `boot_s` after its launch;
- a restore command is answered `restore_s` later (its result line, SSM's event, the agent's RestoreCompleted).
Every event goes through EventBridge to Lambda's event queue (`events`: asynchronous, retried as Lambda retries).
Like a real agent, it knows its run and the restore attempt it answers (from its tags and the command), so it asks
AWS nothing: under AWS's rate limits (rehearsal/localaws/throttle.py) only the control plane's calls count. It also
notes when each of these happened, per job, for the benchmark's figures.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from moto.ec2.models import ec2_backends
from moto.ssm.models import Command as MotoCommand
from spotcr_agent.daemon import POLL_S
from spotcr_contracts import commands, events
from spotcr_contracts import tags as tag_names

from rehearsal import controlplane
from rehearsal.localaws import ACCOUNT, REGION, awslambda, wrap

LIVE_STATES = {"pending", "running"}


@dataclass(frozen=True)
class AgentTiming:
    """How long a simulated VM takes, in seconds: a final dump, a backup's boot to AgentReady, a restore; and how
    often its agent polls IMDS for the interruption notice."""

    dump_s: float = 3.0
    boot_s: float = 2.0
    restore_s: float = 2.0
    notice_poll_s: float = POLL_S

    def __post_init__(self) -> None:
        for name in ("dump_s", "boot_s", "restore_s", "notice_poll_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"AgentTiming.{name} must be 0 or more seconds, not {getattr(self, name)}")


@dataclass
class JobTimes:
    """When, on time.time()'s clock, the wave reached each step of one job's recovery (None: not yet)."""

    final_dump_ordered: float | None = None
    final_dump_begun: float | None = None  # the first of: the notice seen in IMDS, the command received
    backup_launched: float | None = None
    restore_ordered: float | None = None
    backups: list[str] = field(default_factory=list)


class SimulatedAgents:
    """The agents of every VM in a ControlPlane's account (use as a context manager inside the plane), their events
    delivered through `events`. Answers run on `workers` threads, as independent VMs answer at once; errors in an
    answer are kept in `errors`."""

    def __init__(
        self,
        events: awslambda.EventQueue,
        timing: AgentTiming = AgentTiming(),
        workers: int = 4,
        poll_s: float = 0.05,
    ) -> None:
        self.events = events
        self.timing = timing
        self.jobs: dict[str, JobTimes] = {}
        self.errors: list[str] = []
        self._poll_s = poll_s
        self._workers = workers
        self._lock = threading.Lock()
        self._sent: list[tuple[float, Any]] = []  # (time, moto command) as SendCommand made them
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._seen_instances: set[str] = set()  # tagged with their job: read once
        self._serving: dict[str, tuple[str, str, int]] = {}  # instance -> the job, run and generation it runs
        self._dumps: dict[str, tuple[str, float]] = {}  # instance -> its final dump: checkpoint id, when it is in
        self._stop = threading.Event()
        self._patches = contextlib.ExitStack()

    def __enter__(self) -> SimulatedAgents:
        wrap(self._patches, MotoCommand, "__init__", self._noting_commands)
        pool = self._patches.enter_context(ThreadPoolExecutor(self._workers, thread_name_prefix="simagent"))
        self._thread = threading.Thread(target=self._run, args=(pool,), name="simagents", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._patches.close()

    def job(self, job_id: str) -> JobTimes:
        with self._lock:
            return self.jobs.setdefault(job_id, JobTimes())

    def notice(self, instance_id: str) -> None:
        """The interruption notice appears now in the VM's IMDS; its agent sees it at its next poll and dumps."""
        now = time.time()
        # Each agent polls on its own clock: a phase of its own within the poll interval
        phase = (zlib.crc32(instance_id.encode()) % 1000) / 1000 * self.timing.notice_poll_s
        seen = now + (phase - now) % self.timing.notice_poll_s
        # Its own timer: a VM's agent polls its own IMDS, never queued behind other VMs' answers or the local AWS
        poll = threading.Timer(seen - now, self._answering, args=(self._noticed(instance_id),))
        poll.daemon = True
        poll.start()

    def _noticed(self, instance_id: str) -> Callable[[], None]:
        def dump() -> None:
            serving = self._serving_on(instance_id)
            if serving is None:
                return  # no job runs here (yet): the real agent has nothing to dump either
            job_id, run_id, generation = serving
            begun = time.time()
            with self._lock:
                if instance_id in self._dumps:
                    return  # the command began it first
                checkpoint = commands.checkpoint_id(int(begun * 1000), generation, "final")
                self._dumps[instance_id] = (checkpoint, begun + self.timing.dump_s)
            times = self.job(job_id)
            times.final_dump_begun = min(begun, times.final_dump_begun or begun)
            report = events.CheckpointCompleted(
                job_id,
                instance_id,
                generation,
                controlplane.now_iso(),
                run_id=run_id,
                checkpoint_id=checkpoint,
                kind="final",
                seconds=self.timing.dump_s,
            )
            self._schedule(begun + self.timing.dump_s, lambda: self._send(controlplane.agent_event(report)))

        return dump

    def _serving_on(self, instance_id: str) -> tuple[str, str, int] | None:
        """The job, run and generation the VM runs: the user's own VM's from its tags once its run was tagged (as
        the agent reads them from IMDS: no AWS call), at generation 0; a backup's from the restore it answered."""
        with self._lock:
            return self._serving.get(instance_id)

    def _noting_commands(self, init: Any) -> Any:
        def noting(command: Any, *args: Any, **kwargs: Any) -> None:
            init(command, *args, **kwargs)
            with self._lock:
                self._sent.append((time.time(), command))

        return noting

    def _run(self, pool: ThreadPoolExecutor) -> None:
        while not self._stop.wait(self._poll_s):
            self._take_commands()
            self._take_backups()
            now = time.time()
            with self._lock:
                due = []
                while self._due and self._due[0][0] <= now:
                    due.append(heapq.heappop(self._due)[2])
            for action in due:
                pool.submit(self._answering, action)

    def _answering(self, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception as error:  # the wave reports it: an agent's answer the control plane refused
            with self._lock:
                self.errors.append(f"{type(error).__name__}: {error}")

    def _schedule(self, at: float, action: Callable[[], None]) -> None:
        with self._lock:
            heapq.heappush(self._due, (at, next(self._order), action))

    def _take_commands(self) -> None:
        with self._lock:
            sent, self._sent = self._sent, []
        for at, command in sent:
            parameters = {name: values[0] for name, values in command.parameters.items()}
            document = str(command.document_name)
            if document.endswith("-final-dump"):
                for instance_id in command.instance_ids:
                    parameters = controlplane.order_parameters(command, instance_id)
                    times = self.job(parameters["JobId"])
                    times.final_dump_ordered = times.final_dump_ordered or at
                    times.final_dump_begun = min(at, times.final_dump_begun or at)
                    with self._lock:  # one dump either way: every order is answered with the one dump begun first
                        if instance_id not in self._dumps:
                            taken = commands.checkpoint_id(
                                int(at * 1000), int(parameters["Generation"]), "final", int(parameters["Sequence"])
                            )
                            self._dumps[instance_id] = (taken, at + self.timing.dump_s)
                        checkpoint, done = self._dumps[instance_id]
                    self._schedule(max(at, done), self._final_dump(instance_id, parameters, checkpoint))
            elif document.endswith("-restore"):
                self.job(parameters["JobId"]).restore_ordered = at
                for instance_id in command.instance_ids:
                    self._schedule(at + self.timing.restore_s, self._restore(instance_id, parameters))

    def _take_backups(self) -> None:
        """Backups spotcr launched (spotcr:mode restore) since the last look: each boots, then reports ready."""
        now = time.time()
        with controlplane._MOTO:
            instances = [i for r in ec2_backends[ACCOUNT][REGION].reservations.values() for i in r.instances]
            launched = [
                (i.id, i.get_tags()) for i in instances if i.id not in self._seen_instances and i.state in LIVE_STATES
            ]
        for instance_id, tag_list in launched:
            labels = {tag["key"]: tag["value"] for tag in tag_list}
            if labels.get(tag_names.MODE) != "restore":
                # The user's own VM (its job started by whoever registered it): its agent runs the job once its
                # run is tagged, and watches IMDS for the notice
                if tag_names.JOB in labels and tag_names.RUN in labels:
                    self._seen_instances.add(instance_id)
                    with self._lock:
                        self._serving[instance_id] = (labels[tag_names.JOB], labels[tag_names.RUN], 0)
                continue
            self._seen_instances.add(instance_id)
            job = self.job(labels[tag_names.JOB])
            job.backup_launched = job.backup_launched or now
            job.backups.append(instance_id)
            ready = events.AgentReady(
                labels[tag_names.JOB],
                instance_id,
                int(labels[tag_names.GENERATION]),
                controlplane.now_iso(),
                run_id=labels.get(tag_names.RUN, ""),
                mode="restore",
            )
            self._schedule(now + self.timing.boot_s, self._ready(ready))

    def _send(self, event: dict[str, Any]) -> None:
        controlplane.deliver(self.events, event)

    def _ready(self, ready: events.AgentReady) -> Callable[[], None]:
        def report() -> None:
            self._send(controlplane.agent_event(ready))

        return report

    def _final_dump(self, instance_id: str, parameters: dict[str, str], checkpoint: str) -> Callable[[], None]:
        def commit() -> None:
            generation = int(parameters["Generation"])
            report = events.CheckpointCompleted(
                parameters["JobId"],
                instance_id,
                generation,
                controlplane.now_iso(),
                run_id=parameters["RunId"],
                checkpoint_id=checkpoint,
                kind="final",
                seconds=self.timing.dump_s,
            )
            with controlplane._MOTO:
                ended = controlplane.end_checkpoint_command(report)
            if ended:
                self._send(ended[1])
            self._send(controlplane.agent_event(report))

        return commit

    def _restore(self, instance_id: str, parameters: dict[str, str]) -> Callable[[], None]:
        def restore() -> None:
            with self._lock:
                self._serving[instance_id] = (parameters["JobId"], parameters["RunId"], int(parameters["Generation"]))
            answer = events.RestoreCompleted(
                parameters["JobId"],
                instance_id,
                int(parameters["Generation"]),
                controlplane.now_iso(),
                run_id=parameters["RunId"],
                checkpoint_id=parameters["CheckpointId"],
                attempt=parameters["Attempt"],
                seconds=self.timing.restore_s,
                pid=4242,
            )
            with controlplane._MOTO:
                _, ended = controlplane.end_restore_command(answer)
            self._send(ended)
            self._send(controlplane.agent_event(answer))

        return restore
