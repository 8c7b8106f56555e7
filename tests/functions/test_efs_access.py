"""Per-job EFS access points: made with the job's registration, named in its vended session, gone when it ends.

moto stands in for EFS (CreateAccessPoint, DescribeAccessPoints, DeleteAccessPoint and their tags); the job
lifecycle runs through the real handlers on the workflow tests' control plane.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import boto3
import pytest
from spotcr_contracts import events
from spotcr_contracts import tags as tag_names
from spotcr_functions import efs_access, recovery, store_access
from spotcr_functions.config import ENV, Settings
from spotcr_functions.deps import Deps
from spotcr_functions.models import Status

from rehearsal.controlplane import REGION, ControlPlane, agent_event, ec2_event, finish_exit, now_iso, route
from tests.functions.support import BUCKET, answer, instance_session, request


@pytest.fixture
def file_system(plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> str:
    """The stack's EFS, named to the functions as the stack names it (SPOTCR_FILE_SYSTEM_ID)."""
    monkeypatch.setenv(ENV["file_system_id"], plane.file_system_id)
    return plane.file_system_id


def access_points(file_system_id: str) -> list[dict[str, Any]]:
    return list(
        boto3.client("efs", region_name=REGION).describe_access_points(FileSystemId=file_system_id)["AccessPoints"]
    )


def efs_job(plane: ControlPlane, job: str) -> str:
    return plane.start_job(job, **{tag_names.STORAGE: "efs"})


def test_registering_an_efs_job_makes_its_access_point_once(plane: ControlPlane, file_system: str) -> None:
    # Given an efs job registered (state change running), then registered again by its AgentReady
    instance_id = efs_job(plane, "render-42")
    route(agent_event(events.AgentReady("render-42", instance_id, 0, now_iso(), mode="run")))
    # Then it has one access point, rooted at its own directory and tagged with its job and run
    [point] = access_points(file_system)
    record = plane.job("render-42")
    assert record.access_point_arn == point["AccessPointArn"]
    assert point["RootDirectory"] == {
        "Path": "/jobs/render-42",
        "CreationInfo": {"OwnerUid": 0, "OwnerGid": 0, "Permissions": "0700"},
    }
    labels = {tag["Key"]: tag["Value"] for tag in point["Tags"]}
    assert labels == {tag_names.JOB: "render-42", tag_names.RUN: record.run_id}


def test_jobs_on_other_storage_get_no_access_point(plane: ControlPlane, file_system: str) -> None:
    plane.start_job("render-s3")
    assert access_points(file_system) == []
    assert plane.job("render-s3").access_point_arn is None


@pytest.mark.parametrize(("exit_code", "status"), [(0, Status.COMPLETED), (3, Status.FAILED)])
def test_the_access_point_goes_when_the_job_exits(
    plane: ControlPlane, file_system: str, exit_code: int, status: Status
) -> None:
    # Given two efs jobs
    instance_id = efs_job(plane, "render-42")
    efs_job(plane, "render-43")
    other = plane.job("render-43").access_point_arn
    # When one exits (and its exit is delivered twice)
    for _ in range(2):
        finish_exit(events.JobExited("render-42", instance_id, 0, now_iso(), exit_code=exit_code))
    # Then its access point is deleted, the other job's stays
    assert plane.job("render-42").status == status
    assert [point["AccessPointArn"] for point in access_points(file_system)] == [other]


def test_the_access_point_goes_when_the_recovery_fails(plane: ControlPlane, file_system: str) -> None:
    # Given an efs job whose instance was interrupted (the recovery workflow owns it)
    instance_id = efs_job(plane, "render-42")
    route(ec2_event("spot-interruption-warning", instance_id))
    record = plane.job("render-42")
    assert record.status == Status.RECOVERING
    # When the recovery gives up
    result = recovery.fail(Deps.from_settings(Settings.from_env()), "render-42", record.generation, "Boom", "")
    # Then the job is FAILED and nothing of its access point is left
    assert result["marked_failed"]
    assert access_points(file_system) == []


