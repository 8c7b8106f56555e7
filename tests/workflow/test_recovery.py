"""The recovery workflow end to end: real ASL on moto's Step Functions engine, real handlers in-process."""

from __future__ import annotations

from spotcr_contracts import events
from spotcr_contracts import tags as tag_names
from spotcr_functions.models import Status

from tests.workflow.harness import ControlPlane, agent_event, checkpoint_id, ec2_event, now_iso, route


def _commit(
    plane: ControlPlane, job_id: str, instance_id: str, generation: int, kind: str, at_ms: int | None = None
) -> str:
    checkpoint = checkpoint_id(kind, generation, at_ms)
    route(
        agent_event(
            events.CheckpointCompleted(
                job_id,
                instance_id,
                generation,
                now_iso(),
                checkpoint_id=checkpoint,
                kind=kind,
                seconds=1.5,
                bytes_total=10,
                bytes_uploaded=5,
            )
        )
    )
    return checkpoint


def test_happy_path_final_dump_backup_restore(plane: ControlPlane) -> None:
    # Given a running job with one periodic checkpoint
    primary = plane.start_job("render-1")
    periodic = _commit(plane, "render-1", primary, 0, "periodic")
    assert plane.job("render-1").status == Status.RUNNING

    # When the spot interruption warning arrives
    route(ec2_event("spot-interruption-warning", primary))

    # Then the final dump is ordered at generation 1 and the workflow launches a backup for generation 1
    [dump] = plane.sent_commands("checkpoint")
    assert dump["instances"] == [primary]
    assert dump["parameters"] == {"JobId": "render-1", "Generation": "1", "Kind": "final"}
    record = plane.wait_until(lambda: (r := plane.job("render-1")).backup_instance_id and r, "the backup launch")
    backup = record.backup_instance_id
    assert plane.instance_tags(backup)[tag_names.MODE] == "restore"
    assert plane.instance_tags(backup)[tag_names.GENERATION] == "1"

    # When the old VM commits its final dump and the backup's agent is ready
    plane.wait_for_token("render-1", "final-dump")
    final = _commit(plane, "render-1", primary, 1, "final")
    route(agent_event(events.AgentReady("render-1", backup, 1, now_iso(), mode="restore")))

    # Then the restore of the final dump is ordered on the backup
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    assert restore["instances"] == [backup]
    assert restore["parameters"] == {"JobId": "render-1", "Generation": "1", "CheckpointId": final}
    route(
        agent_event(events.RestoreCompleted("render-1", backup, 1, now_iso(), checkpoint_id=final, seconds=2.0, pid=99))
    )

    # Then the job runs on the backup at generation 1
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    job = plane.job("render-1")
    assert (job.status, job.instance_id, job.generation) == (Status.RUNNING, backup, 1)
    assert (job.checkpoint_id, job.previous_checkpoint_id) == (final, periodic)
    assert len(plane.backups()) == 1
