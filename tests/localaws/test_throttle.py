"""AWS's rate limits in the local AWS: token buckets refill as documented, and a call over its bucket fails as AWS
fails it (the error code, the HTTP status, and botocore's reading of it as a throttle)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from moto import mock_aws

from rehearsal.localaws import REGION, throttle
from rehearsal.localaws.throttle import AWS_RATES, Limits, Rate

NO_RETRIES = Config(retries={"mode": "standard", "total_max_attempts": 1})


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "MOTO_EC2_LOAD_DEFAULT_AMIS": "false",  # loading moto's public images takes seconds
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with mock_aws():
        yield


def throttled(limits: Limits, clock: Clock) -> contextlib.ExitStack:
    patches = contextlib.ExitStack()
    patches.meter = throttle.install(patches, limits, clock=clock)  # type: ignore[attr-defined]
    return patches


def error_of(call: object) -> ClientError:
    with pytest.raises(ClientError) as raised:
        call()  # type: ignore[operator]
    return raised.value


def test_every_figure_names_its_source_and_the_ec2_buckets_are_the_documented_ones() -> None:
    assert all(rate.source and rate.capacity >= 1 and rate.refill_per_s > 0 for rate in AWS_RATES.values())
    figures = {key: (rate.capacity, rate.refill_per_s) for key, rate in AWS_RATES.items()}
    assert figures["ec2:RunInstances:instances"] == (1000, 2)
    assert figures["ec2:TerminateInstances:instances"] == (1000, 20)
    assert figures["ec2:<mutating>"] == (50, 5)
    assert figures["ec2:<non-mutating>"] == (100, 20)


def test_an_ec2_api_bucket_empties_then_refills_at_its_rate(aws: None) -> None:
    # Given CreateTags' bucket of 3 tokens refilled 1 per second, and a clock the test moves
    clock = Clock()
    limits = Limits.aws().only([]).override({"ec2:CreateTags": Rate(3, 1)})
    ec2 = boto3.client("ec2", config=NO_RETRIES)
    volume = ec2.create_volume(AvailabilityZone=f"{REGION}a", Size=1)["VolumeId"]
    with throttled(limits, clock) as patches:
        tag = lambda: ec2.create_tags(Resources=[volume], Tags=[{"Key": "k", "Value": "v"}])  # noqa: E731
        # When 3 calls spend the bucket, the 4th in the same instant is refused as EC2 refuses it
        for _ in range(3):
            tag()
        error = error_of(tag)
        assert error.response["Error"]["Code"] == "RequestLimitExceeded"
        assert error.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        # Then half a second gives no whole token, a second gives one, and other APIs were never limited
        clock.now = 0.5
        error_of(tag)
        clock.now = 1.0
        tag()
        error_of(tag)
        ec2.describe_volumes(VolumeIds=[volume])
        meter = patches.meter  # type: ignore[attr-defined]
        assert meter.calls[("ec2", "CreateTags")] == 7
        assert meter.throttled[("ec2", "CreateTags")] == 3
        assert meter.throttled[("ec2", "DescribeVolumes")] == 0


def test_a_full_bucket_keeps_no_more_than_its_capacity(aws: None) -> None:
    clock = Clock()
    limits = Limits.aws().only(["ec2:<unfiltered>"]).override({"ec2:<unfiltered>": Rate(2, 1)})
    ec2 = boto3.client("ec2", config=NO_RETRIES)
    with throttled(limits, clock):
        clock.now = 1000.0  # idle for long: still only 2 tokens
        ec2.describe_instances()
        ec2.describe_instances()
        assert error_of(ec2.describe_instances).response["Error"]["Code"] == "RequestLimitExceeded"
        # A filtered DescribeInstances takes from the larger non-mutating bucket, not limited here
        ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["running"]}])


def test_each_ec2_api_has_its_own_bucket_of_its_categorys_size(aws: None) -> None:
    # Given the mutating category at one token a second
    clock = Clock()
    limits = Limits.aws().only(["ec2:<mutating>"]).override({"ec2:<mutating>": Rate(1, 1)})
    ec2 = boto3.client("ec2", config=NO_RETRIES)
    with throttled(limits, clock):
        ec2.create_vpc(CidrBlock="10.1.0.0/16")
        # When another mutating API is called, it has its own token; the same API again has none
        ec2.create_security_group(GroupName="g", Description="g")
        error = error_of(lambda: ec2.create_vpc(CidrBlock="10.2.0.0/16"))
        assert error.response["Error"]["Code"] == "RequestLimitExceeded"


def test_run_instances_takes_a_resource_token_per_instance(aws: None) -> None:
    # Given room for 3 instances (the request bucket itself is ample)
    clock = Clock()
    limits = Limits.aws().only(["ec2:RunInstances:instances"]).override({"ec2:RunInstances:instances": Rate(3, 2)})
    ec2 = boto3.client("ec2", config=NO_RETRIES)
    with throttled(limits, clock):
        ec2.run_instances(ImageId="ami-760aaa0f", MinCount=2, MaxCount=2)
        # When 2 more are asked for, only 1 token is left: refused, and nothing launched
        error = error_of(lambda: ec2.run_instances(ImageId="ami-760aaa0f", MinCount=2, MaxCount=2))
        assert error.response["Error"]["Code"] == "RequestLimitExceeded"
        assert len([i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]]) == 2
        # Then after 0.5 s (2 instances a second) there are 2 tokens
        clock.now = 0.5
        ec2.run_instances(ImageId="ami-760aaa0f", MinCount=2, MaxCount=2)


@pytest.mark.parametrize(
    ("service", "call", "code"),
    [
        ("ssm", lambda c: c.list_commands(), "ThrottlingException"),
        ("stepfunctions", lambda c: c.list_state_machines(), "ThrottlingException"),
        ("events", lambda c: c.put_events(Entries=[{"Source": "s", "DetailType": "d", "Detail": "{}"}]), ""),
        ("dynamodb", lambda c: c.list_tables(), ""),
    ],
)
def test_json_services_refuse_with_their_throttling_error(aws: None, service: str, call: object, code: str) -> None:
    client = boto3.client(service, config=NO_RETRIES)
    operation = {
        "ssm": "ListCommands",
        "stepfunctions": "ListStateMachines",
        "events": "PutEvents",
        "dynamodb": "ListTables",
    }[service]
    limits = Limits.aws().only([]).override({f"{service}:{operation}": Rate(1, 1)})
    with throttled(limits, Clock()):
        call(client)  # type: ignore[operator]
        error = error_of(lambda: call(client))  # type: ignore[operator]
    expected = code or ("ProvisionedThroughputExceededException" if service == "dynamodb" else "ThrottlingException")
    assert error.response["Error"]["Code"] == expected
    assert error.response["ResponseMetadata"]["HTTPStatusCode"] == 400


def test_dynamodb_reads_and_writes_share_their_category_bucket(aws: None) -> None:
    dynamodb = boto3.client("dynamodb", config=NO_RETRIES)
    dynamodb.create_table(
        TableName="t",
        KeySchema=[{"AttributeName": "k", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "k", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    limits = Limits.aws().only(["dynamodb:<writes>"]).override({"dynamodb:<writes>": Rate(2, 1)})
    with throttled(limits, Clock()):
        dynamodb.put_item(TableName="t", Item={"k": {"S": "a"}})
        dynamodb.put_item(TableName="t", Item={"k": {"S": "b"}})
        error = error_of(lambda: dynamodb.delete_item(TableName="t", Key={"k": {"S": "a"}}))
        assert error.response["Error"]["Code"] == "ProvisionedThroughputExceededException"
        dynamodb.get_item(TableName="t", Key={"k": {"S": "a"}})  # reads are another bucket


def test_an_sdk_retry_that_gets_through_is_counted_as_absorbed(aws: None) -> None:
    # Given one token a second and botocore's standard retries, the second call is refused once, then retried
    limits = Limits.aws().only([]).override({"ssm:ListCommands": Rate(1, 1)})
    ssm = boto3.client("ssm", config=Config(retries={"mode": "standard", "total_max_attempts": 5}))
    with throttled(limits, time_clock := Clock()) as patches:
        ssm.list_commands()

        def later(*args: object, **kwargs: object) -> None:
            time_clock.now += 1.0  # the SDK's backoff: the test's clock moves instead of sleeping

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("botocore.retries.standard.ExponentialBackoff.delay_amount", lambda self, context: 0.0)
            mp.setattr("time.sleep", later)
            ssm.list_commands()
        meter = patches.meter  # type: ignore[attr-defined]
        assert meter.throttled[("ssm", "ListCommands")] >= 1
        assert meter.retried[("ssm", "ListCommands")] == 1


def test_limits_scale_and_refuse_bad_overrides() -> None:
    scaled = Limits.aws().scaled(0.01)
    assert scaled.rates["ec2:RunInstances:instances"] == Rate(10, 0.02, AWS_RATES["ec2:RunInstances:instances"].source)
    assert scaled.rates["ec2:RunInstances"].capacity == 1  # never below one token
    assert scaled.lambda_concurrency == 10
    with pytest.raises(ValueError, match="ec2:CreateTags"):
        Limits.aws().override({"ec2:CreateTags": Rate(0, 1)})
    with pytest.raises(ValueError, match="no such buckets"):
        Limits.aws().only(["ec2:NoSuchApi"])
    with pytest.raises(ValueError, match="positive"):
        Limits.aws().scaled(0)


def test_lambda_concurrency_refuses_an_invocation_or_makes_a_waiting_one_wait() -> None:
    # Given an account concurrency of 1, held by a running invocation
    limits = Limits.aws().only([], lambda_concurrency=1)
    gate = throttle.Throttle(limits, Clock(), lambda seconds: None)
    assert gate.enter_function("a", wait=False)
    # When another comes, it is refused; one that may wait (the test's own delivery) waits until the slot is free
    assert not gate.enter_function("b", wait=False)
    entered = threading.Event()

    def invoke_async() -> None:
        gate.enter_function("c", wait=True)
        entered.set()

    waiter = threading.Thread(target=invoke_async)
    waiter.start()
    assert not entered.wait(0.2)
    gate.leave_function()
    assert entered.wait(5)
    waiter.join()
    assert gate.meter.queued == {"c": 1}


def test_a_throttled_state_transition_waits_for_its_token() -> None:
    clock = Clock()
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    limits = Limits.aws().only([throttle.STATE_TRANSITION]).override({throttle.STATE_TRANSITION: Rate(2, 4)})
    gate = throttle.Throttle(limits, clock, sleep)
    for _ in range(3):
        gate.transition()
    assert slept == [0.25]
    assert gate.meter.delayed_transitions == 1
