"""Facts from authenticated sources: a checkpoint is taken from SSM's result of the checkpoint command on the VM
that dumped (checkpoints.on_checkpoint_command), a restore from SSM's result of the restore command on the backup, a
job's exit from SSM's result of the status command on the instance it ended on (exits.on_status_command).

The agent's CheckpointCompleted, CheckpointFailed, RestoreCompleted, RestoreFailed and JobExited are telemetry: any
job VM that knows a run id could put them (a forged final dump: tests/workflow/test_one_live_copy.py). What moves
the Restore step is GetCommandInvocation of the command the step sent, read when SSM's status-change event (source
aws.ssm, which no VM can put) arrives, or when the wait times out (recovery.check_restore).
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import boto3
import pytest
from moto.ssm.models import ssm_backends
from spotcr_contracts import events, results
from spotcr_functions import catalog, recovery
from spotcr_functions.config import ENV
from spotcr_functions.models import Status

from rehearsal.controlplane import (
    ACCOUNT,
    REGION,
    ControlPlane,
    agent_event,
    answer_exit,
    checkpoint_id,
    command_ended,
    ec2_event,
    end_checkpoint_command,
    end_restore_command,
    end_status_command,
    finish_checkpoint,
    finish_exit,
    finish_restore,
    invoke_function,
    load_event,
    now_iso,
    route,
)
from rehearsal.localaws.ssm import command_ended_detail
from tests.workflow.support import ordered_sequence

pytestmark = pytest.mark.claim("Facts come from authenticated sources")


def _restoring(plane: ControlPlane, job_id: str) -> tuple[str, str, str]:
    """A job interrupted with a periodic checkpoint, its backup ready and its restore ordered."""
    primary = plane.start_job(job_id)
    periodic = checkpoint_id("periodic", 0)
    finish_checkpoint(events.CheckpointCompleted(job_id, primary, 0, now_iso(), checkpoint_id=periodic))
    route(ec2_event("state-change-terminated", primary))
    backup = plane.wait_until(lambda: plane.job(job_id).backup_instance_id, "the backup launch")
    route(agent_event(events.AgentReady(job_id, backup, 1, now_iso(), mode="restore")))
    plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    plane.wait_for_token(job_id, "restore")
    return primary, backup, periodic


def _backup_state(plane: ControlPlane, backup: str) -> str:
    [instance] = [i for i in plane.backups() if i["InstanceId"] == backup]
    return str(instance["State"]["Name"])


def test_a_forged_restore_completed_moves_nothing(plane: ControlPlane) -> None:
    # Given a job whose backup restores, and another job's VM that knows its run id
    _, backup, periodic = _restoring(plane, "forged-1")
    other = plane.start_job("other-1")
    run_id = plane.job("forged-1").run_id

    # When that VM puts RestoreCompleted and RestoreFailed for the job, as from itself and as from the backup
    for claimed in (other, backup):
        forged = events.RestoreCompleted("forged-1", claimed, 1, now_iso(), run_id=run_id, checkpoint_id=periodic)
        route(agent_event(forged))
        failed = events.RestoreFailed("forged-1", claimed, 1, now_iso(), run_id=run_id, attempt="newest", reason="x")
        route(agent_event(failed))
    # and SSM reports a restore-document command that ended on that other VM
    route(command_ended(other, "e8d3c0e4-71f7-4491-898f-c9b35bee5f3b", plane.documents["restore"], "Success"))

    # Then nothing arrived for the restore: the workflow still waits on its first attempt
    job = plane.job("forged-1")
    assert job.status == Status.RECOVERING
    assert job.arrival("restore") is None
    assert len(plane.sent_commands("restore")) == 1
    assert plane.executions()[0]["status"] == "RUNNING"

    # And the backup's own command result (SSM's event, then GetCommandInvocation) ends the recovery
    finish_restore(events.RestoreCompleted("forged-1", backup, 1, now_iso(), checkpoint_id=periodic, pid=42))
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    job = plane.job("forged-1")
    assert (job.status, job.instance_id) == (Status.RUNNING, backup)


def test_a_lost_status_change_event_still_ends_with_the_restore_taken(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a short restore wait, and a backup whose restore succeeded but whose SSM status-change event was lost
    monkeypatch.setenv(ENV["restore_wait_s"], "1")
    _, backup, periodic = _restoring(plane, "lost-1")
    end_restore_command(events.RestoreCompleted("lost-1", backup, 1, now_iso(), checkpoint_id=periodic, pid=7))

    # When the wait times out
    # Then the step asks SSM, takes the restore, and the job runs on its backup, which is not terminated
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    job = plane.job("lost-1")
    assert (job.status, job.instance_id) == (Status.RUNNING, backup)
    assert _backup_state(plane, backup) == "running"
    assert len(plane.sent_commands("restore")) == 1


def test_a_restore_still_running_when_the_wait_times_out_is_waited_for(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a restore wait that times out while the backup's restore command still runs (SSM: InProgress)
    monkeypatch.setenv(ENV["restore_wait_s"], "4")
    checks: list[dict[str, Any]] = []
    answer: list[events.RestoreCompleted] = []
    check = recovery.check_restore

    def checked(*args: Any) -> dict[str, Any]:
        result = check(*args)
        checks.append(result)
        if not result["restored"] and answer:
            end_restore_command(answer.pop())  # the restore ends right after SSM said it runs; its event is lost
        return result

    monkeypatch.setattr(recovery, "check_restore", checked)
    _, backup, periodic = _restoring(plane, "slow-1")
    answer.append(events.RestoreCompleted("slow-1", backup, 1, now_iso(), checkpoint_id=periodic))

    # When the wait times out, then the restore ends
    # Then the first check kept waiting, the next one took the restore: the backup runs the job
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    assert checks == [{"restored": False}, {"restored": True}]
    assert plane.job("slow-1").status == Status.RUNNING
    assert _backup_state(plane, backup) == "running"


def test_an_undeliverable_restore_command_fails_the_attempt(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a backup whose restore command SSM could not deliver, and whose status-change event was lost
    monkeypatch.setenv(ENV["restore_wait_s"], "1")
    _, backup, periodic = _restoring(plane, "gone-1")
    [command] = [c for c in ssm_backends[ACCOUNT][REGION]._commands if c.document_name == plane.documents["restore"]]
    for invocation in command.invocations:
        invocation.update({"Status": "Undeliverable", "StatusDetails": "Undeliverable"})

    # When the wait times out
    # Then the attempt failed: the next attempt is ordered (the walk starts one checkpoint back), and it ends the
    # recovery when the backup answers it
    plane.wait_until(lambda: len(plane.sent_commands("restore")) == 2, "the second restore")
    assert plane.job("gone-1").arrival("restore")["error"] == "RestoreFailed"  # type: ignore[index]
    finish_restore(events.RestoreCompleted("gone-1", backup, 1, now_iso(), checkpoint_id=periodic))
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"


def _interrupted(plane: ControlPlane, job_id: str) -> tuple[str, str]:
    """A job with a periodic checkpoint, interrupted: its final dump is ordered. Returns (primary, periodic)."""
    primary = plane.start_job(job_id)
    periodic = checkpoint_id("periodic", 0)
    finish_checkpoint(events.CheckpointCompleted(job_id, primary, 0, now_iso(), checkpoint_id=periodic))
    route(ec2_event("spot-interruption-warning", primary))
    return primary, periodic


def _restore_ordered(plane: ControlPlane, job_id: str) -> dict[str, Any]:
    backup = plane.wait_until(lambda: plane.job(job_id).backup_instance_id, "the backup launch")
    route(agent_event(events.AgentReady(job_id, backup, 1, now_iso(), mode="restore")))
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    return restore


def test_a_final_dump_whose_status_change_event_was_lost_is_read_from_ssm_before_the_restore(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a short final-dump wait, and a primary whose final dump committed but whose SSM event was lost
    monkeypatch.setenv(ENV["final_dump_wait_s"], "1")
    primary, _ = _interrupted(plane, "lostfinal-1")
    final = checkpoint_id("final", 1, sequence=ordered_sequence(plane, primary, "final"))
    report = events.CheckpointCompleted("lostfinal-1", primary, 1, now_iso(), checkpoint_id=final, kind="final")
    assert end_checkpoint_command(report) is not None

    # When the wait times out and the backup is ready
    restore = _restore_ordered(plane, "lostfinal-1")

    # Then the Restore step read the final dump from SSM first, and restores it
    assert restore["parameters"]["CheckpointId"] == final
    assert plane.job("lostfinal-1").checkpoint_id == final


def test_a_final_dump_command_that_ended_with_no_result_fails_the_final_dump_at_once(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an interrupted primary that went away under its final dump: SSM ends the command with no output
    primary, periodic = _interrupted(plane, "cutoff-1")
    plane.wait_for_token("cutoff-1", "final-dump")
    command_id = plane.job("cutoff-1").extra["command_final_dump"]["command_id"]
    [command] = [c for c in ssm_backends[ACCOUNT][REGION]._commands if c.command_id == command_id]
    for invocation in command.invocations:
        invocation.update({"Status": "Terminated", "StatusDetails": "Terminated", "StandardOutputContent": ""})

    # When SSM's status-change event for it arrives
    [(_, taken), *_] = route(command_ended(primary, command_id, plane.documents["checkpoint"], "Terminated"))

    # Then the final dump failed (nothing was stopped), and the workflow goes on to restore the periodic checkpoint
    # without waiting out the final-dump wait
    assert taken["action"] == "checkpoint-failed"
    arrival = plane.job("cutoff-1").arrival("final-dump")
    assert arrival is not None and arrival["error"] == "CheckpointFailed"
    assert "the final dump command ended Terminated on" in arrival["cause"]
    assert arrival["output"]["job_stopped"] is False
    assert _restore_ordered(plane, "cutoff-1")["parameters"]["CheckpointId"] == periodic


def test_awss_sample_status_change_event_reaches_the_command_result_function(plane: ControlPlane) -> None:
    # Given AWS's published sample "EC2 Command Invocation Status-change Notification" (tests/events/ssm)
    sample = load_event("ssm/command-invocation-status-change")
    sample.pop("_source")

    # When EventBridge delivers it
    delivered = route(sample)

    # Then the catalog's rule sends it to command-result, which reads what it needs from it (and ignores a
    # command of another document)
    assert [name for name, _ in delivered] == ["command-result"]
    assert delivered[0][1]["reason"] == "not the restore document: AWS-RunPowerShellScript"
    pattern = catalog.by_name("command-result").rules[0].pattern
    assert pattern is not None and pattern["detail-type"] == [sample["detail-type"]]


def test_the_rehearsals_status_change_event_is_shaped_as_awss_sample() -> None:
    # Given AWS's published sample, and the command it describes
    sample = load_event("ssm/command-invocation-status-change")
    detail = sample["detail"]
    requested = datetime(2016, 7, 10, 21, 51, 30, 49_000, tzinfo=UTC)

    # When the local rehearsal reports that command ended on that instance
    emitted = command_ended_detail(
        detail["instance-id"], detail["command-id"], detail["document-name"], "Success", requested
    )

    # Then its detail is the sample's, key for key and format for format
    assert emitted == detail


# A job's exit is taken from SSM's result of the status command on the instance said to have ended it
# (exits.on_status_command); the agent's JobExited only asks (agent_events._job_exited).


def _answer_status(instance_id: str, line: str) -> list[dict[str, Any]]:
    """That instance's agent answers the status commands sent to it with this line; SSM's events, not delivered."""
    backend = ssm_backends[ACCOUNT][REGION]
    ended = []
    for command in [c for c in backend._commands if str(c.document_name).endswith("-status")]:
        for invocation in command.invocations:
            if invocation["InstanceId"] == instance_id and not invocation.get("StandardOutputContent"):
                invocation.update({"Status": "Success", "ResponseCode": 0, "StandardOutputContent": line})
                ended.append(command_ended(instance_id, command.command_id, str(command.document_name), "Success"))
    return ended


def test_a_forged_job_exited_moves_nothing(plane: ControlPlane) -> None:
    # Given a running job, and another job's VM that knows its run id
    instance_id = plane.start_job("victim-1")
    other = plane.start_job("other-2")
    run_id = plane.job("victim-1").run_id

    # When that VM puts JobExited for the job, as from itself and as from the job's own instance
    for claimed in (other, instance_id):
        forged = events.JobExited("victim-1", claimed, 0, now_iso(), run_id=run_id, exit_code=0, result="s3://b/x")
        route(agent_event(forged))
    # and the job's own instance answers the status command that the claim sent: its job still runs
    running = results.StatusResult(
        "victim-1", run_id, instance_id, "efs", "run", 0, "running", 4242, True, None, "", "", "", None, {}
    ).to_line()
    asked = _answer_status(instance_id, running)
    assert len(asked) == 1 and not _answer_status(other, running)
    for event in asked:
        route(event)

    # Then the job still runs: no exit code, no result
    job = plane.job("victim-1")
    assert (job.status, job.exit_code, job.result) == (Status.RUNNING, None, None)

    # And its real exit, confirmed by SSM, ends it
    finish_exit(events.JobExited("victim-1", instance_id, 0, now_iso(), exit_code=3, result="s3://b/r"))
    assert (plane.job("victim-1").status, plane.job("victim-1").exit_code) == (Status.FAILED, 3)
    assert plane.job("other-2").status == Status.RUNNING


def test_a_real_exit_ends_the_job_once_through_ssms_result(plane: ControlPlane) -> None:
    # Given a running job whose agent reports its exit on the bus
    instance_id = plane.start_job("real-1")
    exited = events.JobExited("real-1", instance_id, 0, now_iso(), exit_code=0, result="s3://b/real-1")
    [(_, claimed)] = route(agent_event(exited))

    # Then that alone ends nothing: it asked the instance through SSM
    assert claimed["action"] == "exit-claimed"
    assert plane.job("real-1").status == Status.RUNNING

    # When the instance's answer comes, its status-change event delivered twice
    [(command_id, ended)] = end_status_command(dataclasses.replace(exited, run_id=plane.job("real-1").run_id))
    assert command_id == claimed["command_id"]
    [(_, first)] = route(ended)
    ended_at = plane.job("real-1").updated_at
    [(_, second)] = route(ended)

    # Then the job ended exactly once, from SSM's result
    assert first["action"] == "completed"
    assert second["reason"] == "job ended already"
    job = plane.job("real-1")
    assert (job.status, job.exit_code, job.result, job.updated_at) == (Status.COMPLETED, 0, "s3://b/real-1", ended_at)


def test_a_lost_exit_confirmation_is_asked_again_by_the_scheduler(plane: ControlPlane) -> None:
    # Given a job whose exit was claimed and answered, but SSM's status-change event was lost
    instance_id = plane.start_job("quiet-1")
    exited = events.JobExited("quiet-1", instance_id, 0, now_iso(), exit_code=0, result="s3://b/quiet-1")
    assert answer_exit(exited)
    assert plane.job("quiet-1").status == Status.RUNNING

    # When the scheduler's tick finds the job due
    boto3.resource("dynamodb").Table("spotcr-jobs").update_item(
        Key={"job_id": "quiet-1"},
        UpdateExpression="SET next_checkpoint_at = :past",
        ExpressionAttributeValues={":past": 1},
    )
    tick = invoke_function("scheduler", load_event("scheduled-event"))

    # Then it asks the instance again, and that answer ends the job
    assert tick["exits_asked"] == ["quiet-1"]
    [(_, again)] = end_status_command(dataclasses.replace(exited, run_id=plane.job("quiet-1").run_id))
    route(again)
    job = plane.job("quiet-1")
    assert (job.status, job.exit_code, job.result) == (Status.COMPLETED, 0, "s3://b/quiet-1")
