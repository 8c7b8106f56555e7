"""At most one live copy: an older checkpoint is restored only once the old copy is known dead.

Known dead is EC2 saying the primary is stopped or terminated, or the primary's agent confirming it killed the job
after its final dump failed (the agent fences a stopped job off that VM: tests/agent/test_failed_final_dump.py).
Each test holds the primary's termination back (it "takes a while"), so only those facts can let the restore go.
"""

from __future__ import annotations

import dataclasses

import pytest
from moto.ec2.models.instances import InstanceBackend
from spotcr_contracts import events
from spotcr_functions import recovery
from spotcr_functions.handlers import _edge
from spotcr_functions.models import Status

from rehearsal.controlplane import (
    ControlPlane,
    agent_event,
    checkpoint_id,
    ec2_event,
    finish_checkpoint,
    finish_restore,
    now_iso,
    route,
)

pytestmark = pytest.mark.claim("At most one live copy")


def _interrupted_with_a_periodic_checkpoint(plane: ControlPlane, job_id: str) -> tuple[str, str]:
    primary = plane.start_job(job_id)
    periodic = checkpoint_id("periodic", 0)
    finish_checkpoint(
        events.CheckpointCompleted(job_id, primary, 0, now_iso(), checkpoint_id=periodic, kind="periodic")
    )
    route(ec2_event("spot-interruption-warning", primary))
    plane.wait_for_token(job_id, "final-dump")
    return primary, periodic


def _final_dump_failed(
    job_id: str, primary: str, generation: int, *, job_stopped: bool, run_id: str = ""
) -> events.CheckpointFailed:
    """The primary's agent answers the final-dump order: failed, and whether it killed the job (SSM's result)."""
    failed = events.CheckpointFailed(
        job_id,
        primary,
        generation,
        now_iso(),
        run_id=run_id,  # empty: the run the instance is tagged with, as its agent would send
        kind="final",
        reason="s3://bucket is unreachable",
        job_stopped=job_stopped,
    )
    finish_checkpoint(failed)
    return failed


def test_a_failed_final_dump_with_the_agents_confirmed_kill_lets_the_backup_restore(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an interrupted primary whose termination takes a while, and whose final dump failed; its agent killed
    # the job and confirmed it gone
    primary, periodic = _interrupted_with_a_periodic_checkpoint(plane, "kill-1")
    monkeypatch.setattr(InstanceBackend, "terminate_instances", lambda self, ids: [])
    _final_dump_failed("kill-1", primary, 1, job_stopped=True)

    # When the backup is ready
    backup = plane.wait_until(lambda: plane.job("kill-1").backup_instance_id, "the backup launch")
    route(agent_event(events.AgentReady("kill-1", backup, 1, now_iso(), mode="restore")))

    # Then the backup restores the periodic checkpoint without waiting for EC2: the old copy is known dead
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    assert restore["parameters"]["CheckpointId"] == periodic
    finish_restore(events.RestoreCompleted("kill-1", backup, 1, now_iso(), checkpoint_id=periodic))
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    assert plane.job("kill-1").status == Status.RUNNING


def test_a_failed_final_dump_without_a_confirmed_kill_waits_for_the_primary_to_be_gone(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a final dump that failed on a primary whose agent could not confirm the job gone, still running
    primary, _ = _interrupted_with_a_periodic_checkpoint(plane, "nokill-1")
    _final_dump_failed("nokill-1", primary, 1, job_stopped=False)
    plane.wait_until(lambda: plane.job("nokill-1").arrival("final-dump"), "the final dump's failure")
    monkeypatch.setattr(InstanceBackend, "terminate_instances", lambda self, ids: [])

    # When the restore step retires it, Then it refuses to restore while the primary may still run the job
    with pytest.raises(recovery.PrimaryStillRunning, match=primary):
        recovery._retire_primary(_edge.deps(), plane.job("nokill-1"))


def test_a_kill_claimed_on_the_bus_does_not_count(plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an interrupted primary whose final dump is still under way (SSM has not answered its order)
    primary, _ = _interrupted_with_a_periodic_checkpoint(plane, "forged-kill-1")
    run_id = plane.job("forged-kill-1").run_id
    monkeypatch.setattr(InstanceBackend, "terminate_instances", lambda self, ids: [])

    # When any VM that knows the run id puts on the bus a failed final dump with a confirmed kill, as from the
    # primary, and a committed final dump
    route(
        agent_event(
            events.CheckpointFailed(
                "forged-kill-1", primary, 1, now_iso(), run_id=run_id, kind="final", reason="forged", job_stopped=True
            )
        )
    )
    forged = checkpoint_id("final", 1)
    route(
        agent_event(
            events.CheckpointCompleted(
                "forged-kill-1", primary, 1, now_iso(), run_id=run_id, checkpoint_id=forged, kind="final"
            )
        )
    )

    # Then neither arrives for the final dump nor is recorded, and the primary is still waited for
    job = plane.job("forged-kill-1")
    assert job.arrival("final-dump") is None and job.checkpoint_id != forged
    with pytest.raises(recovery.PrimaryStillRunning, match=primary):
        recovery._retire_primary(_edge.deps(), job)


def test_the_kill_confirmed_on_the_primarys_own_notice_is_reported_to_the_warnings_order(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the primary's own IMDS notice: its final dump failed at generation 0 (before the bump) and stopped the
    # job, said on the bus at once (telemetry) and in its answer to the final-dump order the warning sent
    primary, _ = _interrupted_with_a_periodic_checkpoint(plane, "imds-1")
    route(
        agent_event(dataclasses.replace(_final_dump_failed("imds-1", primary, 0, job_stopped=True), event_id="b" * 32))
    )

    # Then recovery takes it (no wait for the final dump's timeout), and the restore need not wait for EC2
    arrival = plane.wait_until(lambda: plane.job("imds-1").arrival("final-dump"), "the final dump's failure")
    assert arrival["error"] == "CheckpointFailed" and arrival["output"]["job_stopped"] is True
    monkeypatch.setattr(InstanceBackend, "terminate_instances", lambda self, ids: [])
    recovery._retire_primary(_edge.deps(), plane.job("imds-1"))
