"""The local DynamoDB applies each write whole, as DynamoDB does, though moto's server serves requests in threads."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws

from rehearsal.localaws import REGION, dynamodb, wrap

TABLE = "jobs"


@pytest.fixture
def table() -> Iterator[Any]:
    """A local table holding one running job, whose writes each pause 0.3 s between their condition and their
    actions (where moto's thread could be overtaken), with the rehearsal's atomic requests on."""
    from moto.dynamodb.parsing.executors import UpdateExpressionExecutor

    def slow(original: Any) -> Any:
        def execute(executor: Any, *args: Any, **kwargs: Any) -> Any:
            time.sleep(0.3)
            return original(executor, *args, **kwargs)

        return execute

    with mock_aws(), contextlib.ExitStack() as patches:
        dynamodb.atomic_requests(patches)
        wrap(patches, UpdateExpressionExecutor, "execute", slow)
        resource = boto3.resource("dynamodb", region_name=REGION)
        jobs = resource.create_table(
            TableName=TABLE,
            KeySchema=[{"AttributeName": "job_id", "KeyType": "HASH"}],
            AttributeDefinitions=[{"AttributeName": "job_id", "AttributeType": "S"}],
            BillingMode="PAY_PER_REQUEST",
        )
        jobs.put_item(Item={"job_id": "j", "status": "RUNNING"})
        yield jobs


def end(jobs: Any, code: int, outcomes: list[str]) -> None:
    try:
        jobs.update_item(
            Key={"job_id": "j"},
            UpdateExpression="SET #s = :done, exit_code = :code",
            ConditionExpression="#s = :running",
            ExpressionAttributeNames={"#s": "status"},
            ExpressionAttributeValues={":done": "COMPLETED", ":code": code, ":running": "RUNNING"},
        )
        outcomes.append(f"ended {code}")
    except jobs.meta.client.exceptions.ConditionalCheckFailedException:
        outcomes.append(f"refused {code}")


def test_a_read_during_a_write_sees_the_whole_write(table):
    # Given a write that ends the job, under way in another thread
    outcomes: list[str] = []
    writer = threading.Thread(target=end, args=(table, 0, outcomes))
    writer.start()
    time.sleep(0.1)
    # When the job is read meanwhile
    item = table.get_item(Key={"job_id": "j"})["Item"]
    writer.join()
    # Then the read waited for the write: the status and the exit code come together
    assert outcomes == ["ended 0"]
    assert (item["status"], item.get("exit_code")) == ("COMPLETED", 0)


def test_of_two_writes_on_one_condition_only_the_first_passes(table):
    # Given two ends of one job, each conditional on the job still running, sent at once
    outcomes: list[str] = []
    writers = [threading.Thread(target=end, args=(table, code, outcomes)) for code in (0, 1)]
    for writer in writers:
        writer.start()
        time.sleep(0.05)
    for writer in writers:
        writer.join()
    # Then the first ends it and the second is refused
    assert outcomes == ["ended 0", "refused 1"]
    assert table.get_item(Key={"job_id": "j"})["Item"]["exit_code"] == 0


def _bodies(patched: bool) -> list[bytes]:
    """The raw response bodies of a write and reads of an item holding every kind of value, with or without
    wire_form_values."""
    bodies: list[bytes] = []

    def keep(response_dict: dict[str, Any], **_kwargs: Any) -> None:
        bodies.append(response_dict["body"])

    with mock_aws(), contextlib.ExitStack() as patches:
        if patched:
            dynamodb.wire_form_values(patches)
        client = boto3.client("dynamodb", region_name=REGION)
        client.create_table(
            TableName=TABLE,
            KeySchema=[{"AttributeName": "job_id", "KeyType": "HASH"}],
            AttributeDefinitions=[{"AttributeName": "job_id", "AttributeType": "S"}],
            BillingMode="PAY_PER_REQUEST",
        )
        item = {
            "job_id": {"S": "j"},
            "empty": {"S": ""},
            "count": {"N": "-12.5"},
            "blob": {"B": b"\x00\xffbytes"},
            "names": {"SS": ["a", "b"]},
            "numbers": {"NS": ["1", "2"]},
            "blobs": {"BS": [b"x", b"y"]},
            "done": {"BOOL": False},
            "none": {"NULL": True},
            "arrivals": {"M": {"final-dump": {"M": {"generation": {"N": "3"}, "output": {"M": {}}}}}},
            "history": {"L": [{"S": "x"}, {"N": "1"}, {"L": []}, {"B": b"z"}]},
            "steps": {"L": [{"S": "x"}, {"M": {"at": {"N": "1"}, "by": {"NULL": True}}}, {"L": [{"BOOL": True}]}]},
        }
        client.meta.events.register("before-parse.dynamodb.*", keep)
        client.put_item(TableName=TABLE, Item=item, ReturnValues="ALL_OLD")
        client.get_item(TableName=TABLE, Key={"job_id": {"S": "j"}}, ConsistentRead=True)
        client.update_item(
            TableName=TABLE,
            Key={"job_id": {"S": "j"}},
            UpdateExpression="SET #c = #c + :one, arrivals.#r = :m",
            ExpressionAttributeNames={"#c": "count", "#r": "restore"},
            ExpressionAttributeValues={":one": {"N": "1"}, ":m": {"M": {"at": {"S": "now"}}}},
            ReturnValues="ALL_NEW",
        )
        client.scan(TableName=TABLE)
    return bodies


def test_plain_values_pass_through_as_the_same_bytes_moto_writes():
    # Given the same requests against the local DynamoDB with and without plain values passed through
    # Then every response is the same, byte for byte: binary values, and maps and lists with or without them
    assert _bodies(patched=True) == _bodies(patched=False)
