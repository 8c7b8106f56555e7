"""Attempt-scoped rendezvous: an answer to one restore attempt never resumes another."""

from __future__ import annotations

import dataclasses

import pytest
from spotcr_contracts import events
from spotcr_functions.models import Status

from rehearsal.controlplane import (
    ControlPlane,
    agent_event,
    checkpoint_id,
    ec2_event,
    end_restore_command,
    end_status_command,
    finish_checkpoint,
    finish_restore,
    now_iso,
    route,
)

pytestmark = pytest.mark.claim("Attempts and order")


def _commit(plane: ControlPlane, job_id: str, instance_id: str, at_ms: int) -> str:
    checkpoint = checkpoint_id("periodic", 0, at_ms)
    finish_checkpoint(events.CheckpointCompleted(job_id, instance_id, 0, now_iso(), checkpoint_id=checkpoint))
    return checkpoint


def test_a_duplicated_restore_failed_never_completes_the_next_attempts_token(plane: ControlPlane) -> None:
    # Given a recovery whose first restore attempt (the newest checkpoint) failed on the backup
    primary = plane.start_job("twice-1")
    older = _commit(plane, "twice-1", primary, 1_795_000_000_000)
    newest = _commit(plane, "twice-1", primary, 1_795_000_060_000)
    route(ec2_event("state-change-terminated", primary))
    backup = plane.wait_until(lambda: plane.job("twice-1").backup_instance_id, "the backup launch")
    route(agent_event(events.AgentReady("twice-1", backup, 1, now_iso(), mode="restore")))
    plane.wait_until(lambda: plane.sent_commands("restore"), "the first restore")
    failed = events.RestoreFailed(
        "twice-1", backup, 1, now_iso(), checkpoint_id=newest, reason="corrupt", attempt="newest"
    )
    _, first_ended = end_restore_command(failed)
    route(first_ended)
    plane.wait_until(lambda: plane.job("twice-1").token("restore-previous"), "the second attempt's token")
    assert [c["parameters"]["Attempt"] for c in plane.sent_commands("restore")] == ["newest", "previous"]

    # When the first attempt's failure is reported again while the second attempt waits: SSM's status-change event
    # for the first command delivered twice, and the agent's own event sent again (a new event, not a copy)
    route(first_ended)
    route(agent_event(dataclasses.replace(failed, event_id="a" * 32, reason="corrupt (answered twice)")))

    # Then it is not the second attempt's answer: nothing arrived for it, and its own answer ends the recovery
    assert plane.job("twice-1").arrival("restore-previous") is None
    finish_restore(events.RestoreCompleted("twice-1", backup, 1, now_iso(), checkpoint_id=older, attempt="previous"))
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    assert plane.job("twice-1").status == Status.RUNNING


def test_an_agent_event_resent_with_its_event_id_is_handled_once(plane: ControlPlane) -> None:
    # Given a job whose agent reported its exit, and whose PutEvents answer was lost, so it sent the event again
    instance_id = plane.start_job("resent-1")
    exited = events.JobExited("resent-1", instance_id, 0, now_iso(), exit_code=0, result="s3://b/r", event_id="e" * 32)
    [(_, first)] = route(agent_event(exited))
    assert first["action"] == "exit-claimed"

    # When the copy arrives
    [(_, second)] = route(agent_event(exited))

    # Then it is the same event: handled once (one status command asked), its answer is the first one's
    assert second == first
    [(command_id, ended)] = end_status_command(dataclasses.replace(exited, run_id=plane.job("resent-1").run_id))
    assert command_id == first["command_id"]
    route(ended)
    assert plane.job("resent-1").status == Status.COMPLETED
