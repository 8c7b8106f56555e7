"""One identity per run: the control plane's half (the agent's half is tests/agent/test_run_identity.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from spotcr_contracts import events
from spotcr_contracts import tags as tag_names
from spotcr_functions.models import Status

from rehearsal.controlplane import (
    ControlPlane,
    agent_event,
    checkpoint_id,
    ec2_event,
    finish_checkpoint,
    finish_exit,
    finish_restore,
    now_iso,
    route,
)

pytestmark = [pytest.mark.claim("Only spotcr's own word moves a job"), pytest.mark.claim("One identity per run")]


def test_a_second_instance_with_a_running_jobs_name_never_gets_the_run_and_moves_nothing(plane: ControlPlane) -> None:
    # Given a job running on its registered instance, which carries the run the control plane minted
    first = plane.start_job("twin-1")
    run_id = plane.job("twin-1").run_id
    assert re.fullmatch(tag_names.RUN_ID_PATTERN, run_id)
    assert plane.instance_tags(first)[tag_names.RUN] == run_id

    # When a second instance is launched with the same job name, and its agent says it waits for its run
    second = plane.launch_job_instance({tag_names.JOB: "twin-1", tag_names.COMMAND: "/opt/job/run"})
    route(ec2_event("state-change-running", second))
    route(agent_event(events.AgentReady("twin-1", second, 0, now_iso(), mode="run")))

    # Then it is refused with a clear reason and never tagged with a run: its agent never starts the job
    refused = plane.instance_tags(second)
    assert f"already runs on {first}" in refused[tag_names.ERROR]
    assert tag_names.RUN not in refused

    # And whatever it (or anything) puts on the bus without the job's run never moves the job: not its dump,
    # not a dump claiming another run, not its exit
    for run in ("", "r-" + "f" * 16):
        dump = checkpoint_id("final", 0)
        route(
            agent_event(
                events.CheckpointCompleted("twin-1", second, 0, now_iso(), run_id=run, checkpoint_id=dump, kind="final")
            )
        )
        finish_exit(events.JobExited("twin-1", second, 0, now_iso(), run_id=run, exit_code=0))
    record = plane.job("twin-1")
    assert (record.status, record.instance_id, record.checkpoint_id, record.run_id) == (
        Status.RUNNING,
        first,
        None,
        run_id,
    )


def test_a_name_reused_after_completed_is_a_new_run_that_never_sees_the_old_ones(plane: ControlPlane) -> None:
    # Given a run that committed a checkpoint and completed
    old_instance = plane.start_job("again-1")
    old_run = plane.job("again-1").run_id
    old_checkpoint = checkpoint_id("periodic", 0)
    finish_checkpoint(events.CheckpointCompleted("again-1", old_instance, 0, now_iso(), checkpoint_id=old_checkpoint))
    assert plane.job("again-1").checkpoint_id == old_checkpoint
    finish_exit(events.JobExited("again-1", old_instance, 0, now_iso(), exit_code=0, result="s3://b/r"))
    assert plane.job("again-1").status == Status.COMPLETED

    # When the name is submitted again
    new_instance = plane.start_job("again-1")

    # Then it is a new run: a new id on its instance, no checkpoint of the old run in its record
    record = plane.job("again-1")
    assert record.run_id != old_run and record.checkpoint_id is None and record.status == Status.RUNNING
    assert plane.instance_tags(new_instance)[tag_names.RUN] == record.run_id

    # And a late dump of the old run (its VM still up, answering an order of the old run) is not recorded as the
    # new run's checkpoint
    late = checkpoint_id("periodic", 0)
    answered = dict(
        finish_checkpoint(
            events.CheckpointCompleted("again-1", old_instance, 0, now_iso(), run_id=old_run, checkpoint_id=late)
        )
    )
    assert answered["command-result"]["reason"] == "no dump of this run reported"
    assert plane.job("again-1").checkpoint_id is None

    # And interrupted before its first checkpoint, every order it gets names the new run: the final dump, the
    # backup's tags, and the restore (of "the newest", which the backup looks up in the new run's store only)
    route(ec2_event("spot-interruption-warning", new_instance))
    [dump] = plane.sent_commands("final-dump")
    assert dump["parameters"]["RunId"] == record.run_id
    finish_checkpoint(
        events.CheckpointFailed("again-1", new_instance, 1, now_iso(), kind="final", reason="the store is down")
    )
    backup = plane.wait_until(lambda: plane.job("again-1").backup_instance_id, "the backup launch")
    assert plane.instance_tags(backup)[tag_names.RUN] == record.run_id
    route(agent_event(events.AgentReady("again-1", backup, 1, now_iso(), mode="restore")))
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    assert restore["parameters"]["RunId"] == record.run_id
    assert restore["parameters"]["CheckpointId"] == ""
    finish_restore(events.RestoreCompleted("again-1", backup, 1, now_iso(), checkpoint_id=""))
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"


def _without_run(event: events.AgentEvent) -> dict[str, Any]:
    """The event as anything on the bus may put it: for the job's instance, but carrying no run id."""
    entry = agent_event(event)
    entry["detail"]["run_id"] = ""
    return entry


