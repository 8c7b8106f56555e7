"""The rehearsal itself: submit a job by tagging an instance, interrupt it, watch it come back, check its result.

The job is the sample job, or the user's own command (`Options.command`, exactly as the spotcr:command
tag). Its result file is compared byte for byte with the one an uninterrupted run of the same command
leaves, on a bare VM of its own at the same work dir path.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import Any

from spotcr_agent.carry import REFUSED, ROLLBACK_JOURNAL
from spotcr_agent.result import ResultError, fetch_result_file
from spotcr_agent.store.backends import S3Backend
from spotcr_agent.store.errors import StoreError
from spotcr_cli import actions
from spotcr_cli.aws import Cloud
from spotcr_contracts import events as agent_events
from spotcr_contracts import tags
from spotcr_contracts.commands import checkpoint_order
from spotcr_functions import catalog
from spotcr_functions.config import ENV
from spotcr_functions.models import ENDED

from rehearsal import asset, leaks
from rehearsal.cloud import PREFIX, REGION, LocalCloud
from rehearsal.timeline import Timeline
from rehearsal.vm import REPO, LocalVM, VmError, bare_vm

SAMPLE_JOB = REPO / "rehearsal" / "sample_job.py"
RESULT_FILE = "result.txt"
RUNS_DIR = REPO / "rehearsal-runs"
MIB = 1 << 20
STDERR_TAIL_CHARS = 600


class RehearsalFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class Options:
    storage: str = "s3"
    size_mb: int = 256
    steps: int = 3000
    pace_s: float = 0.02
    interruptions: int = 1
    notice_s: float = 120.0  # AWS gives two minutes
    interval_s: int = 10  # spotcr:interval of the job (periodic checkpoints)
    schedule_every_s: float = 5.0  # the scheduled rule's "every minute", compressed
    checkpoints_before_interruption: int = 1
    timeout_s: float = 300.0  # for each phase: start, each recovery, the end of the job
    runs_dir: Path = RUNS_DIR
    keep_vms: bool = False
    rebalance_lead_s: float = 0.0  # > 0: a rebalance recommendation this long before each warning, as FIS sends
    command: str | None = None  # the user's own job, as its spotcr:command tag; None: the sample job
    result_file: str = RESULT_FILE  # what the job leaves in its work dir, compared byte for byte
    leak_grace_s: float = 30.0  # after the job finished, how long cleanup may take before leftovers fail the run
    reference: bytes | None = None  # the uninterrupted run's result when already known: no reference run then
    exit_code: int = 0  # the exit code the job must end with (the fault suite makes some jobs fail on purpose)
    timeline_png: bool = True  # draw timeline.png besides timeline.json (the fault suite skips it: matplotlib)
    stop_file: str = ""  # the sample job exits with STOPPED_EXIT_CODE once this file is in its work dir
    # Once every interruption is over, this file is put in the sample job's work dir: it stops pacing and the run
    # ends sooner with the same result (the fault suite: nothing is left to test while the job runs on)
    hurry_file: str = ""
    missed_warning: bool = False  # the notice is lost: no final dump, the backup restores the newest periodic one
    upgrade_at_s: float | None = None  # the stack upgraded (new agent asset and launch template version) at this second
    nodes: int = 1  # > 1: a job over this many VMs (MPI); interruption i hits node i % nodes, node 1 first
    wave: int = 1  # a job over several VMs: each interruption hits this many nodes at once, from node i % nodes on
    during_periodic: bool = False  # the warning comes while the next periodic dump runs (ordered, not committed)


@dataclass
class Outcome:
    result: bytes
    expected: bytes
    recoveries_s: list[float]
    run_dir: Path
    timeline_png: Path
    final_dumps: list[dict[str, Any]] = field(default_factory=list)
    restored_from: list[str] = field(default_factory=list)  # the checkpoint each interruption's restore used
    newest_periodic: list[str] = field(default_factory=list)  # the newest recorded periodic one at each interruption
    # Warning to the job's last page in, per interruption: later than running again when restored lazily.
    all_pages_s: list[float] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.result == self.expected

    def describe(self, data: bytes) -> str:
        """One line for a result: itself when it is a short line of text, else its size and digest."""
        text = data.decode(errors="replace").strip()
        if len(data) <= 200 and "\n" not in text and text.isprintable():
            return text
        return f"{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}"


class Watcher:
    """Turns the events on the buses into progress lines, timeline marks and waitable facts."""

    def __init__(self, timeline: Timeline, console: Callable[[str], str] = lambda vm: "") -> None:
        self.timeline = timeline
        self.console = console  # a VM's console output so far, by instance id
        self.seen: list[tuple[str, agent_events.AgentEvent]] = []
        self.final_dumps: list[dict[str, Any]] = []
        self.work_redone_s: list[float] = []
        self.boot_to_ready_s: dict[str, float] = {}
        self.boots: dict[str, asset.Boot] = {}  # what each VM's console says of its boot, read when it is ready
        self._running_since: dict[str, float] = {}
        self._changed = threading.Condition()

    def __call__(self, entry: dict[str, Any]) -> None:
        if entry.get("Source") != agent_events.SOURCE:
            return
        try:
            event = agent_events.parse_detail(entry["DetailType"], json.loads(entry["Detail"]))
        except (agent_events.InvalidEvent, ValueError) as error:
            self.timeline.say(f"! malformed agent event: {error}")
            return
        self._show(event)
        with self._changed:
            self.seen.append((event.DETAIL_TYPE, event))
            self._changed.notify_all()

    def _show(self, event: agent_events.AgentEvent) -> None:
        vm, now, say = event.instance_id, self.timeline.now(), self.timeline
        if isinstance(event, agent_events.AgentReady):
            launched = [m.at for m in say.find("launch", vm)]
            say.span(vm, "allocation", launched[0] if launched else now, now)
            boot = now - launched[0] if launched else 0.0
            self.boot_to_ready_s[vm] = round(boot, 2)
            self.boots[vm] = asset.read_boot(self.console(vm))
            say.point(
                vm,
                "ready",
                f"agent ready on {vm} (mode {event.mode}, generation {event.generation}): "
                f"{boot:.1f} s from launch ({self.boots[vm].describe(boot)})",
                boot_to_ready_s=round(boot, 2),
                boot_phases_s=self.boots[vm].phases_s,
            )
        elif isinstance(event, agent_events.JobStarted):
            self._running_since[vm] = now
            say.say(f"job {event.job_id} started on {vm}")
        elif isinstance(event, agent_events.CheckpointCompleted):
            if event.kind == "final" and any(d["checkpoint_id"] == event.checkpoint_id for d in self.final_dumps):
                return  # the same final dump, reported again when the control plane's order found it taken
            kind = "final-dump" if event.kind == "final" else "periodic-dump"
            text = (
                f"{event.kind} checkpoint {event.checkpoint_id} on {vm}: {event.bytes_total / MIB:.0f} MiB "
                f"({event.bytes_uploaded / MIB:.0f} MiB uploaded) in {event.seconds:.2f} s, "
                f"job frozen {event.frozen_seconds:.2f} s"
            )
            say.span(vm, kind, max(0.0, now - event.seconds), now, text, checkpoint_id=event.checkpoint_id)
            say.point(vm, "checkpoint")
            if event.kind == "final":
                self._end_execution(vm, now - event.frozen_seconds)
                self.final_dumps.append(
                    {"checkpoint_id": event.checkpoint_id, "seconds": event.seconds, "bytes": event.bytes_total}
                )
        elif isinstance(event, agent_events.RestoreCompleted):
            self._show_restore(event, vm, now)
        elif isinstance(event, agent_events.JobExited):
            self._end_execution(vm, now)
            say.say(f"job {event.job_id} finished on {vm} with exit code {event.exit_code} (the agent says)")
        elif isinstance(event, agent_events.CheckpointFailed) and event.kind == "periodic":
            say.say(f"periodic checkpoint not taken on {vm}: {event.reason}")
        elif isinstance(
            event, (agent_events.CheckpointFailed, agent_events.RestoreFailed, agent_events.BootstrapFailed)
        ):
            say.point(vm, "failure", f"! {event.DETAIL_TYPE} on {vm}: {json.dumps(event.detail())}")

    def _show_restore(self, event: agent_events.RestoreCompleted, vm: str, now: float) -> None:
        say = self.timeline
        running = now - event.seconds + event.running_seconds if event.lazy else now
        say.span(
            vm,
            "restore",
            max(0.0, now - event.seconds),
            running,
            f"job restored on {vm} from {event.checkpoint_id}: running again in {running - now + event.seconds:.2f} s",
        )
        if event.lazy:
            say.span(vm, "lazy-pages", running, now, f"its last page in {event.seconds:.2f} s after the order")
        self._running_since[vm] = running
        if event.skipped:
            say.say(f"  newer checkpoints skipped: {event.skipped}")
        newest = max((d["checkpoint_id"] for d in self.final_dumps), default="", key=_order_or_none)
        if newest and not event.checkpoint_id:
            say.say(f"! started from the beginning although final dump {newest} is committed (not restorable)")
        elif newest and checkpoint_order(newest)[:3] > checkpoint_order(event.checkpoint_id)[:3]:
            # (A job over several VMs: each node's part of one final dump has its own VM's time in its id.)
            lost = (int(newest.split("-")[0]) - int(event.checkpoint_id.split("-")[0])) / 1000
            say.say(
                f"! restored from {event.checkpoint_id} although final dump {newest} is committed: "
                f"{lost:.1f} s of work redone"
            )
            self.work_redone_s.append(lost)

    def _end_execution(self, vm: str, end: float) -> None:
        start = self._running_since.pop(vm, None)
        if start is not None:
            self.timeline.span(vm, "execution", start, max(start, end))

    def vm_stopped(self, vm: str) -> None:
        self._end_execution(vm, self.timeline.now())

    def wait(
        self,
        predicate: Callable[[str, agent_events.AgentEvent], bool],
        timeout_s: float,
        what: str,
        health: Callable[[], None] = lambda: None,
    ) -> Any:
        """The first event that satisfies predicate; `health` raises as soon as the run cannot succeed."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for detail_type, event in self.seen:
                    if predicate(detail_type, event):
                        return event
                self.check_bootstrap()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RehearsalFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
                health()
                self._changed.wait(min(remaining, 2.0))

    def check_bootstrap(self) -> None:
        """Raise as soon as a VM said its bootstrap failed: the run cannot succeed."""
        with self._changed:
            for _, event in self.seen:
                if isinstance(event, agent_events.BootstrapFailed):
                    raise RehearsalFailed(f"bootstrap failed on {event.instance_id}: {event.step}: {event.reason}")

    def count(self, predicate: Callable[[str, agent_events.AgentEvent], bool]) -> int:
        return len(self.matching(predicate))

    def matching(self, predicate: Callable[[str, agent_events.AgentEvent], bool]) -> list[agent_events.AgentEvent]:
        with self._changed:
            return [event for detail_type, event in self.seen if predicate(detail_type, event)]


