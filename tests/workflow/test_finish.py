"""A finished job ends tidy: the backup spotcr launched goes once its result is stored; the user's VM never."""

from __future__ import annotations

import pytest
from spotcr_contracts import events
from spotcr_functions import cloud
from spotcr_functions.models import Status

from rehearsal.controlplane import ControlPlane, answer_exit, ec2_event, finish_exit, now_iso, route
from tests.workflow.support import commit, recover

RESULT = "s3://spotcr-checkpoints/jobs/{job}/result/manifest.json"


def _state(plane: ControlPlane, instance_id: str) -> str:
    [reservation] = plane.ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    return str(reservation["Instances"][0]["State"]["Name"])


def _on_backup(plane: ControlPlane, job_id: str) -> tuple[str, str]:
    primary = plane.start_job(job_id)
    periodic = commit(plane, job_id, primary, 0, "periodic")
    route(ec2_event("spot-interruption-warning", primary))
    return primary, recover(plane, job_id, periodic, final_from=primary)


@pytest.mark.parametrize(("exit_code", "status"), [(0, Status.COMPLETED), (4, Status.FAILED)])
def test_the_backup_is_terminated_once_the_result_is_stored(
    plane: ControlPlane, exit_code: int, status: Status
) -> None:
    # Given a job that moved to a backup spotcr launched
    _, backup = _on_backup(plane, "tidy-1")

    # When it ends there and the agent reports its stored result
    exited = events.JobExited("tidy-1", backup, 1, now_iso(), exit_code=exit_code, result=RESULT.format(job="tidy-1"))
    [(_, outcome)] = finish_exit(exited)

    # Then the job records where its result is, and the backup is terminated
    job = plane.job("tidy-1")
    assert (job.status, job.result) == (status, RESULT.format(job="tidy-1"))
    assert outcome["vm"] == f"terminated {backup}"
    assert _state(plane, backup) in ("shutting-down", "terminated")


def test_the_users_own_instance_is_never_terminated(plane: ControlPlane) -> None:
    # Given a job that ends on the instance the user launched, its result stored
    instance_id = plane.start_job("own-1")
    exited = events.JobExited("own-1", instance_id, 0, now_iso(), exit_code=0, result=RESULT.format(job="own-1"))

    # When its exit is confirmed through SSM, and the status-change event delivered twice (as EventBridge may)
    [ended] = answer_exit(exited)
    route(ended)
    [(_, outcome)] = route(ended)

    # Then the job is COMPLETED and the user's instance keeps running
    assert plane.job("own-1").status == Status.COMPLETED
    assert outcome["vm"] == f"kept {instance_id}: not launched by spotcr"
    assert _state(plane, instance_id) == "running"


def test_a_result_that_was_not_stored_keeps_the_backup_and_says_so(plane: ControlPlane) -> None:
    # Given a job on a backup whose agent could not store the result
    _, backup = _on_backup(plane, "kept-1")
    exited = events.JobExited("kept-1", backup, 1, now_iso(), exit_code=0, result_error="StoreUnavailable: denied")

    # When the exit arrives
    [(_, outcome)] = finish_exit(exited)

    # Then the job ends, its reason says the result is not stored and why, and the backup keeps the work dir
    job = plane.job("kept-1")
    assert job.status == Status.COMPLETED
    assert job.result is None
    assert "result not stored (StoreUnavailable: denied)" in str(job.reason)
    assert outcome["vm"] == f"kept {backup}: result not stored"
    assert _state(plane, backup) == "running"


def test_an_exit_without_the_declared_result_fails_the_job_naming_the_files(plane: ControlPlane) -> None:
    # Given a job on a backup that exited with 0 but without the files it declared (spotcr:result)
    _, backup = _on_backup(plane, "lacks-1")
    missing = "the job ended without its declared result (spotcr:result): missing model.bin, log.txt"
    exited = events.JobExited(
        "lacks-1", backup, 1, now_iso(), exit_code=0, result_error=missing, result_missing="model.bin,log.txt"
    )

    # When the exit arrives
    [(_, outcome)] = finish_exit(exited)

    # Then the job is FAILED, not COMPLETED, its reason names the missing files, and the backup keeps the work dir
    job = plane.job("lacks-1")
    assert job.status == Status.FAILED
    assert job.result is None
    assert "without its declared result: missing model.bin, log.txt" in str(job.reason)
    assert outcome["vm"] == f"kept {backup}: result not stored"


def test_a_redelivered_exit_terminates_a_backup_the_first_delivery_left(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a job on a backup whose first exit delivery recorded the end but died before terminating
    _, backup = _on_backup(plane, "again-2")
    exited = events.JobExited("again-2", backup, 1, now_iso(), exit_code=0, result=RESULT.format(job="again-2"))

    def crash(self: object, instance_id: str) -> None:
        raise RuntimeError("the function timed out")

    [ended] = answer_exit(exited)
    with monkeypatch.context() as patch:
        patch.setattr(cloud.Cloud, "terminate_instance", crash)
        with pytest.raises(RuntimeError):
            route(ended)
    assert plane.job("again-2").status == Status.COMPLETED
    assert _state(plane, backup) == "running"

    # When EventBridge delivers SSM's status-change event for the exit again
    [(_, outcome)] = route(ended)

    # Then that copy terminates the backup
    assert outcome["vm"] == f"terminated {backup}"
    assert _state(plane, backup) in ("shutting-down", "terminated")
