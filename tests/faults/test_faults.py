"""The fault suite: the rehearsal (real handlers, real ASL through moto, real agent and CRIU on bare local VMs)
with one injected fault per scenario. The invariants each scenario asserts are in tests/faults/harness.py."""

from __future__ import annotations

import fcntl
import json
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from spotcr_agent.lazy import PAGES_IMAGE
from spotcr_agent.store import Manifest
from spotcr_contracts import events as agent_events
from spotcr_contracts.commands import checkpoint_order
from spotcr_contracts.layout import result_prefix, run_prefix
from spotcr_functions.cloud import Cloud
from spotcr_functions.config import ENV
from spotcr_functions.models import ENDED

from rehearsal.localaws.s3 import StoreFault
from rehearsal.sample_job import STOPPED_EXIT_CODE
from rehearsal.scenario import committed_result, reference_result
from tests.faults.harness import FaultRehearsal, kill_agent_commands, options
from tests.infra.support import allows
from tests.support import wait_for

pytestmark = [
    pytest.mark.faults,
    pytest.mark.criu,
    pytest.mark.timeout(300),
    pytest.mark.claim("At most one live copy"),
    pytest.mark.claim("Nothing left allocated"),
]


def _run(rehearsal: FaultRehearsal) -> Any:
    try:
        return rehearsal.run_checked()
    except Exception as error:
        raise AssertionError(f"{error}\n" + "\n".join(rehearsal.lines)) from None


def _the_end(rehearsal: FaultRehearsal) -> Any:
    """The run's one end. A dump ordered as the job ended re-sends its JobExited (Agent.checkpoint heals a lost
    one so), so the bus may carry it twice: every copy names the same run, exit code and result."""
    exits = rehearsal.events("JobExited")
    assert exits, rehearsal.lines
    assert {(e.run_id, e.exit_code, e.result) for e in exits} == {
        (exits[0].run_id, exits[0].exit_code, exits[0].result)
    }
    return exits[0]


def _assert_invariants(rehearsal: FaultRehearsal, outcome: Any, *, status: str = "COMPLETED") -> None:
    log = "\n".join(rehearsal.lines)
    assert rehearsal.sampler.samples > 0, log
    assert rehearsal.sampler.overlaps == [], f"two live copies at {rehearsal.sampler.overlaps}\n{log}"
    record = rehearsal.end["record"]
    assert record["status"] == status, f"{record}\n{log}"
    if status == "COMPLETED":
        assert outcome.result == outcome.expected, log


def _first(rehearsal: FaultRehearsal, detail_type: str, predicate: Any, react: Any) -> None:
    """Run `react(event)` once, on the first event of this type that satisfies predicate."""
    done = threading.Event()

    def reaction(kind: str, event: Any) -> None:
        if kind == detail_type and predicate(event) and not done.is_set():
            done.set()
            react(event)

    rehearsal.reactions.append(reaction)