def restored_after(generation: int) -> Callable[[str, agent_events.AgentEvent], bool]:
    def restored(detail_type: str, event: agent_events.AgentEvent) -> bool:
        return detail_type == "RestoreCompleted" and event.generation > generation

    return restored


def job_command(options: Options, pace: float | None = None) -> list[str]:
    return [
        sys.executable,
        str(SAMPLE_JOB),
        "--mb",
        str(options.size_mb),
        "--steps",
        str(options.steps),
        "--pace",
        str(options.pace_s if pace is None else pace),
        "--result",
        RESULT_FILE,
        *(["--stop-file", options.stop_file] if options.stop_file else []),
        *(["--hurry-file", options.hurry_file] if options.hurry_file else []),
    ]


def command_tag(options: Options) -> str:
    return options.command if options.command is not None else shlex.join(job_command(options))


def reference_argv(options: Options) -> tuple[str, ...]:
    """The uninterrupted run: the user's command as the agent splits it, or the sample job unpaced."""
    if options.command is not None:
        return tags.parse_command(options.command)
    return tuple(job_command(options, pace=0.0))


def no_checkpoint_remedy(options: Options, refusals: list[str]) -> str:
    """What to change when no periodic checkpoint came before the job ended: the agent's refusal and its remedy
    when it refused the dumps, else a longer job."""
    refused = next((reason for reason in refusals if reason.startswith(REFUSED)), None)
    if refused is None:
        return (
            f"rehearse a job that runs longer than --interval ({options.interval_s} s) on each VM, "
            "or fewer --interruptions"
        )
    command = command_tag(options)
    if "[io_uring]" in refused:
        remedy = (
            "for Node.js (libuv) turn io_uring off in the job's environment: "
            f"--command {shlex.quote(f'env UV_USE_IO_URING=0 {command}')}"
        )
    elif ROLLBACK_JOURNAL in refused:
        remedy = (
            "to switch it: `sqlite3 DB 'PRAGMA journal_mode=WAL'` once, before the job, "
            "or have the job run that PRAGMA when it opens the database"
        )
    else:
        remedy = "the reason above says what the job must stop holding"
    return f"every periodic dump was refused: {refused}; {remedy}"


