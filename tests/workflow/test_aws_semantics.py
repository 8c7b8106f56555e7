"""AWS behaviours moto does not model, checked against AWS's published samples and error codes (tests/events/).

Interruption actions (terminate, stop, hibernate), the capacity-reservation warning, placement in the stack's
subnets, the RunInstances errors that move to the next candidate, execution status changes, and what a recovery
leaves allocated.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from moto.ec2.models.instances import InstanceBackend
from spotcr_contracts import events
from spotcr_contracts import tags as tag_names
from spotcr_functions import recovery
from spotcr_functions.cloud import Cloud, Instance
from spotcr_functions.config import ENV
from spotcr_functions.handlers import _edge
from spotcr_functions.models import InterruptionWarning, RecoveryEnded, Status

from rehearsal.controlplane import (
    EVENTS,
    ControlPlane,
    agent_event,
    checkpoint_id,
    ec2_event,
    finish_checkpoint,
    finish_exit,
    finish_restore,
    load_event,
    now_iso,
    route,
)


def _commit(plane: ControlPlane, job_id: str, instance_id: str, generation: int, kind: str) -> str:
    checkpoint = checkpoint_id(kind, generation)
    completed = events.CheckpointCompleted(
        job_id, instance_id, generation, now_iso(), checkpoint_id=checkpoint, kind=kind
    )
    finish_checkpoint(completed)
    return checkpoint


def _backup(plane: ControlPlane, job_id: str) -> str:
    record = plane.wait_until(lambda: (r := plane.job(job_id)).backup_instance_id and r, "the backup launch")
    return str(record.backup_instance_id)


def _restore_on(plane: ControlPlane, job_id: str, backup: str, generation: int = 1) -> str:
    route(agent_event(events.AgentReady(job_id, backup, generation, now_iso(), mode="restore")))
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    checkpoint = restore["parameters"]["CheckpointId"]
    finish_restore(events.RestoreCompleted(job_id, backup, generation, now_iso(), checkpoint_id=checkpoint))
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    return str(checkpoint)


def _state(plane: ControlPlane, instance_id: str) -> str:
    reservations = plane.ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    return str(reservations[0]["Instances"][0]["State"]["Name"])


@pytest.mark.parametrize("action", ["terminate", "stop", "hibernate"])
def test_instance_action_values_parse_as_aws_defines_them(action: str) -> None:
    event = load_event("spot-interruption-warning")
    event["detail"]["instance-action"] = action
    assert InterruptionWarning.model_validate(event).detail.instance_action == action


def test_an_unknown_instance_action_is_not_an_interruption_warning(plane: ControlPlane) -> None:
    instance_id = plane.start_job("odd-1")
    [(_, result)] = route(ec2_event("spot-interruption-warning", instance_id, **{"instance-action": "reboot"}))
    assert result["action"] == "ignored"
    assert plane.job("odd-1").status == Status.RUNNING


@pytest.mark.parametrize("action", ["stop", "hibernate"])
def test_a_stopped_or_hibernated_primary_is_terminated_and_its_spot_request_cancelled(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    # Given a job on a persistent spot instance (interruption behaviour stop or hibernate) that will stop before
    # its final dump (hibernation may give no notice), launched from the stack's launch template: spotcr may
    # terminate only instances EC2 tagged with that template (RequestSpotInstances takes no template).
    monkeypatch.setenv(ENV["final_dump_wait_s"], "1")
    spot = {"SpotInstanceType": "persistent", "InstanceInterruptionBehavior": action}
    primary = plane.ec2.run_instances(
        LaunchTemplate={"LaunchTemplateId": plane.launch_template_id},
        InstanceMarketOptions={"MarketType": "spot", "SpotOptions": spot},
        SubnetId=plane.subnets["us-east-1a"],
        MinCount=1,
        MaxCount=1,
    )["Instances"][0]["InstanceId"]
    # moto records no spot request for a spot RunInstances, which AWS makes: this one stands in for it.
    request = plane.ec2.request_spot_instances(
        Type="persistent",
        InstanceInterruptionBehavior=action,
        LaunchSpecification={"ImageId": plane.image_id, "InstanceType": "m5.large"},
    )["SpotInstanceRequests"][0]["SpotInstanceRequestId"]
    # moto's DescribeInstances omits SpotInstanceRequestId, which AWS returns for every spot instance.
    original = Cloud.describe_instance

    def describe_instance(self: Cloud, instance_id: str) -> Instance | None:
        found = original(self, instance_id)
        if found is not None and instance_id == primary:
            return Instance(**{**found.__dict__, "spot_request_id": request})
        return found

    monkeypatch.setattr(Cloud, "describe_instance", describe_instance)
    plane.ec2.create_tags(
        Resources=[primary],
        Tags=[{"Key": tag_names.JOB, "Value": "hib-1"}, {"Key": tag_names.COMMAND, "Value": "/opt/job/run"}],
    )
    route(ec2_event("state-change-running", primary))
    route(agent_event(events.JobStarted("hib-1", primary, 0, now_iso(), pid=7)))
    _commit(plane, "hib-1", primary, 0, "periodic")

    # When the warning says stop or hibernate, and the instance stops (hibernation may come with no final dump)
    route(ec2_event("spot-interruption-warning", primary, **{"instance-action": action}))
    plane.ec2.stop_instances(InstanceIds=[primary], Hibernate=action == "hibernate")
    route(ec2_event("state-change-stopping", primary, state="stopped"))
    backup = _backup(plane, "hib-1")
    _restore_on(plane, "hib-1", backup)

    # Then before the restore, the stopped primary was terminated and its request cancelled: EC2 cannot start it
    # again with the job in it while the backup runs the job
    assert _state(plane, primary) == "terminated"
    requests = plane.ec2.describe_spot_instance_requests()["SpotInstanceRequests"]
    assert request not in [r["SpotInstanceRequestId"] for r in requests]  # the backup's own fleet request stays
    job = plane.job("hib-1")
    assert (job.status, job.instance_id, job.generation) == (Status.RUNNING, backup, 1)


@pytest.mark.claim("At most one live copy")
def test_retiring_a_primary_that_still_runs_the_job_waits_for_it_to_be_gone(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a primary that resumed (running) with no final dump, and a termination that takes a while
    primary = plane.start_job("woke-1")
    _commit(plane, "woke-1", primary, 0, "periodic")
    route(ec2_event("spot-interruption-warning", primary, **{"instance-action": "hibernate"}))
    plane.wait_for_token("woke-1", "final-dump")  # the workflow runs (so the harness can stop it cleanly)
    record = plane.job("woke-1")
    monkeypatch.setattr(InstanceBackend, "terminate_instances", lambda self, ids: [])
    # When the restore step retires it, Then it refuses to restore while the primary runs
    with pytest.raises(recovery.PrimaryStillRunning, match=primary):
        recovery._retire_primary(_edge.deps(), record)


@pytest.mark.parametrize(("launched_at", "waits"), [("2999-01-01T00:00:00Z", True), ("2000-01-01T00:00:00Z", False)])
def test_a_primary_started_again_after_its_final_dump_is_still_waited_for(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch, launched_at: str, waits: bool
) -> None:
    # Given a final dump committed at the new generation, and a primary still running whose termination takes a
    # while, started again after the warning (EC2 restarting a stopped spot instance) or not
    primary = plane.start_job("again-2")
    route(ec2_event("spot-interruption-warning", primary, **{"instance-action": "stop"}))
    plane.wait_for_token("again-2", "final-dump")
    _commit(plane, "again-2", primary, 1, "final")
    record = plane.job("again-2")
    monkeypatch.setattr(InstanceBackend, "terminate_instances", lambda self, ids: [])
    original = Cloud.describe_instance

    def describe_instance(self: Cloud, instance_id: str) -> Instance | None:
        found = original(self, instance_id)
        if found is not None and instance_id == primary:
            return Instance(**{**found.__dict__, "launched_at": launched_at})
        return found

    monkeypatch.setattr(Cloud, "describe_instance", describe_instance)
    # When the restore step retires it, Then only a primary started again is waited for: there the final dump no
    # longer proves the job is gone
    if waits:
        with pytest.raises(recovery.PrimaryStillRunning, match=primary):
            recovery._retire_primary(_edge.deps(), record)
    else:
        recovery._retire_primary(_edge.deps(), record)


def test_capacity_reservation_warning_recovers_like_the_spot_warning(plane: ControlPlane) -> None:
    primary = plane.start_job("cr-1")
    _commit(plane, "cr-1", primary, 0, "periodic")
    event = ec2_event("capacity-reservation-interruption-warning", primary)
    [(name, result)] = route(event)
    assert (name, result["action"]) == ("interruption", "recovering")
    [dump] = plane.sent_commands("final-dump")
    assert dump["parameters"] == {
        "JobId": "cr-1",
        "Generation": "1",
        "Kind": "final",
        "RunId": plane.job("cr-1").run_id,
        "Sequence": "1",  # the job's first dump order
    }
    assert plane.executions()[0]["name"].startswith("cr-1-g1-")
    plane.wait_for_token("cr-1", "final-dump")


def test_backups_launch_only_in_the_stacks_subnets(plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a third, private subnet in the VPC that is not one of the stack's subnets
    private = plane.ec2.create_subnet(VpcId=plane.vpc_id, CidrBlock="10.0.9.0/24", AvailabilityZone="us-east-1c")
    private_id = private["Subnet"]["SubnetId"]
    primary = plane.start_job("net-1")
    _commit(plane, "net-1", primary, 0, "periodic")
    launches = plane.refuse_launches(lambda _t, _s, market: "InsufficientInstanceCapacity" * (market == "spot"))

    # When no spot capacity is left anywhere
    route(ec2_event("spot-interruption-warning", primary))
    _backup(plane, "net-1")

    # Then every candidate was in the stack's subnets (the job's own first) and never the private one
    tried = [subnet for _, subnet, _ in launches]
    assert private_id not in tried
    assert set(tried) == set(plane.subnets.values())
    assert tried[0] == plane.subnets["us-east-1a"]


ERRORS = json.loads((EVENTS / "run-instances-errors.json").read_text())


@pytest.mark.parametrize("code", sorted(ERRORS["move_to_next_candidate"]))
def test_each_documented_candidate_error_moves_to_the_next_candidate(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch, code: str
) -> None:
    primary = plane.start_job("cap-1")
    _commit(plane, "cap-1", primary, 0, "periodic")
    zone_a = plane.subnets["us-east-1a"]
    tried = plane.refuse_launches(lambda _t, subnet, market: code if (subnet, market) == (zone_a, "spot") else None)
    route(ec2_event("spot-interruption-warning", primary))
    backup = _backup(plane, "cap-1")
    assert [(subnet, market) for _, subnet, market in tried] == [
        (zone_a, "spot"),
        (plane.subnets["us-east-1b"], "spot"),
    ]
    [instance] = plane.backups()
    assert (instance["InstanceId"], instance["Placement"]["AvailabilityZone"]) == (backup, "us-east-1b")


@pytest.mark.parametrize("code", sorted(ERRORS["fail_the_recovery"]))
def test_an_error_no_candidate_can_avoid_fails_the_recovery_at_once(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch, code: str
) -> None:
    primary = plane.start_job("bad-1")
    _commit(plane, "bad-1", primary, 0, "periodic")
    tried = plane.refuse_launches(lambda _t, _s, _m: code)
    route(ec2_event("spot-interruption-warning", primary))
    plane.wait_for_token("bad-1", "final-dump")
    _commit(plane, "bad-1", primary, 1, "final")
    assert plane.wait_for_execution()["status"] == "FAILED"
    assert {market for _, _, market in tried} == {"spot"}  # the spot fleet's error: no on-demand launch followed
    job = plane.job("bad-1")
    assert job.status == Status.FAILED and code in str(job.reason)


def _status_change(plane: ControlPlane, status: str, machine: str | None = None) -> dict[str, Any]:
    [execution] = plane.executions()
    event = load_event("execution-status-failed")
    described = plane.sfn.describe_execution(executionArn=execution["executionArn"])
    event["detail"].update(
        executionArn=execution["executionArn"],
        stateMachineArn=machine or plane.state_machine_arn,
        name=execution["name"],
        status=status,
        input=described["input"],
    )
    event["resources"] = [execution["executionArn"]]
    return event


def test_the_status_change_sample_parses() -> None:
    ended = RecoveryEnded.model_validate(load_event("execution-status-failed"))
    assert (ended.detail.status, ended.detail.error) == ("FAILED", "States.Runtime")


@pytest.mark.parametrize("status", ["FAILED", "TIMED_OUT", "ABORTED"])
def test_a_recovery_that_ended_past_its_catch_fails_the_job_terminates_its_backup_and_notifies(
    plane: ControlPlane, status: str
) -> None:
    # Given a job whose recovery launched a backup, then ended without its Catch (e.g. States.Runtime)
    primary = plane.start_job("end-1")
    _commit(plane, "end-1", primary, 0, "periodic")
    route(ec2_event("spot-interruption-warning", primary))
    backup = _backup(plane, "end-1")
    [execution] = plane.executions()
    plane.sfn.stop_execution(executionArn=execution["executionArn"])

    # When another state machine's execution ends, nothing is delivered; when this stack's does, the job fails
    foreign = "arn:aws:states:us-east-1:123456789012:stateMachine:someone-else"
    assert route(_status_change(plane, status, machine=foreign)) == []
    [(name, result)] = route(_status_change(plane, status))

    assert (name, result["action"]) == ("recovery-ended", "failed")
    job = plane.job("end-1")
    assert job.status == Status.FAILED and status in str(job.reason)
    assert _state(plane, backup) == "terminated"
    assert _state(plane, primary) == "terminated"
    [notice] = plane.notifications()
    assert "end-1" in notice


def test_a_failed_execution_whose_catch_ran_is_not_failed_twice(plane: ControlPlane) -> None:
    # Given a recovery whose only checkpoint fails to restore: the Catch marks the job FAILED, notifies, ends FAILED
    primary = plane.start_job("twice-1")
    only = _commit(plane, "twice-1", primary, 0, "periodic")
    route(ec2_event("state-change-terminated", primary))
    backup = _backup(plane, "twice-1")
    route(agent_event(events.AgentReady("twice-1", backup, 1, now_iso(), mode="restore")))
    plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    finish_restore(events.RestoreFailed("twice-1", backup, 1, now_iso(), checkpoint_id=only, reason="corrupt"))
    # (the second attempt walks again from the previous checkpoint; with none, from the newest)
    plane.wait_until(lambda: len(plane.sent_commands("restore")) == 2, "the second restore")
    finish_restore(events.RestoreFailed("twice-1", backup, 1, now_iso(), checkpoint_id="", reason="corrupt"))
    assert plane.wait_for_execution()["status"] == "FAILED"
    assert plane.job("twice-1").status == Status.FAILED
    first = plane.notifications()

    # When the FAILED status change arrives, Then it changes nothing and notifies no one again
    [(_, result)] = route(_status_change(plane, "FAILED"))
    assert result["action"] == "ignored"
    assert len(first) == 1 and plane.notifications() == []


def test_a_cross_az_move_deletes_the_replaced_volume_and_its_snapshot(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    primary = plane.start_job("mv-1", **{tag_names.STORAGE: "ebs"})
    old_volume = str(plane.job("mv-1").volume_id)
    _commit(plane, "mv-1", primary, 0, "periodic")
    zone_a = plane.subnets["us-east-1a"]
    plane.refuse_launches(lambda _t, subnet, _m: "InsufficientInstanceCapacity" if subnet == zone_a else None)
    route(ec2_event("spot-interruption-warning", primary))
    backup = _backup(plane, "mv-1")
    plane.wait_for_token("mv-1", "final-dump")
    _commit(plane, "mv-1", primary, 1, "final")
    _restore_on(plane, "mv-1", backup)

    job = plane.job("mv-1")
    assert job.volume_id != old_volume
    volumes = {v["VolumeId"] for v in plane.ec2.describe_volumes()["Volumes"]}
    assert old_volume not in volumes and job.volume_id in volumes
    snapshots = plane.ec2.describe_snapshots(Filters=[{"Name": "tag:spotcr:job", "Values": ["mv-1"]}])["Snapshots"]
    assert snapshots == []


@pytest.mark.parametrize("keep", [False, True])
def test_a_completed_jobs_volume_goes_with_its_instance_unless_kept(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    monkeypatch.setenv(ENV["keep_finished_volumes"], "true" if keep else "false")
    _edge._deps.cache_clear()
    primary = plane.start_job("fin-1", **{tag_names.STORAGE: "ebs"})
    volume = str(plane.job("fin-1").volume_id)
    finish_exit(events.JobExited("fin-1", primary, 0, now_iso(), exit_code=0))
    plane.ec2.terminate_instances(InstanceIds=[primary])
    route(ec2_event("state-change-terminated", primary))
    remaining = {v["VolumeId"] for v in plane.ec2.describe_volumes()["Volumes"]}
    assert (volume in remaining) == keep
    assert plane.job("fin-1").status == Status.COMPLETED


def test_a_failed_cross_az_recovery_keeps_the_jobs_volume_and_deletes_what_the_move_made(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an EBS job moved to AZ b through a snapshot, whose only checkpoint then fails to restore
    primary = plane.start_job("mvf-1", **{tag_names.STORAGE: "ebs"})
    original_volume = str(plane.job("mvf-1").volume_id)
    only = _commit(plane, "mvf-1", primary, 0, "periodic")
    zone_a = plane.subnets["us-east-1a"]
    plane.refuse_launches(lambda _t, subnet, _m: "InsufficientInstanceCapacity" if subnet == zone_a else None)
    route(ec2_event("state-change-terminated", primary))
    backup = _backup(plane, "mvf-1")
    route(agent_event(events.AgentReady("mvf-1", backup, 1, now_iso(), mode="restore")))
    plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    moved = plane.job("mvf-1")
    assert moved.handover_volume_id and moved.handover_snapshot_id

    # When both restore attempts fail and there is no earlier checkpoint
    finish_restore(events.RestoreFailed("mvf-1", backup, 1, now_iso(), checkpoint_id=only, reason="corrupt"))
    plane.wait_until(lambda: len(plane.sent_commands("restore")) == 2, "the second restore")
    finish_restore(events.RestoreFailed("mvf-1", backup, 1, now_iso(), checkpoint_id="", reason="corrupt"))

    # Then the job is FAILED, its own volume (with its checkpoints) kept, the hand-over volume and snapshot gone
    assert plane.wait_for_execution()["status"] == "FAILED"
    job = plane.job("mvf-1")
    assert (job.status, job.volume_id) == (Status.FAILED, original_volume)
    volumes = {v["VolumeId"] for v in plane.ec2.describe_volumes()["Volumes"]}
    assert original_volume in volumes and moved.handover_volume_id not in volumes
    assert plane.ec2.describe_snapshots(Filters=[{"Name": "tag:spotcr:job", "Values": ["mvf-1"]}])["Snapshots"] == []
    assert _state(plane, backup) == "terminated"