def test_a_failed_bootstrap_deletes_the_access_point(plane: ControlPlane, file_system: str) -> None:
    instance_id = plane.launch_job_instance(
        {tag_names.JOB: "render-42", tag_names.COMMAND: "/opt/job/run", tag_names.STORAGE: "efs"}
    )
    route(ec2_event("state-change-running", instance_id))
    assert len(access_points(file_system)) == 1
    route(agent_event(events.BootstrapFailed("render-42", instance_id, 0, now_iso(), step="storage", reason="x")))
    assert plane.job("render-42").status == Status.FAILED
    assert access_points(file_system) == []


def test_a_lost_race_between_two_registrations_keeps_one_access_point(plane: ControlPlane, file_system: str) -> None:
    # Given a registered efs job whose access point is stored
    efs_job(plane, "render-42")
    record = plane.job("render-42")
    deps = Deps.from_settings(Settings.from_env())
    # When a concurrent registration that read the record before the access point was stored creates its own
    kept = efs_access.open_for(deps, dataclasses.replace(record, access_point_arn=None))
    # Then the stored one is kept and the extra one deleted (moto ignores ClientToken, so it made a second)
    assert kept.access_point_arn == record.access_point_arn
    assert [point["AccessPointArn"] for point in access_points(file_system)] == [record.access_point_arn]


def test_the_vended_session_may_mount_only_through_the_jobs_access_point(
    plane: ControlPlane, file_system: str, vending: list[dict[str, Any]]
) -> None:
    # Given a registered efs job
    instance_id = efs_job(plane, "render-42")
    access_point = plane.job("render-42").access_point_arn
    assert access_point
    # When its instance asks for its store
    status, body = answer(request("render-42", instance_session(instance_id)))
    # Then the answer names its access point, and the session policy allows the EFS client actions only with it
    assert status == 200, body
    assert (body["FileSystemId"], body["AccessPointId"]) == (file_system, access_point.rsplit("/", 1)[-1])
    [call] = vending
    assert call["policy"] == store_access.session_policy(
        "aws",
        BUCKET,
        plane.job("render-42").run_id,
        access_point_arn=access_point,
        file_system_id=file_system,
    )
    [efs_statement] = [s for s in call["policy"]["Statement"] if s["Action"] == "elasticfilesystem:Client*"]
    assert efs_statement == {
        "Effect": "Allow",
        "Action": "elasticfilesystem:Client*",  # ClientMount, ClientWrite, ClientRootAccess: the role grants those
        "Resource": f"{access_point.rsplit(':', 1)[0]}:file-system/{file_system}",
        "Condition": {"StringEquals": {"elasticfilesystem:AccessPointArn": access_point}},
    }
    assert len(json.dumps(call["policy"], separators=(",", ":"))) < 2048  # AssumeRole's session policy limit


def test_an_efs_job_without_its_access_point_yet_is_asked_to_wait(
    plane: ControlPlane, file_system: str, vending: list[dict[str, Any]]
) -> None:
    # Given an efs job registered before its access point was stored (the window inside registration)
    instance_id = efs_job(plane, "render-42")
    boto3.resource("dynamodb", region_name=REGION).Table("spotcr-jobs").update_item(
        Key={"job_id": "render-42"}, UpdateExpression="REMOVE access_point_arn"
    )
    # Then its instance is told to ask again (404), and no session is vended that could reach another path
    status, body = answer(request("render-42", instance_session(instance_id)))
    assert (status, body["error"]) == (
        404,
        "job render-42 has no EFS access point yet (it is made with its registration)",
    )
    assert vending == []


def test_an_access_point_made_after_the_job_ended_is_not_kept(plane: ControlPlane, file_system: str) -> None:
    # Given a registration that read the job before its access point existed, and the job ending meanwhile
    instance_id = efs_job(plane, "render-42")
    record = dataclasses.replace(plane.job("render-42"), access_point_arn=None)
    efs_access.close_for(Deps.from_settings(Settings.from_env()), plane.job("render-42"))
    boto3.resource("dynamodb", region_name=REGION).Table("spotcr-jobs").update_item(
        Key={"job_id": "render-42"}, UpdateExpression="REMOVE access_point_arn"
    )
    finish_exit(events.JobExited("render-42", instance_id, 0, now_iso(), exit_code=0))
    assert plane.job("render-42").status == Status.COMPLETED
    # When the registration goes on and creates the access point only now
    efs_access.open_for(Deps.from_settings(Settings.from_env()), record)
    # Then the ended job is given none, and none is left
    assert plane.job("render-42").access_point_arn is None
    assert access_points(file_system) == []
