"""One identity per run: the control plane's half (the agent's half is tests/agent/test_run_identity.py)."""

from __future__ import annotations

import re

from spotcr_contracts import events
from spotcr_contracts import tags as tag_names
from spotcr_functions.models import Status

from tests.workflow.harness import (
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
    [dump] = plane.sent_commands("checkpoint", kind="final")
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
