"""A job whose VM never starts it (user data failed before the agent ran) does not stay PENDING and billing forever."""

from __future__ import annotations

import json
import time

import boto3
import pytest
from spotcr_contracts import events
from spotcr_contracts import tags as tag_names
from spotcr_functions import jobs
from spotcr_functions.config import ENV
from spotcr_functions.handlers import _edge
from spotcr_functions.models import Status

from rehearsal.controlplane import (
    EVENTS,
    REGION,
    ControlPlane,
    agent_event,
    ec2_event,
    invoke_function,
    now_iso,
    route,
)

SCHEDULED = json.loads((EVENTS / "scheduled-event.json").read_text())


def _register(plane: ControlPlane, job_id: str, *, from_template: bool = False) -> str:
    job_tags = [{"Key": tag_names.JOB, "Value": job_id}, {"Key": tag_names.COMMAND, "Value": "/opt/job/run"}]
    # As `spotcr submit` launches: from the stack's launch template, which EC2 tags aws:ec2launchtemplate:id; or the
    # user's own instance, started some other way and tagged
    launch = {"LaunchTemplate": {"LaunchTemplateId": plane.launch_template_id}} if from_template else {}
    launched = plane.ec2.run_instances(
        **launch,
        ImageId=plane.image_id,
        InstanceType="m5.large",
        MinCount=1,
        MaxCount=1,
        SubnetId=plane.subnets[f"{REGION}a"],
        TagSpecifications=[{"ResourceType": "instance", "Tags": job_tags}],
    )
    instance_id = str(launched["Instances"][0]["InstanceId"])
    route(ec2_event("state-change-running", instance_id))
    return instance_id


def _pass_deadline(job_id: str) -> None:
    """The clock passes the job's deadline to start (the table's copy of it, as the scheduler reads it)."""
    boto3.resource("dynamodb").Table("spotcr-jobs").update_item(
        Key={"job_id": job_id},
        UpdateExpression="SET next_checkpoint_at = :past",
        ExpressionAttributeValues={":past": 1},
    )


def _state(plane: ControlPlane, instance_id: str) -> str:
    reservations = plane.ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    return str(reservations[0]["Instances"][0]["State"]["Name"])


def test_registration_sets_a_deadline_to_start_of_pending_timeout_minutes(plane: ControlPlane) -> None:
    before = int(time.time())
    _register(plane, "boot-1")
    job = plane.job("boot-1")
    assert job.status == Status.PENDING
    assert job.next_checkpoint_at is not None and before + 20 * 60 <= job.next_checkpoint_at <= time.time() + 20 * 60


def test_a_users_own_instance_that_never_starts_its_job_fails_and_is_marked_not_terminated(
    plane: ControlPlane,
) -> None:
    # Given a job registered on the user's own tagged instance, whose agent never starts it
    instance_id = _register(plane, "boot-2")
    # When its deadline to start passes and the scheduler runs
    result = invoke_function("scheduler", SCHEDULED)
    assert result["timed_out"] == []
    _pass_deadline("boot-2")
    result = invoke_function("scheduler", SCHEDULED)
    # Then the job is FAILED with a reason naming the timeout and where to look
    assert result["timed_out"] == ["boot-2"]
    job = plane.job("boot-2")
    assert job.status == Status.FAILED and job.next_checkpoint_at is None
    assert "did not start within 20 minutes" in str(job.reason) and "pending_timeout_minutes" in str(job.reason)
    assert "console output" in str(job.reason) and "/var/log/cloud-init-output.log" in str(job.reason)
    # And the instance says why, but is the user's to terminate
    assert plane.instance_tags(instance_id)[tag_names.ERROR] == job.reason
    assert _state(plane, instance_id) == "running"
    # And the failure is notified once, however often the scheduler runs
    assert invoke_function("scheduler", SCHEDULED)["timed_out"] == []
    [message] = plane.notifications()
    assert message == job.reason


def test_an_instance_spotcr_launched_that_never_starts_its_job_is_terminated(plane: ControlPlane) -> None:
    instance_id = _register(plane, "boot-3", from_template=True)
    _pass_deadline("boot-3")
    assert invoke_function("scheduler", SCHEDULED)["timed_out"] == ["boot-3"]
    assert plane.job("boot-3").status == Status.FAILED
    assert tag_names.ERROR in plane.instance_tags(instance_id)
    assert _state(plane, instance_id) in ("shutting-down", "terminated")


def test_a_job_that_started_after_the_scheduler_read_it_is_left_running(plane: ControlPlane) -> None:
    # Given the scheduler read the job PENDING past its deadline
    instance_id = _register(plane, "boot-4", from_template=True)
    _pass_deadline("boot-4")
    seen = plane.job("boot-4")
    # When the job starts before the scheduler ends it
    route(agent_event(events.JobStarted("boot-4", instance_id, 0, now_iso(), pid=7)))
    # Then the conditional end fails: nothing is failed, marked or terminated
    assert jobs.time_out_pending(_edge.deps(), seen) is False
    assert plane.job("boot-4").status == Status.RUNNING
    assert tag_names.ERROR not in plane.instance_tags(instance_id)
    assert _state(plane, instance_id) == "running"
    assert plane.notifications() == []


def test_a_pending_timeout_of_zero_never_times_a_job_out(plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV["pending_timeout_minutes"], "0")
    _register(plane, "boot-5")
    assert plane.job("boot-5").next_checkpoint_at is None
    assert invoke_function("scheduler", SCHEDULED)["timed_out"] == []
    assert plane.job("boot-5").status == Status.PENDING
