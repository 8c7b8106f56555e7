"""The fault suite's harness: the local rehearsal with faults injected at exact points, and its invariants checked.

Faults are injected by hooks, never by sleeping: the local cloud's S3 hook (`LocalCloud.store_fault`, an outage
or an agent killed mid-upload), its command hook (`LocalCloud.on_command`), and reactions to the agent's events
as the rehearsal observes them. Every scenario then asserts:
- the job's result equals the uninterrupted run's, or the job ended FAILED with the reason expected;
- never two live copies: the job's processes, sampled across all VMs every 50 ms, ran on one VM at a time;
- no job record left in a non-final state, and no recovery workflow still running;
- nothing left running or allocated (the rehearsal's leak check, rehearsal/leaks.py: instances, volumes,
  snapshots, access points, and SSM commands still pending or in progress).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from spotcr_contracts import events as agent_events
from spotcr_functions.config import ENV
from spotcr_functions.models import ENDED

from rehearsal.cloud import LocalCloud
from rehearsal.localaws.s3 import StoreFault
from rehearsal.scenario import Options, Rehearsal, RehearsalFailed

SAMPLE_EVERY_S = 0.05
JOB_MARKER = b"sample_job.py"
SETTLE_S = 30.0  # how long the control plane may take to write the job's end after the job exited
STOP_FILE = "STOP"
HURRY_FILE = "HURRY"

# A 4 MiB job of about 40 s (paced), checkpointed every 10 s, with a 6 s notice: small enough for ten scenarios.
# Once its interruptions are over, the job runs the rest unpaced (Options.hurry_file): a scenario that needs the
# backup to run on (its periodic dumps, its background work) passes hurry_file="".
OPTIONS = Options(
    storage="s3",
    size_mb=4,
    steps=2000,
    pace_s=0.02,
    interruptions=1,
    notice_s=6.0,
    interval_s=10,
    schedule_every_s=1.0,
    checkpoints_before_interruption=1,
    timeout_s=120.0,
    leak_grace_s=30.0,
    stop_file=STOP_FILE,
    hurry_file=HURRY_FILE,
    timeline_png=False,
)


def _stat(pid: int) -> tuple[str, int] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def job_hosts(init_pids: dict[int, str]) -> set[str]:
    """The VMs (by instance id) on which a process of the job is alive now: a zombie runs nothing."""
    parents: dict[int, int] = {}
    jobs: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        stat = _stat(pid)
        if stat is None:
            continue
        parents[pid] = stat[1]
        if stat[0] == "Z":
            continue
        try:
            if JOB_MARKER in Path(f"/proc/{pid}/cmdline").read_bytes():
                jobs.append(pid)
        except OSError:
            continue
    hosts = set()
    for pid in jobs:
        current, hops = pid, 0
        while current > 1 and current not in init_pids and hops < 64:
            current, hops = parents.get(current, 0), hops + 1
        if current in init_pids:
            hosts.add(init_pids[current])
    return hosts


class CopySampler:
    """Samples, every 50 ms in a background thread, on which VMs the job's processes are alive."""

    def __init__(self, vms: Callable[[], dict[str, Any]]) -> None:
        self._vms = vms
        self.samples = 0
        self.overlaps: list[tuple[float, set[str]]] = []
        self.seen_on: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="copy-sampler", daemon=True)

    def __enter__(self) -> CopySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(SAMPLE_EVERY_S):
            init_pids = {vm.init_pid: instance_id for instance_id, vm in list(self._vms().items()) if vm.init_pid}
            hosts = job_hosts(init_pids)
            self.samples += 1
            self.seen_on |= hosts
            if len(hosts) > 1:
                self.overlaps.append((round(time.monotonic() - started, 2), hosts))