def test_a_bootstrap_failure_without_the_jobs_run_fails_nothing(plane: ControlPlane) -> None:
    # Given a job registered on its instance, which has not started it yet
    instance_id = plane.launch_job_instance({tag_names.JOB: "forged-1", tag_names.COMMAND: "/opt/job/run"})
    route(ec2_event("state-change-running", instance_id))
    assert plane.job("forged-1").status == Status.PENDING
    # When a BootstrapFailed naming that instance but no run (anything on the bus can put one) arrives
    failed = events.BootstrapFailed("forged-1", instance_id, 0, now_iso(), step="storage", reason="forged")
    route(_without_run(failed))
    # Then the job is as it was: only its own run's failure ends it
    assert plane.job("forged-1").status == Status.PENDING
    route(agent_event(failed))
    assert plane.job("forged-1").status == Status.FAILED


def test_an_agent_ready_without_the_jobs_run_moves_no_recovery(plane: ControlPlane) -> None:
    # Given a job recovering onto its backup, which has not said it is ready
    instance_id = plane.start_job("forged-2")
    route(ec2_event("spot-interruption-warning", instance_id))
    finish_checkpoint(events.CheckpointFailed("forged-2", instance_id, 1, now_iso(), kind="final", reason="down"))
    backup = plane.wait_until(lambda: plane.job("forged-2").backup_instance_id, "the backup launch")
    # When an AgentReady in restore mode names the backup but carries no run
    route(_without_run(events.AgentReady("forged-2", backup, 1, now_iso(), mode="restore")))
    # Then the recovery did not take it for the backup's: nothing arrived for its wait, no restore was ordered
    assert plane.job("forged-2").arrival("backup-ready") is None
    assert plane.sent_commands("restore") == []
    # And the backup's own AgentReady (with the run it was launched with) moves it on to the end
    route(agent_event(events.AgentReady("forged-2", backup, 1, now_iso(), mode="restore")))
    plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    finish_restore(events.RestoreCompleted("forged-2", backup, 1, now_iso(), checkpoint_id=""))
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"


def test_an_instance_a_user_tags_restore_is_no_backup_and_is_told_so(plane: ControlPlane) -> None:
    # Given a job running, and its backup-looking twin: a user's instance tagged spotcr:mode=restore with its name
    # and even its run (any user may read the tag and write it)
    first = plane.start_job("restore-1")
    record = plane.job("restore-1")
    forged = plane.launch_job_instance(
        {
            tag_names.JOB: "restore-1",
            tag_names.COMMAND: "/opt/job/run",
            tag_names.MODE: "restore",
            tag_names.GENERATION: "0",
            tag_names.RUN: record.run_id,
        }
    )
    # When it runs
    [(_, result)] = route(ec2_event("state-change-running", forged))
    # Then it gets spotcr:error naming why (its agent would wait for a restore forever), and the job is unmoved
    reason = plane.instance_tags(forged)[tag_names.ERROR]
    assert result == {"registered": False, "error": reason}
    assert f"{forged} is no backup of job restore-1" in reason
    assert (plane.job("restore-1").status, plane.job("restore-1").instance_id) == (Status.RUNNING, first)


def test_spotcr_mode_added_to_a_job_instance_is_checked_on_the_tag_change(plane: ControlPlane) -> None:
    # Given an instance running with a job tag, that a user then tags spotcr:mode=restore
    instance_id = plane.launch_job_instance(
        {tag_names.JOB: "restore-2", tag_names.COMMAND: "/opt/job/run", tag_names.MODE: "restore"}
    )
    changed = ec2_event("tag-change", instance_id)
    changed["detail"]["changed-tag-keys"] = [tag_names.MODE]
    changed["detail"]["tags"] = plane.instance_tags(instance_id)
    # When the tag change arrives
    route(changed)
    # Then the instance is refused with a reason, as no job's backup
    assert "is no backup of job restore-2" in plane.instance_tags(instance_id)[tag_names.ERROR]


def test_the_backup_the_recovery_launched_is_confirmed_as_one(plane: ControlPlane) -> None:
    # Given a job recovering onto a backup spotcr launched
    instance_id = plane.start_job("restore-3")
    route(ec2_event("spot-interruption-warning", instance_id))
    finish_checkpoint(events.CheckpointFailed("restore-3", instance_id, 1, now_iso(), kind="final", reason="down"))
    backup = plane.wait_until(lambda: plane.job("restore-3").backup_instance_id, "the backup launch")
    # When its "running" state change arrives
    [(_, result)] = route(ec2_event("state-change-running", backup))
    # Then it is the job's backup: no error, nothing registered
    assert result == {"registered": False, "reason": "backup launched by spotcr"}
    assert tag_names.ERROR not in plane.instance_tags(backup)