def check_result_path(result_file: str) -> None:
    if tags.result_path_problem(result_file):
        raise RehearsalFailed(
            f"--result {result_file!r}: must be a path relative to the job's work dir, without '..' or ','"
        )


# Runs inside the reference VM: the job started as the agent starts it, waited for, its exit code printed.
_REFERENCE_RUN = """
import os, sys
from pathlib import Path
from spotcr_agent.agent import base_job_env
from spotcr_agent.runner import JobFiles, start_job
workdir = Path(sys.argv[1])
job = start_job(tuple(sys.argv[2:]), workdir, base_job_env(os.environ))
if job.launcher is not None:
    job.launcher.wait()
print(JobFiles(workdir).read_exit_code())
"""


def stderr_tail(vm: LocalVM, workdir: str) -> str:
    try:
        text = vm.host_path(f"{workdir}/.spotcr/stderr.log").read_text(errors="replace").strip()
    except OSError:
        return ""
    return f"; its stderr ends: {text[-STDERR_TAIL_CHARS:]}" if text else ""


def reference_result(
    cloud: LocalCloud, options: Options, workdir: str, say: Callable[[str], None], booted: Callable[[LocalVM], None]
) -> bytes:
    """The same job run once without interruption, on a bare VM of its own at the same work dir."""
    assert cloud.network is not None
    # Shared storage of its own, as the job's (efs, fsx): the job may write there.
    shared = cloud.run_dir / "reference-storage" if options.storage in ("efs", "fsx") else None
    if shared is not None:
        shared.mkdir(parents=True, exist_ok=True)
    with bare_vm(cloud.run_dir / "reference", cloud.network, cloud_env=cloud.vm_env, shared_storage=shared) as vm:
        booted(vm)
        say(f"uninterrupted reference run on a bare VM at {vm.address}")
        argv = [sys.executable, "-c", _REFERENCE_RUN, workdir, *reference_argv(options)]
        try:
            # As long as the whole rehearsal may take: it runs beside it.
            run = vm.run(argv, options.timeout_s * (options.interruptions + 2))
        except subprocess.TimeoutExpired as error:
            raise RehearsalFailed(f"the uninterrupted reference run took longer than {error.timeout:.0f} s") from None
        except VmError as error:
            raise RehearsalFailed(f"the uninterrupted reference run did not finish: {error}") from None
        code = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
        if run.returncode != 0 or code != "0":
            raise RehearsalFailed(
                f"the uninterrupted reference run exited with {code or run.returncode}{stderr_tail(vm, workdir)}"
                f"{run.stderr[-STDERR_TAIL_CHARS:]}"
            )
        path = vm.host_path(f"{workdir}/{options.result_file}")
        if not path.is_file():
            raise RehearsalFailed(f"the uninterrupted reference run left no {options.result_file} in its work dir")
        return path.read_bytes()