class FaultRehearsal(Rehearsal):
    """The rehearsal, with reactions to the agent's events and a store that can fail on demand."""

    def __init__(self, options: Options, cloud: LocalCloud) -> None:
        lines: list[str] = []
        super().__init__(options, echo=lines.append, cloud=cloud)
        self.lines = lines
        self.reactions: list[Callable[[str, agent_events.AgentEvent], None]] = []
        # While set, the checkpoint bucket refuses writes (and the agent's check that it can write): a dump fails
        # at once, while a restore (reads) still works.
        self.outage = threading.Event()
        self.outage_actions = {"head_bucket", "put_object"}
        self.store_hooks: list[Callable[[str, str], None]] = []  # (action, key) on the checkpoint bucket
        self.cloud.on_event = self._on_event
        self.cloud.store_fault = self._store_fault
        self.sampler = CopySampler(lambda: self.cloud.vms)
        self.end: dict[str, Any] = {}
        self.before_cleanup.append(self._settled)

    def _on_event(self, entry: dict[str, Any]) -> None:
        self.watcher(entry)
        if entry.get("Source") != agent_events.SOURCE:
            return
        import json

        try:
            event = agent_events.parse_detail(entry["DetailType"], json.loads(entry["Detail"]))
        except (agent_events.InvalidEvent, ValueError):
            return
        for react in list(self.reactions):
            react(event.DETAIL_TYPE, event)

    def _store_fault(self, action: str, bucket: str, key: str) -> None:
        if bucket != self.cloud.names["checkpoint_bucket"]:
            return
        for hook in list(self.store_hooks):
            hook(action, key)
        if self.outage.is_set() and action in self.outage_actions:
            raise StoreFault(f"injected outage of {bucket}")

    def run_checked(self) -> Any:
        with self.sampler:
            try:
                return self.run()
            finally:
                self.lines.append(f"copy sampler: {self.sampler.samples} samples, job seen on {self.sampler.seen_on}")

    def events(self, detail_type: str) -> list[Any]:
        return [event for kind, event in self.watcher.seen if kind == detail_type]

    def running_workflows(self) -> list[str]:
        return [execution["name"] for execution in self.workflows("RUNNING")]

    def workflows(self, status: str = "") -> list[dict[str, Any]]:
        """This job's recovery executions (the cloud is shared by the suite's scenarios)."""
        sfn = self.cloud.client("stepfunctions")
        return self._executions(sfn, self.cloud.settings_env[ENV["recovery_state_machine_arn"]], status)

    def backups_launched(self) -> list[str]:
        reservations = self.cloud.client("ec2").describe_instances(
            Filters=[
                {"Name": "tag-key", "Values": ["spotcr:mode"]},
                {"Name": "tag:spotcr:job", "Values": [self.job_id]},
            ]
        )["Reservations"]
        return [instance["InstanceId"] for r in reservations for instance in r["Instances"]]

    def _settled(self) -> None:
        """The job's record is final and no recovery workflow runs; polled, since events are handled
        asynchronously, and bounded."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            record, running = self.job_record(), self.running_workflows()
            if record.get("status") in ENDED and not running:
                break
            if time.monotonic() > deadline:
                raise RehearsalFailed(f"not settled: job record {record.get('status')}, workflows running {running}")
            time.sleep(0.5)
        self.end = {"record": record, "workflows": self.workflows(), "backups": self.backups_launched()}

    def stop_job_on(self, instance_id: str) -> None:
        """Make the sample job exit (code 3) on this VM before its next step."""
        (self.cloud.vms[instance_id].host_path(self.workdir) / STOP_FILE).write_text("stop\n")

    def warn(self, instance_id: str, number: int) -> float:
        return super()._interrupt(instance_id, number)


def kill_agent_commands(instance_vm: Any, marker: bytes) -> list[int]:
    """SIGKILL the agent processes of one VM whose argv holds `marker` (an SSM command's process, mid-work)."""
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spotcr_agent" in argv and marker in argv and _in_vm(int(entry), instance_vm.init_pid):
            os.kill(int(entry), signal.SIGKILL)
            killed.append(int(entry))
    return killed


def _in_vm(pid: int, init_pid: int) -> bool:
    """In the VM's own PID namespace: SSM commands enter it with nsenter, so they are not its init's children."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") == os.readlink(f"/proc/{init_pid}/ns/pid")
    except OSError:
        return False


def options(reference: bytes, runs_dir: Path, **changes: Any) -> Options:
    return replace(OPTIONS, reference=reference, runs_dir=runs_dir, **changes)