def test_store_outage_during_the_final_dump_stops_the_primary_and_restores_the_periodic(reference, cloud, tmp_path):
    # Given the checkpoint store unreachable from the warning until the final dump has failed
    rehearsal = FaultRehearsal(options(reference, tmp_path), cloud)
    warn = rehearsal.warn

    def interrupt(instance_id: str, number: int) -> float:
        # Holding the agent's dump lock: no periodic dump is half done when the warning comes, so the final dump
        # starts (and fails) within the notice rather than queue behind it.
        with rehearsal.cloud.vms[instance_id].host_path("/var/lib/spotcr/dump.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            rehearsal.outage.set()
            return warn(instance_id, number)

    rehearsal._interrupt = interrupt  # type: ignore[method-assign]
    _first(rehearsal, "CheckpointFailed", lambda e: e.kind == "final", lambda e: rehearsal.outage.clear())
    _first(rehearsal, "AgentReady", lambda e: e.mode == "restore", lambda e: rehearsal.outage.clear())

    # When the job is interrupted
    outcome = _run(rehearsal)

    # Then the primary's agent stopped the job (never two copies), and the backup restored the periodic checkpoint
    failed = [e for e in rehearsal.events("CheckpointFailed") if e.kind == "final"]
    assert failed and all(e.job_stopped for e in failed), rehearsal.lines
    [restored] = rehearsal.events("RestoreCompleted")
    assert restored.checkpoint_id.endswith("-periodic")
    _assert_invariants(rehearsal, outcome)


@pytest.mark.claim("A store outage fails a dump, not the job")
def test_store_outage_during_a_periodic_dump_fails_that_dump_only(reference, cloud, tmp_path):
    # Given a store outage from the first periodic checkpoint until the next periodic dump has failed
    rehearsal = FaultRehearsal(options(reference, tmp_path, checkpoints_before_interruption=2), cloud)
    _first(rehearsal, "CheckpointCompleted", lambda e: e.kind == "periodic", lambda e: rehearsal.outage.set())
    _first(rehearsal, "CheckpointFailed", lambda e: e.kind == "periodic", lambda e: rehearsal.outage.clear())

    # When the job is interrupted after a later periodic checkpoint
    outcome = _run(rehearsal)

    # Then the failed dump changed nothing: the job recovered and ended with the uninterrupted result
    assert [e for e in rehearsal.events("CheckpointFailed") if e.kind == "periodic"], rehearsal.lines
    _assert_invariants(rehearsal, outcome)


@pytest.mark.claim("Never a partial checkpoint")
def test_the_agent_killed_mid_upload_loses_only_that_checkpoint(reference, cloud, tmp_path):
    # Given the agent's periodic-dump process killed while it uploads a chunk of the second periodic checkpoint
    rehearsal = FaultRehearsal(options(reference, tmp_path, checkpoints_before_interruption=2), cloud)
    armed, killed = threading.Event(), []

    def upload(action: str, key: str) -> None:
        if armed.is_set() and action == "put_object" and "/chunks/" in key:
            armed.clear()
            for vm in list(rehearsal.cloud.vms.values()):
                killed.extend(kill_agent_commands(vm, b"checkpoint"))

    rehearsal.store_hooks.append(upload)
    _first(rehearsal, "CheckpointCompleted", lambda e: e.kind == "periodic", lambda e: armed.set())

    # When the job is interrupted after a later periodic checkpoint
    outcome = _run(rehearsal)

    # Then the killed upload was never taken for a checkpoint, and the job recovered from a whole one
    assert killed, rehearsal.lines
    _assert_invariants(rehearsal, outcome)


def _vanish(rehearsal: FaultRehearsal, instance_id: str) -> float:
    """The instance goes away with no warning (the missed-warning path): no final dump."""
    rehearsal.timeline.say(f"fault: {instance_id} vanishes without a warning")
    rehearsal.cloud.client("ec2").terminate_instances(InstanceIds=[instance_id])
    return rehearsal.timeline.now()


@pytest.mark.claim("Restore walks back past damaged checkpoints")
def test_a_corrupt_newest_checkpoint_is_skipped_for_the_one_before(reference, cloud, tmp_path):
    # Given two periodic checkpoints, the newest with a corrupt manifest, and a primary that vanishes with no warning
    rehearsal = FaultRehearsal(options(reference, tmp_path, checkpoints_before_interruption=2), cloud)
    s3 = rehearsal.cloud.client("s3")
    bucket = rehearsal.cloud.names["checkpoint_bucket"]

    def corrupt_and_vanish(instance_id: str, number: int) -> float:
        completed = rehearsal.events("CheckpointCompleted")
        periodic = sorted(e.checkpoint_id for e in completed)
        key = f"{run_prefix(rehearsal.job_id, completed[-1].run_id)}checkpoints/{periodic[-1]}.json"
        s3.put_object(Bucket=bucket, Key=key, Body=b'{"corrupt": ')
        rehearsal.timeline.say(f"fault: {key} corrupted")
        return _vanish(rehearsal, instance_id)

    rehearsal._interrupt = corrupt_and_vanish  # type: ignore[method-assign]

    # When the job recovers
    outcome = _run(rehearsal)

    # Then the restore skipped the corrupt checkpoint, said why, and restored the one before
    [restored] = rehearsal.events("RestoreCompleted")
    periodic = sorted(
        e.checkpoint_id for e in rehearsal.events("CheckpointCompleted") if e.instance_id != restored.instance_id
    )
    assert restored.checkpoint_id == periodic[-2] and periodic[-1] in restored.skipped, rehearsal.lines
    _assert_invariants(rehearsal, outcome)


@pytest.mark.claim("Duplicated and reordered events recover once")
@pytest.mark.claim("Facts come from authenticated sources")
def test_duplicated_and_reordered_warnings_start_one_recovery(reference, cloud, tmp_path):
    # Given a warning delivered three times, with a rebalance recommendation and a stale "running" after it
    from spotcr_functions import catalog

    rehearsal = FaultRehearsal(options(reference, tmp_path), cloud)
    warn = rehearsal.warn

    def storm(instance_id: str, number: int) -> float:
        warned = warn(instance_id, number)
        emit = rehearsal.cloud.emit_ec2
        emit(catalog.INTERRUPTION_WARNING, instance_id, {"instance-action": "terminate"})
        emit(catalog.REBALANCE_RECOMMENDATION, instance_id, {})
        emit(catalog.STATE_CHANGE, instance_id, {"state": "running"})
        emit(catalog.INTERRUPTION_WARNING, instance_id, {"instance-action": "terminate"})
        return warned

    rehearsal._interrupt = storm  # type: ignore[method-assign]
    # And, while the job runs, a JobExited (code 0) that any job VM could put on the bus for it: a forgery
    forged: list[str] = []

    def forge(started: Any) -> None:
        exited = agent_events.JobExited(
            started.job_id, started.instance_id, started.generation, started.at, run_id=started.run_id, exit_code=0
        )
        entry = exited.to_entry(rehearsal.cloud.names["event_bus_name"])
        rehearsal.cloud.client("events").put_events(Entries=[entry])
        forged.append(started.instance_id)

    _first(rehearsal, "JobStarted", lambda e: True, forge)

    # When the job recovers
    outcome = _run(rehearsal)

    # Then one workflow ran and one backup was launched
    assert len(rehearsal.end["workflows"]) == 1 and len(rehearsal.end["backups"]) == 1, rehearsal.end
    # And the forged exit only made the control plane ask that instance through SSM: the job ran on to its result
    status_document = rehearsal.cloud.settings_env[ENV["status_document"]]
    sent = rehearsal.cloud.client("ssm").list_commands()["Commands"]
    asked = [c["InstanceIds"] for c in sent if c["DocumentName"] == status_document]
    assert forged and [forged[0]] in asked, rehearsal.lines
    _assert_invariants(rehearsal, outcome)


@pytest.mark.claim("Backups are first-class")
def test_a_backup_interrupted_while_it_restores_hands_the_job_to_another(reference, cloud, tmp_path):
    # Given the first backup warned the moment its restore command starts
    rehearsal = FaultRehearsal(options(reference, tmp_path), cloud)
    primary: list[str] = []
    warned = threading.Event()

    def on_command(instance_id: str, argv: list[str]) -> None:
        if "restore" in argv and not warned.is_set():
            warned.set()
            rehearsal.timeline.say(f"fault: backup {instance_id} warned as its restore starts")
            threading.Thread(target=rehearsal.warn, args=(instance_id, 2), daemon=True).start()

    rehearsal.cloud.on_command = on_command
    del primary

    # When the job recovers
    outcome = _run(rehearsal)

    # Then a second backup took over and the job ended with the uninterrupted result
    assert warned.is_set() and len(rehearsal.end["backups"]) == 2, rehearsal.end
    _assert_invariants(rehearsal, outcome)


@pytest.mark.claim("Backups are first-class")
def test_a_backup_interrupted_right_after_its_restore_hands_the_job_on(reference, cloud, tmp_path):
    # Given a second interruption the moment the first backup has restored the job (before any periodic dump there)
    rehearsal = FaultRehearsal(options(reference, tmp_path, interruptions=2), cloud)
    await_periodic = rehearsal._await_periodic

    def no_wait_on_backups(instance_id: str, generation: int, number: int) -> None:
        if number == 1:
            await_periodic(instance_id, generation, number)

    rehearsal._await_periodic = no_wait_on_backups  # type: ignore[method-assign]

    # When the job recovers twice
    outcome = _run(rehearsal)

    # Then it ended with the uninterrupted result, after two restores
    assert len(rehearsal.events("RestoreCompleted")) >= 2, rehearsal.lines
    _assert_invariants(rehearsal, outcome)


def _ends_failed(rehearsal: FaultRehearsal) -> None:
    _run(rehearsal)
    record = rehearsal.end["record"]
    assert f"code {STOPPED_EXIT_CODE}" in record.get("reason", ""), record
    _assert_invariants(rehearsal, None, status="FAILED")


def _until_ended(rehearsal: FaultRehearsal, bound_s: float = 60.0) -> None:
    """Poll (bounded) until the job's record has ended: events are handled asynchronously."""
    deadline = time.monotonic() + bound_s
    while rehearsal.job_record().get("status") not in ENDED:
        if time.monotonic() > deadline:
            raise AssertionError(f"the confirmed exit did not end the job: {rehearsal.job_record()}")
        time.sleep(0.2)


@pytest.mark.claim("Exactly one end")
def test_a_job_that_exits_before_the_warning_is_not_recovered(reference, cloud, tmp_path):
    # Given a job that exits (code 3) on its primary, and then the warning
    rehearsal = FaultRehearsal(options(reference, tmp_path, exit_code=STOPPED_EXIT_CODE), cloud)

    def exit_then_warn(number: int, current: str, generation: int) -> tuple[str, int]:
        rehearsal._await_periodic(current, generation, number)
        rehearsal.stop_job_on(current)
        rehearsal.watcher.wait(lambda t, e: t == "JobExited", 60, "the job to exit")
        # The exit ends the job once SSM's result of the status command confirms it (exits.on_status_command)
        _until_ended(rehearsal)
        rehearsal.warn(current, number)
        return current, generation

    rehearsal._interruption = exit_then_warn  # type: ignore[method-assign]

    # Then it ends FAILED with its exit code, and no backup was launched
    _ends_failed(rehearsal)
    assert rehearsal.end["backups"] == [], rehearsal.end


@pytest.mark.claim("Exactly one end")
def test_a_job_that_exits_during_its_final_dump_ends_once(reference, cloud, tmp_path):
    # Given a job told to exit at the moment of the warning: it exits before the freeze, or on the backup. Its exit
    # is confirmed by SSM's answer on the primary, which must come before the primary goes: the final-dump command's
    # own answer carries it (checkpoints.reported_dump). Before it did, only a status command confirmed it, and the
    # primary was once retired 6.2 s after the warning (its backup ready at 4.9 s), about 0.4 s before that command
    # would have answered: the job ran again from its periodic checkpoint. On a loaded 2-core host the agent's start
    # alone takes 1.5 s, and a 6 s notice was sometimes too short for either answer.
    rehearsal = FaultRehearsal(options(reference, tmp_path, exit_code=STOPPED_EXIT_CODE, notice_s=15.0), cloud)

    def exit_at_warning(number: int, current: str, generation: int) -> tuple[str, int]:
        rehearsal._await_periodic(current, generation, number)
        rehearsal.stop_job_on(current)
        rehearsal.warn(current, number)
        return current, generation

    rehearsal._interruption = exit_at_warning  # type: ignore[method-assign]

    # Then it ends FAILED with its exit code, once
    _ends_failed(rehearsal)


@pytest.mark.claim("Exactly one end")
def test_a_job_that_exits_right_after_its_restore_ends_on_the_backup(reference, cloud, tmp_path):
    # Given a job that exits (code 3) as soon as the backup has restored it
    rehearsal = FaultRehearsal(options(reference, tmp_path, exit_code=STOPPED_EXIT_CODE), cloud)
    _first(rehearsal, "RestoreCompleted", lambda e: True, lambda e: rehearsal.stop_job_on(e.instance_id))

    # Then it ends FAILED with its exit code, on the backup
    _ends_failed(rehearsal)
    assert rehearsal.events("JobExited")[-1].instance_id in rehearsal.end["backups"]


@pytest.mark.claim("One identity per run")
def test_a_second_instance_with_a_running_jobs_name_never_starts_it(reference, cloud, tmp_path):
    # Given a job running, and a second instance submitted with the same job name
    rehearsal = FaultRehearsal(options(reference, tmp_path), cloud)
    interruption = rehearsal._interruption
    second: list[str] = []

    def collide(number: int, current: str, generation: int) -> tuple[str, int]:
        second.append(rehearsal._submit())
        rehearsal.watcher.wait(lambda t, e: t == "AgentReady" and e.instance_id == second[0], 120, "the second VM")
        return interruption(number, current, generation)

    rehearsal._interruption = collide  # type: ignore[method-assign]

    # When the first is interrupted and recovers
    outcome = _run(rehearsal)

    # Then the second instance never ran the job, and the job ended with its own result
    assert [e for e in rehearsal.events("JobStarted") if e.instance_id in second] == [], rehearsal.lines
    _assert_invariants(rehearsal, outcome)


@pytest.mark.claim("One identity per run")
@pytest.mark.claim("Old runs are pruned, never under a commit")
def test_a_job_name_run_again_never_sees_the_earlier_runs_checkpoints(reference, cloud, tmp_path):
    # Given a job that ran to its end, with periodic checkpoints, under a name
    earlier = FaultRehearsal(options(b"", tmp_path / "earlier", steps=1000, interruptions=0), cloud)
    earlier_outcome = _run(earlier)
    assert earlier.events("CheckpointCompleted"), earlier.lines

    # When a new run with another command is submitted under the same name, and its instance vanishes before its
    # first checkpoint
    # (at its pace: the new run's VM prunes the earlier run in the background while the job runs)
    rehearsal = FaultRehearsal(options(reference, tmp_path / "again", hurry_file=""), cloud)
    rehearsal.job_id = earlier.job_id
    rehearsal._await_periodic = lambda instance_id, generation, number: None  # type: ignore[method-assign]
    rehearsal._interrupt = lambda instance_id, number: _vanish(rehearsal, instance_id)  # type: ignore[method-assign]
    outcome = _run(rehearsal)

    # Then it started from its own beginning (nothing of the earlier run restored): its own result
    _assert_invariants(rehearsal, outcome)
    # And the earlier run's stored result is still its own: each run's result is under its run
    ended = _the_end(earlier)
    kept = committed_result(cloud, ended.result, ended.job_id, earlier.options.result_file, ended.run_id)
    assert kept == earlier_outcome.result != outcome.result, rehearsal.lines
    # And the new run's VM pruned the earlier run (Agent.delete_earlier_runs, in the background once the job
    # started): nothing of it is left in the store but its result
    s3, prefix = cloud.client("s3"), run_prefix(ended.job_id, ended.run_id)

    def left() -> list[str]:
        found = s3.list_objects_v2(Bucket=cloud.names["checkpoint_bucket"], Prefix=prefix).get("Contents", [])
        return sorted({o["Key"].removeprefix(prefix).split("/", 1)[0] for o in found})

    deadline = time.monotonic() + 30
    while left() != ["result"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left() == ["result"], rehearsal.lines


@pytest.mark.claim("Attempts and order")
def test_a_backup_whose_clock_is_120_s_behind_has_its_checkpoints_taken_as_newest(
    reference, cloud, tmp_path, monkeypatch
):
    # Given a backup VM whose agent (its daemon and every command, hence its checkpoint ids) runs with a wall clock
    # 120 s behind the primary's. Only the wall clock is behind (monotonic clocks run as on any VM: CRIU's time
    # namespace restores them), and only in the agent, whose clock names the checkpoints: a sitecustomize on the
    # agent's path, in the backup's own /opt/spotcr, shifts time.time and time.time_ns. (libfaketime, used before,
    # hung the agent's at-freeze handshake with CRIU in about 1 run in 5: that thread vanished with CRIU waiting.)
    # The job runs on at its pace on the backup, which must checkpoint there.
    rehearsal = FaultRehearsal(options(reference, tmp_path, hurry_file=""), cloud)
    warn = rehearsal.warn
    behind = (
        "import time\n"
        "_time, _time_ns = time.time, time.time_ns\n"
        "time.time = lambda: _time() - 120.0\n"
        "time.time_ns = lambda: _time_ns() - 120_000_000_000\n"
    )
    skew = ["/bin/sh", "-c", f"printf '%s' {shlex.quote(behind)} > /opt/spotcr/lib/sitecustomize.py"]

    def interrupt(instance_id: str, number: int) -> float:
        # For the VMs launched from now on (the backup): the agent as its boot installed it, then its clock set behind
        boot, *rest = cloud.boot_commands
        monkeypatch.setattr(cloud, "boot_commands", [boot, skew, *rest])
        return warn(instance_id, number)

    rehearsal._interrupt = interrupt  # type: ignore[method-assign]

    # When the job is interrupted and finishes on that backup
    outcome = _run(rehearsal)

    # Then the backup's checkpoints, older by their ids' clock than the primary's, were each the job's newest
    [restored] = rehearsal.events("RestoreCompleted")
    backup = restored.instance_id
    before = [e.checkpoint_id for e in rehearsal.events("CheckpointCompleted") if e.instance_id != backup]
    after = [e.checkpoint_id for e in rehearsal.events("CheckpointCompleted") if e.instance_id == backup]
    assert after and all(a < b for a in after for b in before), rehearsal.lines  # the skew is real
    assert rehearsal.end["record"]["checkpoint_id"] == after[-1], rehearsal.lines
    _assert_invariants(rehearsal, outcome)


@pytest.mark.claim("Never a partial checkpoint")
def test_the_agent_killed_during_its_final_upload_restores_the_periodic_with_one_live_copy(reference, cloud, tmp_path):
    # Given every agent process of the primary (daemon and commands) killed at the final dump's first chunk upload
    rehearsal = FaultRehearsal(options(reference, tmp_path), cloud)
    warn, armed, killed, warned = rehearsal.warn, threading.Event(), [], []

    def interrupt(instance_id: str, number: int) -> float:
        warned.append(instance_id)
        # Holding the agent's dump lock: no periodic dump is half done when the warning comes, so the next chunk
        # uploaded is the final dump's.
        with rehearsal.cloud.vms[instance_id].host_path("/var/lib/spotcr/dump.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            armed.set()
            return warn(instance_id, number)

    def upload(action: str, key: str) -> None:
        if armed.is_set() and action == "put_object" and "/chunks/" in key:
            armed.clear()
            killed.extend(kill_agent_commands(rehearsal.cloud.vms[warned[0]], b"spotcr_agent"))

    rehearsal._interrupt = interrupt  # type: ignore[method-assign]
    rehearsal.store_hooks.append(upload)

    # When the job is interrupted
    outcome = _run(rehearsal)

    # Then no final dump committed, the backup restored the periodic checkpoint, and the job never ran twice
    assert killed, rehearsal.lines
    assert not [e for e in rehearsal.events("CheckpointCompleted") if e.kind == "final"], rehearsal.lines
    [restored] = rehearsal.events("RestoreCompleted")
    assert restored.checkpoint_id.endswith("-periodic")
    _assert_invariants(rehearsal, outcome)


def _ask_status(rehearsal: FaultRehearsal, instance_id: str, bound_s: float) -> dict[str, Any]:
    """Send the agent's status command as the control plane does (exits.ask_exit), and wait (bounded) for it."""
    ssm = rehearsal.cloud.client("ssm")
    sent = ssm.send_command(
        InstanceIds=[instance_id],
        DocumentName=rehearsal.cloud.settings_env[ENV["status_document"]],
        Parameters={"JobId": [rehearsal.job_id]},
    )["Command"]
    deadline = time.monotonic() + bound_s
    while True:
        answer = ssm.get_command_invocation(CommandId=sent["CommandId"], InstanceId=instance_id)
        if answer["Status"] not in ("Pending", "InProgress", "Delayed"):
            return dict(answer)
        if time.monotonic() > deadline:
            return dict(answer)
        time.sleep(0.5)


@pytest.mark.claim("A status command after the end answers at once")
def test_a_status_command_after_the_end_answers_at_once(reference, cloud, tmp_path):
    # Given a job that ran to its end, its instance still up (the user's), and the control plane asking its agent
    # again once the job has ended (as the scheduler's exits.ask_again may, in the tick that ends it)
    rehearsal = FaultRehearsal(options(reference, tmp_path, interruptions=0), cloud)
    asked: dict[str, Any] = {}

    def ask_after_the_end() -> None:
        started = time.monotonic()
        asked["answer"] = _ask_status(rehearsal, rehearsal.end["record"]["instance_id"], 60.0)
        asked["seconds"] = time.monotonic() - started

    rehearsal.before_cleanup.append(ask_after_the_end)

    # When the job runs to its end
    outcome = _run(rehearsal)

    # Then the status command answered at once from what the VM holds, saying its store is no longer served
    answer = asked["answer"]
    assert answer["Status"] == "Success" and asked["seconds"] < 30, (asked, rehearsal.lines)
    status = json.loads(answer["StandardOutputContent"])
    assert status["job_status"] == "exited" and "has ended (COMPLETED)" in status["criu_logs_error"], status
    _assert_invariants(rehearsal, outcome)


@pytest.mark.claim("A mount the backup lacks ends in a start from scratch, not FAILED")
def test_a_mount_the_backup_lacks_ends_in_a_start_from_scratch_with_the_right_result(reference, cloud, tmp_path):
    # Given a primary whose own boot made a mount (a tmpfs on /srv) that backups, booted by spotcr alone, lack
    rehearsal = FaultRehearsal(options(reference, tmp_path), cloud)
    submit = rehearsal._submit
    mount = ["/bin/sh", "-c", "mount -t tmpfs -o size=1m fault-mount /srv"]

    def submit_with_a_mount() -> str:
        plain = cloud.boot_commands
        cloud.boot_commands = [mount, *plain]  # read when the VM is made, inside RunInstances
        try:
            return submit()
        finally:
            cloud.boot_commands = plain

    rehearsal._submit = submit_with_a_mount  # type: ignore[method-assign]

    # When the job is interrupted after its periodic checkpoint
    outcome = _run(rehearsal)

    # Then the backup skipped every checkpoint naming the mount, and started the job over: the right result
    [restored] = rehearsal.events("RestoreCompleted")
    assert restored.checkpoint_id == "" and "had /srv mounted" in restored.skipped, rehearsal.lines
    _assert_invariants(rehearsal, outcome)


@pytest.mark.claim("A run's store session reaches nothing of an earlier run's result")
def test_a_runs_store_session_reaches_nothing_of_an_earlier_runs_result(reference, cloud, tmp_path, monkeypatch):
    # Given a job that ran to its end under a name, its result stored under its run
    earlier = FaultRehearsal(options(b"", tmp_path / "earlier", steps=500, interruptions=0), cloud)
    _run(earlier)
    ended = _the_end(earlier)
    s3, bucket = cloud.client("s3"), cloud.names["checkpoint_bucket"]
    kept_prefix = result_prefix(ended.job_id, ended.run_id)
    kept = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=kept_prefix).get("Contents", [])]
    assert kept, earlier.lines

    # When a new run of the name gets its store sessions (each session policy is recorded as the store role is
    # assumed: the local S3 does not evaluate it, AWS does)
    policies: list[tuple[str, dict[str, Any]]] = []
    assume = Cloud.assume_store_role

    def recorded(self: Cloud, **kwargs: Any) -> dict[str, Any]:
        policies.append((kwargs["session_name"], kwargs["policy"]))
        return assume(self, **kwargs)

    monkeypatch.setattr(Cloud, "assume_store_role", recorded)
    rehearsal = FaultRehearsal(options(reference, tmp_path / "again", interruptions=0), cloud)
    rehearsal.job_id = earlier.job_id
    outcome = _run(rehearsal)

    # Then no session of the new run may read, overwrite or delete any object of the earlier run's result
    mine = [policy for instance_id, policy in policies if instance_id in rehearsal.sampler.seen_on]
    assert mine, rehearsal.lines
    for policy in mine:
        for key in kept:
            for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"):
                assert not allows(policy["Statement"], action, f"arn:aws:s3:::{bucket}/{key}", {}), (action, key)
    _assert_invariants(rehearsal, outcome)


# A job whose memory spans several packs, so that one pack holds nothing but the middle of its pages image: a lazy
# restore reads that pack only in the background or when the running job touches it, never before the job runs.
LAZY_MB = 128
LAZY_STEPS = 1200  # 24 s of job: one periodic checkpoint, the warning, the lazy restore and the rest


def _lazy_options(reference: bytes, runs_dir: Path) -> Any:
    # At its pace: the faults strike while the job runs on, its pages still streaming
    return options(reference, runs_dir, size_mb=LAZY_MB, steps=LAZY_STEPS, notice_s=20.0, hurry_file="")


@pytest.fixture(scope="module")
def lazy_reference(shared_cloud: Any, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The uninterrupted result of the LAZY_MB job (the result depends on the job's size)."""
    lazy = _lazy_options(b"", tmp_path_factory.mktemp("lazy-reference"))
    return reference_result(shared_cloud, lazy, "/var/lib/spotcr/work/lazy-reference", print, lambda vm: None)


def _middle_pack(rehearsal: FaultRehearsal) -> str:
    """The key of a pack of the newest checkpoint that holds only chunks of the middle of the job's pages image."""
    s3, bucket = rehearsal.cloud.client("s3"), rehearsal.cloud.names["checkpoint_bucket"]
    run = run_prefix(rehearsal.job_id, rehearsal.events("CheckpointCompleted")[-1].run_id)
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{run}checkpoints/")["Contents"]
    newest = max((Path(o["Key"]).stem for o in listed), key=checkpoint_order)
    manifest = Manifest.from_json(
        s3.get_object(Bucket=bucket, Key=f"{run}checkpoints/{newest}.json")["Body"].read(), newest
    )
    middle: dict[str, bool] = {}
    for entry in manifest.files:
        offset = 0
        for chunk in entry.chunks:
            inside = PAGES_IMAGE.fullmatch(entry.path) is not None and entry.size // 10 <= offset < entry.size * 9 // 10
            if chunk.pack is not None:
                middle[chunk.pack] = middle.get(chunk.pack, True) and inside
            offset += chunk.size
    packs = [pack for pack, only in middle.items() if only]
    assert packs, f"no pack of {newest} holds only the middle of the job's memory"
    return f"{run}chunks/packs/{packs[0]}"


def _restored_on(rehearsal: FaultRehearsal, primary: str) -> set[str]:
    """The VMs but the primary on which `criu restore` has rebuilt the job: its PID file is written."""
    return {
        instance_id
        for instance_id, vm in list(rehearsal.cloud.vms.items())
        if instance_id != primary and list(vm.host_path("/var/lib/spotcr/scratch").glob("restore-*.logs/restore.pid"))
    }


def _lazy_fault(rehearsal: FaultRehearsal, strike: Callable[[str], None]) -> dict[str, Any]:
    """Once the backup restores, every read of a middle pack waits until the restored job runs there; the first
    then strikes (strike(key)). Returns what happened: the pack, and the VMs the job ran on when it struck."""
    seen: dict[str, Any] = {}
    warn = rehearsal.warn
    # Two locks: the strike's own read of the pack must find the pack known without waiting for the strike.
    finding, striking = threading.Lock(), threading.Lock()

    def interrupt(instance_id: str, number: int) -> float:
        seen["primary"] = instance_id
        return warn(instance_id, number)

    def hook(action: str, key: str) -> None:
        if action != "get_object" or "/chunks/packs/" not in key or "primary" not in seen:
            return
        with finding:
            if "pack" not in seen:
                seen["pack"] = _middle_pack(rehearsal)
        if key != seen["pack"] or "struck" in seen:
            return
        # Until the job runs on the backup (CRIU wrote its PID: reading its /proc/PID/cmdline would wait for a
        # page, queued behind this read), or another read struck (this one may come after that job was killed)
        hosts = wait_for(lambda: "struck" in seen or _restored_on(rehearsal, seen["primary"]), "the job on the backup")
        with striking:  # the other reads waiting here go on once the fault is in place
            if "struck" in seen:
                return
            seen["struck"] = hosts
            rehearsal.timeline.say(f"fault: reading {key} while the job runs lazily on {hosts}")
            strike(key)

    rehearsal._interrupt = interrupt  # type: ignore[method-assign]
    rehearsal.store_hooks.append(hook)
    return seen


@pytest.mark.claim("A lazy restore never lets the job read a page that did not arrive")
def test_a_store_brownout_while_pages_stream_kills_the_lazy_job_and_restores_it_again(lazy_reference, cloud, tmp_path):
    # Given a store that fails a read of the job's memory once the backup's job runs on its lazily restored memory
    rehearsal = FaultRehearsal(_lazy_options(lazy_reference, tmp_path), cloud)

    def brownout(key: str) -> None:
        raise StoreFault(f"injected brownout reading {key}")

    seen = _lazy_fault(rehearsal, brownout)

    # When the job is interrupted and restored
    outcome = _run(rehearsal)

    # Then the job that ran on half its memory was killed (never two copies, never a wrong result), the same
    # checkpoint was restored again, and the job ended with the uninterrupted result
    assert seen.get("struck"), rehearsal.lines
    [restored] = rehearsal.events("RestoreCompleted")
    assert restored.lazy and restored.checkpoint_id.endswith("-final"), rehearsal.lines
    _assert_invariants(rehearsal, outcome)


@pytest.mark.claim("A lazy restore never lets the job read a page that did not arrive")
@pytest.mark.claim("Restore walks back past damaged checkpoints")
def test_a_chunk_corrupt_while_pages_stream_kills_the_lazy_job_and_the_walk_goes_on(lazy_reference, cloud, tmp_path):
    # Given a pack of the job's memory that reads corrupt once the backup's job runs on its lazily restored memory
    rehearsal = FaultRehearsal(_lazy_options(lazy_reference, tmp_path), cloud)
    s3, bucket = rehearsal.cloud.client("s3"), rehearsal.cloud.names["checkpoint_bucket"]

    def corrupt(key: str) -> None:
        body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        for offset in range(0, len(body), 1 << 16):  # a flipped byte every 64 KiB: every chunk in it is damaged
            body[offset] ^= 0xFF
        s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))

    seen = _lazy_fault(rehearsal, corrupt)

    # When the job is interrupted and restored
    outcome = _run(rehearsal)

    # Then the job that ran on the corrupt checkpoint was killed, the checkpoint skipped as corrupt, an older one
    # restored (or the job started over, where the damaged pack is shared), and the job ended with the right result
    assert seen.get("struck"), rehearsal.lines
    [restored] = rehearsal.events("RestoreCompleted")
    # (a flipped byte reads as a hash mismatch, or as a broken zstd frame where it lands in a frame's header)
    assert "-final: " in restored.skipped and "is corrupt: chunk" in restored.skipped, rehearsal.lines
    _assert_invariants(rehearsal, outcome)
