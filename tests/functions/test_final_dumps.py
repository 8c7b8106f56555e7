"""A wave's final-dump orders go out in as few commands as they fit, and a throttle never loses one
(spotcr_functions.final_dumps, its rules)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest
from botocore.exceptions import ClientError
from spotcr_contracts import commands
from spotcr_functions import final_dumps, recovery
from spotcr_functions.cloud import Cloud, Throttled
from spotcr_functions.deps import Deps
from spotcr_functions.handlers import _edge
from spotcr_functions.models import JobRecord
from spotcr_functions.registry import FINAL_DUMP_COMMAND

from rehearsal.controlplane import ControlPlane, now_iso


def _fenced(plane: ControlPlane, deps: Deps, count: int) -> list[tuple[JobRecord, str]]:
    """`count` running jobs, each fenced by a warning's write (which records its final dump as ordered, not sent)."""
    fenced = []
    for number in range(count):
        instance_id = plane.start_job(f"wave-{number}")
        record = deps.registry.bump_generation(f"wave-{number}", instance_id, 0, now_iso(), final_dump=True)
        assert record is not None
        fenced.append((record, instance_id))
    return fenced


def _queue(deps: Deps, fenced: list[tuple[JobRecord, str]]) -> None:
    deps.registry.queue_final_dumps([final_dumps.order_of(record, i).text() for record, i in fenced])


def _refusing(monkeypatch: pytest.MonkeyPatch, code: str, refuse: Any) -> list[list[str]]:
    """SendCommand refuses a final-dump command with `code` when `refuse(instance ids)`; returns the ids of each
    command it let through."""
    send = Cloud.send_final_dumps
    passed: list[list[str]] = []

    def refusing(cloud: Cloud, document: str, orders: Any) -> str:
        instance_ids = [o.instance_id for o in orders]
        if refuse(instance_ids):
            raise ClientError({"Error": {"Code": code, "Message": code}}, "SendCommand")
        passed.append(instance_ids)
        return send(cloud, document, orders)

    monkeypatch.setattr(Cloud, "send_final_dumps", refusing)
    return passed


def test_the_orders_queued_meanwhile_go_out_in_one_command_each_recorded_on_its_job(plane: ControlPlane) -> None:
    # Given three jobs warned at once, two with their order in the outbox
    deps = _edge.deps()
    fenced = _fenced(plane, deps, 3)
    _queue(deps, fenced[:2])

    # When the third's handler sends its own order
    assert final_dumps.send(deps, [final_dumps.order_of(*fenced[2])]) is False

    # Then one final-dump command carries the three orders, each agent its own, and each job records that command
    [command] = plane.ssm.list_commands()["Commands"]
    assert command["DocumentName"] == plane.documents["final-dump"]
    assert sorted(command["InstanceIds"]) == sorted(instance_id for _, instance_id in fenced)
    orders = commands.parse_orders(command["Parameters"]["Orders"][0])
    assert sorted(orders, key=lambda o: o.job_id) == [final_dumps.order_of(r, i) for r, i in fenced]
    for record, instance_id in fenced:
        ordered = plane.job(record.job_id).extra[FINAL_DUMP_COMMAND]
        assert ordered == {"command_id": command["CommandId"], "instance_id": instance_id, "generation": 1}
    # And the outbox is empty: a second sender finds nothing to send
    assert deps.registry.take_final_dumps() == set()


