"""A recovery under AWS's rate limits, set low on purpose: every throttle it meets is absorbed (the SDK's retries,
the state machine's Retry, Lambda's event queue) and the job still recovers."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from botocore.exceptions import ClientError
from spotcr_contracts import tags as tag_names
from spotcr_functions import final_dumps, recovery
from spotcr_functions.cloud import Cloud
from spotcr_functions.handlers import interruption
from spotcr_functions.models import Status

from rehearsal.controlplane import ControlPlane, ec2_event, route
from rehearsal.localaws.throttle import STATE_TRANSITION, Limits, Rate
from tests.support import wait_for
from tests.workflow.support import commit, recover

# Per path, the buckets set low: one token, refilled every half second or so (SendCommand: every 5 s, the time between
# its calls in a recovery), so that a recovery's second call to the same API within that time is refused.
LOW = {
    "ec2": {
        "ec2:<mutating>": Rate(1, 2),
        "ec2:<non-mutating>": Rate(1, 2),
        "ec2:<unfiltered>": Rate(1, 2),
        "ec2:CreateTags": Rate(1, 2),
        "ec2:CreateVolume": Rate(1, 2),
        "ec2:RunInstances": Rate(1, 2),
        "ec2:TerminateInstances": Rate(1, 2),
    },
    "ssm": {"ssm:SendCommand": Rate(1, 0.2), "ssm:GetCommandInvocation": Rate(1, 0.5)},
    "dynamodb": {"dynamodb:<reads>": Rate(1, 10), "dynamodb:<writes>": Rate(1, 10)},
    "stepfunctions": {"stepfunctions:StartExecution": Rate(1, 1), STATE_TRANSITION: Rate(1, 8)},
}


@pytest.mark.parametrize("service", sorted(LOW))
def test_a_recovery_whose_calls_are_throttled_still_recovers(plane: ControlPlane, service: str) -> None:
    # Given a running job on an EBS volume (the volume hand-over's calls too), with a periodic checkpoint
    primary = plane.start_job("wave-1", **{tag_names.STORAGE: "ebs"})
    periodic = commit(plane, "wave-1", primary, 0, "periodic")
    meter = plane.throttle(Limits.aws().only([]).override(LOW[service]))

    # When the interruption warning comes and the recovery's calls meet buckets of one token
    route(ec2_event("spot-interruption-warning", primary))
    backup = recover(plane, "wave-1", periodic, final_from=primary)

    # Then the job runs again on the backup, from its final dump, and throttles were met on the way
    job = plane.job("wave-1")
    assert (job.status, job.instance_id, job.generation) == (Status.RUNNING, backup, 1)
    assert job.checkpoint_id != periodic
    throttled = {key: n for key, n in meter.throttled.items() if key[0] == service}
    delayed = meter.delayed_transitions if service == "stepfunctions" else 0
    assert sum(throttled.values()) + delayed > 0, str(meter.report()["calls"])


def test_a_step_lambda_refuses_for_the_account_concurrency_is_retried(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an account whose Lambda concurrency is 1, held by the interruption handler until the workflow's first
    # step has been refused (a synchronous Invoke over the concurrency: 429 TooManyRequestsException)
    primary = plane.start_job("wave-2")
    periodic = commit(plane, "wave-2", primary, 0, "periodic")
    meter = plane.throttle(Limits.aws().only([], lambda_concurrency=1))
    handler = interruption.handler

    def holding_the_slot(event: dict[str, Any], context: Any) -> dict[str, Any]:
        result = handler(event, context)
        wait_for(lambda: meter.throttled[("lambda", "Invoke")], "the plan step refused")
        return result

    monkeypatch.setattr(interruption, "handler", holding_the_slot)

    # When the warning comes, then the refused step is retried (Lambda.TooManyRequestsException) and the job recovers
    route(ec2_event("spot-interruption-warning", primary))
    backup = recover(plane, "wave-2", periodic, final_from=primary)
    job = plane.job("wave-2")
    assert (job.status, job.instance_id) == (Status.RUNNING, backup)
    assert meter.throttled[("lambda", "Invoke")] >= 1


def _warning_command_throttled(monkeypatch: pytest.MonkeyPatch) -> None:
    """SendCommand refuses every final-dump command the warning's handler sends (it runs in the test's thread) for
    its rate, for the half second it keeps trying; the workflow's sends go through."""
    send_final_dumps = Cloud.send_final_dumps
    warnings_thread = threading.get_ident()
    monkeypatch.setattr(final_dumps, "SEND_S", 0.5)

    def throttled_in_the_warning(cloud: Cloud, *args: Any, **kwargs: Any) -> str:
        if threading.get_ident() == warnings_thread:
            raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"}}, "SendCommand")
        return str(send_final_dumps(cloud, *args, **kwargs))

    monkeypatch.setattr(Cloud, "send_final_dumps", throttled_in_the_warning)