def _order_or_none(checkpoint_id: str) -> tuple[int, int, int, str]:
    return checkpoint_order(checkpoint_id) if checkpoint_id else (-1, -1, -1, "")


def committed_result(cloud: LocalCloud, location: str, job_id: str, result_file: str, run_id: str = "") -> bytes:
    """One file of a finished run's result, read from the store as a user would (s3://bucket/.../manifest.json)."""
    if not location.startswith("s3://"):
        raise RehearsalFailed(f"the job's result is at {location}, not in the checkpoint bucket")
    bucket = location.removeprefix("s3://").partition("/")[0]
    backend = S3Backend(bucket, client=cloud.client("s3"))
    return fetch_result_file(backend, job_id, PurePosixPath(result_file).as_posix(), run_id)


def workflow_waits(options: Options) -> dict[str, int]:
    return {
        # The workflow waits for the final dump until shortly before the instance goes away.
        "final_dump_wait_s": max(5, int(options.notice_s * 110 / 120)),
        "backup_ready_wait_s": 300,
        "restore_wait_s": 300,
        "poll_s": 1,
        "ebs_volume_gib": 2,
    }


def local_cloud(
    options: Options,
    run_dir: Path,
    timeline: Timeline,
    shared_storage: Path | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> LocalCloud:
    """The local cloud, not started, for rehearsals with these options: the stack publishes the agent asset, and each
    VM installs the one its launch template version names."""
    return LocalCloud(
        run_dir=run_dir,
        timeline=timeline,
        schedule_every_s=options.schedule_every_s,
        shared_storage=shared_storage,
        workflow_waits=workflow_waits(options),
        on_event=on_event,
        fis_notice_s=options.notice_s,
        with_agent_asset=True,
    )


class Rehearsal:
    def __init__(
        self, options: Options, echo: Callable[[str], None] | None = None, cloud: LocalCloud | None = None
    ) -> None:
        """`cloud`: a local cloud already started, shared by several runs (the fault suite), each its own job."""
        self.options = options
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        self.job_id = f"demo-{options.storage}-{stamp[-6:]}"
        self.run_dir = options.runs_dir / f"{stamp}-{options.storage}"
        self.timeline = Timeline(echo=echo)
        self.watcher = Watcher(self.timeline, console=self._console)
        shared = self.run_dir / "shared-storage" if options.storage in ("efs", "fsx") else None
        if shared is not None:
            shared.mkdir(parents=True, exist_ok=True)
        self._own_cloud = cloud is None
        if cloud is None:
            cloud = local_cloud(options, self.run_dir, self.timeline, shared_storage=shared, on_event=self.watcher)
        else:
            cloud.timeline, cloud.on_event = self.timeline, self.watcher
        self.cloud = cloud
        self._vms_before = set(cloud.vms)
        self.recoveries_s: list[float] = []
        self.all_pages_s: list[float] = []
        self.restored_from: list[str] = []
        self.newest_periodic: list[str] = []
        self.outcome: Outcome | None = None
        self.upgrade: dict[str, Any] | None = None  # the stack's upgrade, once done: when, its version and asset
        self._reference_vms: list[LocalVM] = []
        self.before_cleanup: list[Callable[[], None]] = []  # checks run once the job ended, before the leak check

    def run(self) -> Outcome:
        """Run the whole rehearsal; the timeline is written even when it fails, to show how far it got."""
        self.job_tags()  # a bad command or result path fails here, before anything starts
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self._own_cloud:
            self.cloud.start()
        try:
            return self._run()
        except RehearsalFailed as error:
            raise RehearsalFailed(f"{error}{self._workflow_position()}") from None
        finally:
            mine = [vm for vm in list(self.cloud.vms.values()) if vm.instance_id not in self._vms_before]
            for vm in mine:
                self.watcher.vm_stopped(vm.instance_id)
            for vm in self._reference_vms:
                vm.terminate()
            if self._own_cloud:
                self.cloud.stop()
            else:
                for vm in mine:
                    vm.terminate()
            if not self.options.keep_vms:
                for vm in mine:
                    vm.remove()
            self._write_timeline()

    @property
    def workdir(self) -> str:
        return f"/var/lib/spotcr/work/{self.job_id}"

    def _reference(self, box: dict[str, Any]) -> None:
        try:
            box["result"] = reference_result(
                self.cloud, self.options, self.workdir, self.timeline.say, self._reference_vms.append
            )
        except RehearsalFailed as error:
            box["error"] = error
        except Exception as error:
            box["error"] = RehearsalFailed(f"the uninterrupted reference run failed: {type(error).__name__}: {error}")

    def _run(self) -> Outcome:
        options, say = self.options, self.timeline.say
        expected_box: dict[str, Any] = {}
        reference = threading.Thread(target=self._reference, args=(expected_box,), daemon=True)
        self.cloud.boot_commands = self._boot_commands()
        say(f"local cloud up at {self.cloud.endpoint}; run files in {self.run_dir}")
        instance_id = self._submit()  # node 0's, of a job over several VMs
        self.watcher.wait(lambda t, e: t == "JobStarted" and e.instance_id == instance_id, 120, "the job to start")
        if options.reference is None:
            reference.start()
        else:
            expected_box["result"] = options.reference
        if options.upgrade_at_s is not None:
            self._upgrade(options.upgrade_at_s)
        current, generation = instance_id, 0
        for number in range(1, options.interruptions + 1):
            current, generation = self._interruption(number, current, generation)
        if options.hurry_file and options.command is None and options.interruptions:
            self._hurry(current)
        exited = self._await_end(options.timeout_s)
        if exited.exit_code != options.exit_code:
            vm = self.cloud.vms[exited.instance_id]
            raise RehearsalFailed(
                f"the job exited with {exited.exit_code} on {exited.instance_id}{stderr_tail(vm, self.workdir)}"
            )
        result = self._result(exited) if exited.exit_code == 0 else b""
        if options.reference is None:
            reference.join(options.timeout_s)
        if "error" in expected_box:
            raise expected_box["error"]
        if "result" not in expected_box:
            raise RehearsalFailed(f"the uninterrupted reference run did not end within {options.timeout_s:.0f} s")
        expected = expected_box["result"]
        outcome = Outcome(
            result,
            expected,
            self.recoveries_s,
            self.run_dir,
            self.run_dir / "timeline.png",
            self.watcher.final_dumps,
            self.restored_from,
            self.newest_periodic,
            self.all_pages_s,
        )
        (self.run_dir / "result").write_bytes(result)
        (self.run_dir / "result.reference").write_bytes(expected)
        say(f"{options.result_file} after {options.interruptions} interruption(s): {outcome.describe(result)}")
        say(f"{options.result_file} of the uninterrupted run:  {outcome.describe(expected)}")
        self.outcome = outcome
        for check in self.before_cleanup:
            check()
        self._end_own_nodes()
        left = leaks.wait_until_tidy(self.cloud.client, options.leak_grace_s)
        if left:
            raise RehearsalFailed(leaks.describe(left))
        say("leak check: no instance, volume, snapshot, access point or command left but the job's checkpoints")
        return outcome

    def _hurry(self, instance_id: str) -> None:
        """Every interruption is over: the sample job on the VM it runs on again runs the rest unpaced."""
        try:
            (self.cloud.vms[instance_id].host_path(self.workdir) / self.options.hurry_file).write_text("hurry\n")
        except (KeyError, OSError) as error:
            self.timeline.say(f"the job on {instance_id} was not hurried ({error}): it runs on at its pace")
            return
        self.timeline.say(f"every interruption is over: the job on {instance_id} runs the rest unpaced")

    def _end_own_nodes(self) -> None:
        """A job over several VMs ends with the nodes the user launched still running (spotcr terminates only the
        backups it launched): the user terminates them, as on AWS, and each node's EBS volume goes with its
        instance (the leak check then finds none)."""
        if self.options.nodes < 2:
            return
        ec2 = self.cloud.client("ec2")
        filters = [
            {"Name": f"tag:{tags.JOB}", "Values": [self.job_id]},
            {"Name": "instance-state-name", "Values": ["running"]},
        ]
        reservations = ec2.describe_instances(Filters=filters)["Reservations"]
        own = [
            instance["InstanceId"]
            for reservation in reservations
            for instance in reservation["Instances"]
            if not tags.launched_by_spotcr({t["Key"]: t["Value"] for t in instance.get("Tags", [])})
        ]
        if own:
            self.timeline.say(f"the job ended: the user terminates its own nodes {', '.join(own)}")
            ec2.terminate_instances(InstanceIds=own)

    def _interruption(self, number: int, current: str, generation: int) -> tuple[str, int]:
        """One interruption of the job's current VM (of one of its nodes), once it has checkpointed; returns where
        the job runs again (node 0's VM)."""
        self._await_periodic(current, generation, number)
        if self.options.during_periodic:
            self._await_periodic_ordered(number)
        record = self.job_record()
        newest = str(record.get("checkpoint_id", ""))
        targets = [current]
        if self.options.nodes > 1:
            hit = [(number + k) % self.options.nodes for k in range(self.options.wave)]
            targets = [str(record["nodes"][str(node)]["M"]["instance_id"]["S"]) for node in hit]
            which = " and ".join(f"node {node} ({target})" for node, target in zip(hit, targets, strict=True))
            self.timeline.say(f"interruption {number} hits {which} of {self.options.nodes} at once")
        warned = min(self._interrupt(target, number) for target in targets)
        restored = self.watcher.wait(
            restored_after(generation),
            self.options.timeout_s,
            f"the job to be restored after interruption {number}",
            lambda: self._recovery_health(number),
        )
        all_pages = self.timeline.now() - warned
        lazy_tail = restored.seconds - restored.running_seconds if restored.lazy else 0.0
        if self.upgrade is not None:
            self._check_upgraded(restored.instance_id)
        recovery = all_pages - lazy_tail
        self.recoveries_s.append(round(recovery, 2))
        self.all_pages_s.append(round(all_pages, 2))
        self.restored_from.append(restored.checkpoint_id)
        self.newest_periodic.append(newest)
        if self.options.missed_warning:
            # A job over several VMs: a node's part of the job's checkpoint has its own VM's time in its id.
            same = checkpoint_order(restored.checkpoint_id)[:3] == checkpoint_order(newest)[:3] if newest else False
            if not (same if self.options.nodes > 1 else restored.checkpoint_id == newest):
                raise RehearsalFailed(
                    f"interruption {number}: with the warning missed the job was restored from "
                    f"{restored.checkpoint_id or 'nothing'}, not from the newest periodic checkpoint {newest}"
                )
            self.timeline.say(
                f"interruption {number}: restored from the newest periodic checkpoint {newest}; "
                "the work done after it runs again"
            )
        self.timeline.say(f"interruption {number}: warning to running again in {recovery:.1f} s")
        if self.options.nodes > 1:  # every node restored; node 0's VM takes the job's dumps
            return self._running_again(restored.generation), restored.generation
        return restored.instance_id, restored.generation

    def _await_periodic_ordered(self, number: int) -> None:
        """Until the scheduler has ordered the next periodic dump (the job CHECKPOINTING), then a moment more, so
        that the warning comes while that dump runs (on every node of a job over several VMs)."""
        deadline = time.monotonic() + self.options.timeout_s
        while self.job_record().get("status") != "CHECKPOINTING":
            if time.monotonic() > deadline:
                raise RehearsalFailed(
                    f"interruption {number}: no periodic dump ordered within {self.options.timeout_s} s"
                )
            self._fail_if_ended(f"interruption {number}")
            time.sleep(0.05)
        time.sleep(0.3)
        self.timeline.say(f"interruption {number} comes while a periodic dump runs")

    def _running_again(self, generation: int) -> str:
        """A job over several VMs runs again once the recovery finished: the instance the record names (node 0's)."""
        deadline = time.monotonic() + self.options.timeout_s
        while (record := self.job_record()).get("status") != "RUNNING" or int(record["generation"]) != generation:
            if time.monotonic() > deadline:
                raise RehearsalFailed(f"the recovery of generation {generation} did not finish: {record}")
            self._fail_if_ended(f"the recovery of generation {generation} finished")
            time.sleep(0.2)
        return str(record["instance_id"])

    def _recovery_health(self, number: int) -> None:
        self._workflow_health()
        self._fail_if_ended(f"interruption {number} moved it to a backup")

    def _fail_if_ended(self, before: str) -> None:
        """A job that ended while the rehearsal waits for a later point of it ends the rehearsal at once."""
        if (ended := self._ended()) is None:
            return
        how = f"exited with {ended['exit_code']}" if "exit_code" in ended else f"ended {ended['status']}"
        reason = f" ({ended['reason']})" if ended.get("reason") else ""
        raise RehearsalFailed(
            f"the job {how} on {ended.get('instance_id')} before {before} (noticed {self.timeline.now():.0f} s after "
            f"its submission){reason}: rehearse a job that runs longer"
            + (" (more --steps)" if self.options.command is None else "")
        )

    def _upgrade(self, at_s: float) -> None:
        """At `at_s` seconds from the submission (once the job runs), the stack upgraded as `cdk deploy` does."""
        while self.timeline.now() < at_s:
            self._fail_if_ended(f"the upgrade at {at_s:.0f} s")
            self.watcher.check_bootstrap()
            time.sleep(0.2)
        version = self.cloud.upgrade_stack(f"the upgrade at {at_s:g} s")
        self.upgrade = {"at_s": self.timeline.now(), "version": version, "asset": self.cloud.agent_asset_url}
        self.timeline.say(
            f"stack upgraded: launch template version {version} names the new agent asset "
            f"{self.cloud.agent_asset_url}; the functions launch that version"
        )

    def _check_upgraded(self, instance_id: str) -> None:
        """The backup booted the upgraded stack's version: its console names the asset that version names."""
        assert self.upgrade is not None
        booted = self.watcher.boots.get(instance_id, asset.Boot())
        if booted.asset_url != self.upgrade["asset"]:
            raise RehearsalFailed(
                f"backup {instance_id} booted the agent asset {booted.asset_url or '(none on its console)'}, not the "
                f"upgraded stack's {self.upgrade['asset']}"
            )
        self.timeline.say(f"backup {instance_id} booted the upgraded agent asset ({booted.deployment})")

    def _console(self, instance_id: str) -> str:
        vm = self.cloud.vms.get(instance_id)
        try:
            return vm.log_path.read_text(errors="replace") if vm is not None else ""
        except OSError:
            return ""

    def _workflow_position(self) -> str:
        """Where each unfinished recovery workflow stands, to say what a timeout was waiting on."""
        try:
            sfn = self.cloud.client("stepfunctions")
            machine = self.cloud.settings_env[ENV["recovery_state_machine_arn"]]
            positions = []
            for execution in self._executions(sfn, machine, "RUNNING"):
                history = sfn.get_execution_history(executionArn=execution["executionArn"], maxResults=1000)
                entered = [e for e in history["events"] if "stateEnteredEventDetails" in e]
                last = max(entered, key=lambda e: e["id"])["stateEnteredEventDetails"]["name"] if entered else "?"
                positions.append(f"{execution['name']} at {last}")
        except Exception as error:
            return f" (workflow state unknown: {error})"
        return f"; running workflows: {', '.join(positions)}" if positions else ""

    def _executions(self, sfn: Any, machine: str, status: str = "") -> list[dict[str, Any]]:
        """This job's recovery executions (recovery.execution_name starts with the job id)."""
        found = sfn.list_executions(stateMachineArn=machine, **({"statusFilter": status} if status else {}))
        return [e for e in found["executions"] if e["name"].startswith(f"{self.job_id[:56]}-g")]

    def _workflow_health(self) -> None:
        """A recovery workflow that failed ends the rehearsal with its error, not with a timeout."""
        sfn = self.cloud.client("stepfunctions")
        machine = self.cloud.settings_env[ENV["recovery_state_machine_arn"]]
        for execution in self._executions(sfn, machine):
            if execution["status"] in ("FAILED", "TIMED_OUT", "ABORTED"):
                detail = sfn.describe_execution(executionArn=execution["executionArn"])
                raise RehearsalFailed(
                    f"recovery workflow {execution['name']} {execution['status']}: "
                    f"{detail.get('error', '')}: {str(detail.get('cause', ''))[:400]}"
                )

    def _boot_commands(self) -> list[list[str]]:
        """bootstrap.sh's steps: the SSM agent, the agent asset installed, `spotcr-agent bootstrap ...`, the daemon."""
        agent = "/opt/spotcr/bin/spotcr-agent"
        names = self.cloud.names
        bootstrap = [agent, "bootstrap", "--bucket", names["checkpoint_bucket"], "--event-bus", names["event_bus_name"]]
        # The agent's store credentials come from the store-credentials URL (here its stand-in), as on AWS.
        bootstrap += ["--store-credentials-url", self.cloud.store_credentials_url]
        if self.options.storage == "efs":
            bootstrap += ["--efs-id", self.cloud.file_system_id]
        if self.options.storage == "fsx":
            bootstrap += ["--fsx-dns", "fs-0rehearsal.fsx.local", "--fsx-mount-name", "rehearsal"]
        # The agent asset comes from each VM's own user data: the launch template version it was launched from.
        return [asset.boot_command(bootstrap), [agent, "daemon"]]

    def _submit(self) -> str:
        """Submit the job as a user does: `spotcr submit`'s own code, signed as the `spotcr` user, launches an instance
        from the stack's launch template, at the version the stack's outputs name, carrying the spotcr tags."""
        job_tags = self.job_tags()
        self.timeline.restart()
        self.timeline.say(f"submitting job {self.job_id}: {job_tags[tags.COMMAND]}")
        cloud = Cloud(self.cloud.endpoint, REGION, PREFIX)
        nodes = self.options.nodes
        each = [actions.node_tags(job_tags, index) for index in range(nodes)] if nodes > 1 else [job_tags]
        with self.cloud.as_cli_user():
            submitted = [
                actions.submit(
                    cloud, node, instance_id=None, instance_type="c5.large", on_demand=False, say=lambda _line: None
                )
                for node in each
            ]
        return str(submitted[0]["instance_id"])

    def job_tags(self) -> dict[str, str]:
        """The job's tags as `spotcr submit` makes them: RehearsalFailed names a bad one."""
        options = self.options
        check_result_path(options.result_file)
        try:
            return actions.job_tags(
                self.job_id,
                command=command_tag(options),
                spec=None,
                storage=options.storage,
                interval_s=options.interval_s,
                fallback_types="m5.large",
                workdir=None,
                tcp=None,
                restart_from_scratch=None,
                # The file compared is declared: a job that ends without it fails instead of storing a result.
                result=options.result_file,
                nodes=options.nodes if options.nodes > 1 else None,
            )
        except tags.InvalidJobTags as error:
            raise RehearsalFailed(f"the job cannot be submitted: {error}") from None

    def _await_periodic(self, instance_id: str, generation: int, number: int) -> None:
        wanted = self.options.checkpoints_before_interruption

        def periodic(detail_type: str, event: Any) -> bool:
            return (
                detail_type == "CheckpointCompleted"
                and event.kind == "periodic"
                and event.instance_id == instance_id
                and event.generation == generation
            )

        def recorded(done: list[agent_events.AgentEvent]) -> bool:
            # The control plane records a checkpoint from SSM's answer to its command, which may come after the
            # agent's CheckpointCompleted on the bus: the fault that follows must find the newest one recorded.
            ids = [e.checkpoint_id for e in done if isinstance(e, agent_events.CheckpointCompleted)]
            newest = self.job_record().get("checkpoint_id")
            if self.options.nodes > 1:  # node 0's own part is not the job's checkpoint, which names every node's
                parts = max(ids, key=checkpoint_order)
                return bool(newest) and checkpoint_order(str(newest))[:3] >= checkpoint_order(parts)[:3]
            return bool(ids) and newest == max(ids, key=checkpoint_order)

        def refusals() -> list[str]:
            failed = self.watcher.matching(lambda t, e: t == "CheckpointFailed" and e.instance_id == instance_id)
            return [e.reason for e in failed if isinstance(e, agent_events.CheckpointFailed)]

        deadline = time.monotonic() + self.options.timeout_s
        while len(done := self.watcher.matching(periodic)) < wanted or not recorded(done):
            if (ended := self._ended()) is not None:
                how = f"exited with {ended['exit_code']}" if "exit_code" in ended else f"ended {ended['status']}"
                raise RehearsalFailed(
                    f"the job {how} on {ended.get('instance_id')} before a periodic checkpoint on {instance_id}, so "
                    f"interruption {number} could not happen: {no_checkpoint_remedy(self.options, refusals())}"
                    f"{stderr_tail(self.cloud.vms[instance_id], self.workdir)}"
                )
            if time.monotonic() > deadline:
                refused = any(reason.startswith(REFUSED) for reason in refusals())
                raise RehearsalFailed(
                    f"no periodic checkpoint on {instance_id} recorded within {self.options.timeout_s} s"
                    + (f": {no_checkpoint_remedy(self.options, refusals())}" if refused else "")
                )
            time.sleep(0.2)

    def _interrupt(self, instance_id: str, number: int) -> float:
        """As AWS (and FIS) does: the notice on IMDS and the warning event, then the instance goes away."""
        notice = self.options.notice_s
        vm = self.cloud.vms[instance_id]
        if self.options.missed_warning:
            # The notice is lost: nothing reaches the VM's IMDS or the bus, so no final dump; the instance just goes.
            warned = self.timeline.now()
            self.timeline.point(
                instance_id, "warning", f"interruption {number}: {instance_id} terminated, its warning missed"
            )
            self.watcher.vm_stopped(instance_id)
            self.cloud.client("ec2").terminate_instances(InstanceIds=[instance_id])
            return warned
        if self.options.rebalance_lead_s > 0:
            self.timeline.say(f"rebalance recommendation for {instance_id}")
            self.cloud.emit_ec2(catalog.REBALANCE_RECOMMENDATION, instance_id, {})
            time.sleep(self.options.rebalance_lead_s)
        action_time = datetime.now(UTC) + timedelta(seconds=notice)
        vm.imds.instance_action = {"action": "terminate", "time": action_time.strftime("%Y-%m-%dT%H:%M:%SZ")}
        warned = self.timeline.now()
        self.timeline.point(
            instance_id,
            "warning",
            f"interruption {number}: spot interruption warning for {instance_id} (terminated in {notice:.0f} s)",
        )
        self.cloud.emit_ec2(catalog.INTERRUPTION_WARNING, instance_id, {"instance-action": "terminate"})

        def terminate() -> None:
            if self.cloud.sleep(notice):
                self.watcher.vm_stopped(instance_id)
                self.cloud.client("ec2").terminate_instances(InstanceIds=[instance_id])

        self.cloud.spawn(terminate, name=f"terminate-{instance_id}")
        return warned

    def job_record(self) -> dict[str, Any]:
        """The job's record as the control plane keeps it (the registry), each attribute as its plain value."""
        table = self.cloud.client("dynamodb")
        item = table.get_item(TableName=self.cloud.names["jobs_table"], Key={"job_id": {"S": self.job_id}})
        return {k: next(iter(v.values())) for k, v in item.get("Item", {}).items()}

    def _ended(self) -> dict[str, Any] | None:
        record = self.job_record()
        return record if record.get("status") in ENDED else None

    def _await_end(self, timeout_s: float) -> agent_events.JobExited:
        """The job's end as the control plane recorded it, which it takes from SSM's answer on the instance, never
        from what a VM puts on the bus (a forged JobExited ends nothing, here as in the account); then the agent's
        JobExited that the record confirms (same instance, exit code and result), for the result's location."""
        deadline = time.monotonic() + timeout_s
        while (record := self._ended()) is None:
            if time.monotonic() > deadline:
                raise RehearsalFailed(f"timed out after {timeout_s:.0f} s waiting for the job to finish")
            self.watcher.check_bootstrap()
            self._workflow_health()
            time.sleep(0.5)
        if "exit_code" not in record:
            self.watcher.check_bootstrap()
            raise RehearsalFailed(f"the job ended {record['status']} without exiting: {record.get('reason', '')}")
        code, instance, result = int(record["exit_code"]), record.get("instance_id"), record.get("result", "")

        def confirmed(detail_type: str, event: Any) -> bool:
            if detail_type != "JobExited":
                return False
            return bool((event.instance_id, event.exit_code, event.result) == (instance, code, result))

        return self.watcher.wait(confirmed, 30, f"the JobExited of the end the record names ({record})")

    def _result(self, exited: agent_events.JobExited) -> bytes:
        """The result file as the agent committed it to the store, where a user finds it (not from the VM)."""
        if not exited.result:
            raise RehearsalFailed(
                f"the job's result was not stored when it ended on {exited.instance_id}: {exited.result_error}"
            )
        try:
            return committed_result(self.cloud, exited.result, exited.job_id, self.options.result_file, exited.run_id)
        except (ResultError, StoreError) as error:
            raise RehearsalFailed(
                f"{self.options.result_file} of the stored result ({exited.result}): {error}"
            ) from None

    def _write_timeline(self) -> None:
        outcome = self.outcome
        summary = {
            "storage": self.options.storage,
            "size_mb": self.options.size_mb,
            "interruptions": self.options.interruptions,
            "notice_s": self.options.notice_s,
            "warning_to_running_s": self.recoveries_s,
            "warning_to_all_pages_s": self.all_pages_s,
            "final_dumps": self.watcher.final_dumps,
            "work_redone_s": self.watcher.work_redone_s,
            "boot_to_ready_s": self.watcher.boot_to_ready_s,
            "boot_phases_s": {vm: boot.phases_s for vm, boot in self.watcher.boots.items()},
            "agent_assets": {vm: boot.asset_url for vm, boot in self.watcher.boots.items()},
            "upgrade": self.upgrade,
            "command": command_tag(self.options),
            "result_file": self.options.result_file,
            "result": outcome.describe(outcome.result) if outcome else None,
            "expected": outcome.describe(outcome.expected) if outcome else None,
            "identical": outcome.identical if outcome else None,
        }
        job = "your command" if self.options.command is not None else f"{self.options.size_mb} MiB sample job"
        title = f"spotcr rehearsal: {self.options.storage}, {job}, {self.options.interruptions} interruption(s)" + (
            "" if outcome else " - FAILED"
        )
        json_path, png_path = self.timeline.write(self.run_dir, summary, title, png=self.options.timeline_png)
        self.timeline.say(f"timeline: {png_path} and {json_path}")