def test_orders_a_throttle_kept_back_go_out_with_the_next_senders_own(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a job's order, and SSM refusing the first command for its rate
    deps = _edge.deps()
    [first, second] = _fenced(plane, deps, 2)
    refusals = [True]
    passed = _refusing(monkeypatch, "ThrottlingException", lambda _: refusals and refusals.pop())

    # When its sender is throttled, then it puts the order back
    assert final_dumps.send(deps, [final_dumps.order_of(*first)]) is True
    assert plane.ssm.list_commands()["Commands"] == []

    # And when the next warning's sender sends its own, one command carries both orders
    assert final_dumps.send(deps, [final_dumps.order_of(*second)]) is False
    assert [sorted(ids) for ids in passed] == [sorted([first[1], second[1]])]
    for record, _ in (first, second):
        assert plane.job(record.job_id).extra[FINAL_DUMP_COMMAND]["command_id"]


def test_a_sender_keeps_trying_what_a_throttle_kept_back_while_its_time_lasts(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an order, and SSM refusing two commands for its rate
    deps = dataclasses.replace(_edge.deps(), sleep=lambda _: None)
    fenced = _fenced(plane, deps, 1)
    refusals = [True, True]
    passed = _refusing(monkeypatch, "ThrottlingException", lambda _: refusals and refusals.pop())
    _queue(deps, fenced)

    # When a warning's sender is given time to try again, then the third try sends it
    assert final_dumps.send(deps, for_s=final_dumps.SEND_S) is False
    assert passed == [[fenced[0][1]]]


def test_an_order_ssm_refuses_resumes_its_jobs_wait_and_the_others_still_go_out(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given three orders, and SSM refusing any command to the second job's instance (its SSM Agent is gone)
    deps = _edge.deps()
    fenced = _fenced(plane, deps, 3)
    gone = fenced[1][1]
    passed = _refusing(monkeypatch, "InvalidInstanceId", lambda ids: gone in ids)
    _queue(deps, fenced)

    # When the outbox is sent
    assert final_dumps.send(deps) is False

    # Then the others' orders went out, one command each, and the refused job's final-dump wait resumes with
    # FinalDumpNotDelivered (the job restores from its newest committed checkpoint)
    assert sorted(passed) == sorted([[fenced[0][1]], [fenced[2][1]]])
    refused = plane.job(fenced[1][0].job_id)
    assert FINAL_DUMP_COMMAND not in refused.extra or "command_id" not in refused.extra[FINAL_DUMP_COMMAND]
    arrival = refused.arrival("final-dump") or {}
    assert (arrival.get("error"), arrival.get("generation")) == ("FinalDumpNotDelivered", 1)
    assert gone in str(arrival.get("cause"))
    # And the workflow's wait, when it begins, does not send it again
    recovery.order_deferred_final_dump(deps, refused.job_id, 1)
    assert len(passed) == 2


def test_the_workflows_wait_trusts_a_young_order_to_its_sender(plane: ControlPlane) -> None:
    # Given a job whose order a sender holds (taken from the outbox, not yet sent)
    deps = _edge.deps()
    [(record, _)] = _fenced(plane, deps, 1)

    # When the workflow's final-dump wait begins within HOLD_S of the warning, then it sends nothing and leaves as
    # Throttled, which the wait's Retry waits out
    with pytest.raises(Throttled, match="not sent yet"):
        recovery.order_deferred_final_dump(deps, record.job_id, 1)
    assert plane.ssm.list_commands()["Commands"] == []


def test_the_workflows_wait_queues_again_an_order_whose_sender_died(plane: ControlPlane) -> None:
    # Given a job whose warning's sender died holding its order
    deps = _edge.deps()
    [(record, instance_id)] = _fenced(plane, deps, 1)

    # When the workflow's final-dump wait begins HOLD_S after the warning
    later = deps.now() + timedelta(seconds=final_dumps.HOLD_S + 1)
    recovery.order_deferred_final_dump(dataclasses.replace(deps, now=lambda: later), record.job_id, 1)

    # Then it queues the order again and sends it
    [command] = plane.ssm.list_commands()["Commands"]
    assert command["InstanceIds"] == [instance_id]
    assert plane.job(record.job_id).extra[FINAL_DUMP_COMMAND]["command_id"] == command["CommandId"]


def test_orders_split_into_commands_of_at_most_fifty_instances_and_4_kib() -> None:
    short = [commands.FinalDumpOrder(f"i-{n:017x}", "job-1", "", 1, 1) for n in range(120)]
    assert [len(b) for b in commands.order_batches(short)] == [50, 50, 20]
    long = [commands.FinalDumpOrder(f"i-{n:017x}", "j" * 63, "r-0123456789abcdef", 10**9, 10**9) for n in range(40)]
    batches = commands.order_batches(long)
    assert all(len(commands.orders_value(b)) <= commands.ORDERS_MAX_CHARS for b in batches)
    assert sum(len(b) for b in batches) == 40 and len(batches) == 2