# The first try sent the final-dump command, or SSM throttled it and the try left it to the workflow's wait
@pytest.mark.parametrize("command_throttled", [False, True])
def test_a_warning_retried_after_a_throttled_start_still_waits_for_its_final_dump(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch, command_throttled: bool
) -> None:
    # Given a job, and a StartExecution refused once for its rate after the final dump was ordered
    primary = plane.start_job("wave-3")
    periodic = commit(plane, "wave-3", primary, 0, "periodic")
    start_recovery = Cloud.start_recovery
    refusals = [ClientError({"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"}}, "StartExecution")]

    def refused_once(cloud: Cloud, *args: Any, **kwargs: Any) -> bool:
        if refusals:
            raise refusals.pop()
        return bool(start_recovery(cloud, *args, **kwargs))

    monkeypatch.setattr(Cloud, "start_recovery", refused_once)
    if command_throttled:
        _warning_command_throttled(monkeypatch)
    warning = ec2_event("spot-interruption-warning", primary)
    with pytest.raises(ClientError, match="ThrottlingException"):
        route(warning)

    # When Lambda's asynchronous retry delivers the warning again
    route(warning)

    # Then the workflow it starts waits for the final dump the first try ordered, and restores from it
    backup = recover(plane, "wave-3", periodic, final_from=primary)
    [dump] = plane.sent_commands("final-dump")
    job = plane.job("wave-3")
    assert (job.status, job.instance_id) == (Status.RUNNING, backup)
    assert job.checkpoint_id != periodic
    assert dump["instances"] == [primary]


def test_a_final_dump_command_throttled_at_the_warning_is_sent_by_the_final_dump_wait(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a job, and the warning's final-dump command refused for SendCommand's rate for as long as it tries
    primary = plane.start_job("wave-4")
    periodic = commit(plane, "wave-4", primary, 0, "periodic")
    _warning_command_throttled(monkeypatch)

    # When the warning comes
    [(_, outcome)] = route(ec2_event("spot-interruption-warning", primary))

    # Then the recovery starts and waits for a final dump; the wait sends the order the warning put back in the
    # outbox, and the job runs again from its final dump
    assert outcome["final_dump"] is True, outcome
    backup = recover(plane, "wave-4", periodic, final_from=primary)
    job = plane.job("wave-4")
    assert (job.status, job.instance_id) == (Status.RUNNING, backup)
    assert job.checkpoint_id != periodic and str(job.checkpoint_id).endswith("-final")
    assert len(plane.sent_commands("final-dump")) == 1


def test_a_warning_retried_after_a_crash_right_after_its_fencing_write_still_waits_for_its_final_dump(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a job whose warning's first try fails right after the fencing write, before its final-dump order is
    # queued or sent (as when DynamoDB throttled the write queueing it past the SDK's retries); the wait trusts an
    # unsent order to its sender for 2 s here (HOLD_S)
    primary = plane.start_job("wave-5")
    periodic = commit(plane, "wave-5", primary, 0, "periodic")
    recover_with_final_dump = recovery._recover_with_final_dump
    crashes = [RuntimeError("the invocation died after the fencing write")]
    monkeypatch.setattr(final_dumps, "HOLD_S", 2.0)

    def crashing_once(*args: Any, **kwargs: Any) -> None:
        if crashes:
            raise crashes.pop()
        recover_with_final_dump(*args, **kwargs)

    monkeypatch.setattr(recovery, "_recover_with_final_dump", crashing_once)
    warning = ec2_event("spot-interruption-warning", primary)
    with pytest.raises(RuntimeError, match="after the fencing write"):
        route(warning)

    # When Lambda's asynchronous retry delivers the warning again
    route(warning)

    # Then the workflow it starts waits for a final dump (its wait queues the order again once HOLD_S has passed,
    # and sends it), and the job runs again from it
    backup = recover(plane, "wave-5", periodic, final_from=primary)
    job = plane.job("wave-5")
    assert (job.status, job.instance_id) == (Status.RUNNING, backup)
    assert job.checkpoint_id != periodic and str(job.checkpoint_id).endswith("-final")
    assert len(plane.sent_commands("final-dump")) == 1
