"""AWS's API rate limits in the local AWS: token buckets with the documented sizes and refill rates, and Lambda's
account concurrency; a call over its bucket fails as AWS fails it.

Interface (the wave benchmark and the workflow tests use it):
- `Limits.aws()`: the documented defaults (`AWS_RATES` below, each figure with its source; us-east-1 where the
  figure differs by Region). `limits.scaled(0.01)` scales every bucket and the concurrency (a wave of 20 jobs meets
  the limits 2,000 jobs meet); `limits.override({"ec2:CreateTags": Rate(2, 1)})` sets chosen buckets (a test sets
  one low on purpose); `limits.only(...)` keeps only the named buckets.
- `install(patches, limits, clock=time.monotonic, sleep=time.sleep) -> Meter`: every moto request is metered until
  the `contextlib.ExitStack` `patches` closes (`LocalCloud.throttle(limits)` and `ControlPlane.throttle(limits)`
  call it). A test scales time by passing its own `clock` and `sleep`.
- `Meter.calls[(service, operation)]`: requests that reached the bucket check; `Meter.throttled[...]`: those refused;
  `Meter.retried[...]`: requests that passed as an SDK retry (botocore's `amz-sdk-request: attempt=N`, N > 1),
  i.e. throttles (or other errors) the caller's retries absorbed; `Meter.queued[function]`: asynchronous Lambda
  invocations refused for concurrency and put back in Lambda's event queue (or a test's synchronous delivery that
  waited for a slot); `Meter.delayed_transitions`: state transitions that waited for a token.
  `Meter.report()` gives all of it as plain data. Service and operation are as moto names them: botocore's service
  name (`ec2`, `ssm`, `stepfunctions`, `events`, `dynamodb`, `lambda`) and the API action (`CreateTags`).

What is modelled, and how AWS fails each call over its limit:
- EC2 (Query API): one request bucket per API, its size from the API's category or its own row; RunInstances and
  TerminateInstances also take one resource token per instance. Refused: HTTP 503, `RequestLimitExceeded`.
  DescribeInstances, DescribeVolumes and DescribeSnapshots without a filter or pagination use the smaller
  "unfiltered and unpaginated" bucket. CreateFleet has no documented resource bucket: only its request bucket.
- SSM, Step Functions, EventBridge (JSON APIs): HTTP 400 `ThrottlingException`.
- DynamoDB on-demand: one read and one write bucket (a new on-demand table's documented starting throughput, one
  token per request: spotcr's items are under 1 KB); HTTP 400 `ProvisionedThroughputExceededException`.
- Step Functions state transitions: AWS delays, not fails, a throttled transition; here the engine waits for a token.
- Lambda: at most `lambda_concurrency` invocations run at once (the account quota). A synchronous Invoke (Step
  Functions' Task states) over it fails with HTTP 429 `TooManyRequestsException` (Reason
  ConcurrentInvocationLimitExceeded); an asynchronous one (EventBridge's deliveries: `Functions.attempt`, tried by
  `awslambda.EventQueue`) goes back to Lambda's event queue, which tries it again with backoff for up to 6 hours.
  A test's own synchronous delivery (`Functions.call`) waits for a free slot. The per-function scaling rate
  (1,000 more every 10 s) is not modelled: the account quota binds first.
An operation with no row here is not throttled (S3, SNS, STS, EFS: off the recovery path, or far above its rate).
Every caller counts, the test's own calls too: AWS throttles per account and Region, whoever calls.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from werkzeug.exceptions import HTTPException

from rehearsal.localaws import wrap

EC2_GUIDE = "Amazon EC2 Developer Guide, Request throttling for the Amazon EC2 API"
SFN_QUOTAS = "AWS Step Functions Developer Guide, Step Functions service quotas (us-east-1)"
EVENTS_QUOTAS = "Amazon EventBridge User Guide, EventBridge quotas (us-east-1)"
DYNAMODB_ON_DEMAND = "Amazon DynamoDB Developer Guide, On-demand capacity mode: initial throughput of a new table"
SSM_ASSUMED = "not published by AWS (Systems Manager quotas list no Run Command API rate): an assumed figure"
LAMBDA_QUOTAS = "AWS Lambda Developer Guide, Lambda quotas: concurrent executions (default account quota)"


@dataclass(frozen=True)
class Rate:
    """A token bucket: `capacity` tokens at most, `refill_per_s` added back each second."""

    capacity: float
    refill_per_s: float
    source: str = "set by the test"

    def scaled(self, factor: float) -> Rate:
        return Rate(max(1.0, self.capacity * factor), self.refill_per_s * factor, self.source)


# Bucket key -> rate. Keys are "<service>:<operation>" for one API's request bucket, "ec2:<category>" for the EC2
# categories each API without its own row falls in, "ec2:<operation>:instances" for EC2's resource buckets.
AWS_RATES: Mapping[str, Rate] = {
    "ec2:<non-mutating>": Rate(100, 20, EC2_GUIDE + ": non-mutating actions"),
    "ec2:<unfiltered>": Rate(50, 10, EC2_GUIDE + ": unfiltered and unpaginated non-mutating actions"),
    "ec2:<mutating>": Rate(50, 5, EC2_GUIDE + ": mutating actions"),
    "ec2:CancelSpotInstanceRequests": Rate(50, 5, EC2_GUIDE + ": resource-intensive actions"),
    "ec2:CreateTags": Rate(100, 10, EC2_GUIDE + ": uncategorized actions"),
    "ec2:DeleteTags": Rate(100, 10, EC2_GUIDE + ": uncategorized actions"),
    "ec2:CreateSnapshot": Rate(100, 5, EC2_GUIDE + ": uncategorized actions"),
    "ec2:DeleteSnapshot": Rate(100, 5, EC2_GUIDE + ": uncategorized actions"),
    "ec2:CreateVolume": Rate(100, 5, EC2_GUIDE + ": uncategorized actions"),
    "ec2:DeleteVolume": Rate(100, 5, EC2_GUIDE + ": uncategorized actions"),
    "ec2:RunInstances": Rate(5, 2, EC2_GUIDE + ": uncategorized actions"),
    "ec2:StartInstances": Rate(5, 2, EC2_GUIDE + ": uncategorized actions"),
    "ec2:TerminateInstances": Rate(100, 5, EC2_GUIDE + ": uncategorized actions"),
    "ec2:RunInstances:instances": Rate(1000, 2, EC2_GUIDE + ": resource token buckets"),
    "ec2:TerminateInstances:instances": Rate(1000, 20, EC2_GUIDE + ": resource token buckets"),
    "ec2:StartInstances:instances": Rate(1000, 2, EC2_GUIDE + ": resource token buckets"),
    "ec2:StopInstances:instances": Rate(1000, 20, EC2_GUIDE + ": resource token buckets"),
    "ssm:SendCommand": Rate(20, 5, SSM_ASSUMED),
    "ssm:GetCommandInvocation": Rate(20, 10, SSM_ASSUMED),
    "stepfunctions:StartExecution": Rate(1300, 300, SFN_QUOTAS + ": API action throttling"),
    "stepfunctions:<StateTransition>": Rate(5000, 5000, SFN_QUOTAS + ": state throttling"),
    "events:PutEvents": Rate(10000, 10000, EVENTS_QUOTAS + ": PutEvents transactions per second"),
    "dynamodb:<reads>": Rate(12000, 12000, DYNAMODB_ON_DEMAND + " (12,000 reads per second)"),
    "dynamodb:<writes>": Rate(4000, 4000, DYNAMODB_ON_DEMAND + " (4,000 writes per second)"),
}
LAMBDA_CONCURRENCY = 1000  # LAMBDA_QUOTAS

EC2_UNFILTERED = frozenset(
    {
        "DescribeInstances",
        "DescribeInstanceStatus",
        "DescribeNetworkInterfaces",
        "DescribeSecurityGroups",
        "DescribeSnapshots",
        "DescribeSpotInstanceRequests",
        "DescribeVolumes",
    }
)
EC2_NON_MUTATING = re.compile(r"^(Describe|List|Search|Get)")
# The parameter that counts an EC2 instance action's instances: its resource bucket takes one token per instance.
EC2_RESOURCE_COST = {
    "RunInstances": "MaxCount",
    "StartInstances": "InstanceId",
    "StopInstances": "InstanceId",
    "TerminateInstances": "InstanceId",
}
DYNAMODB_READS = frozenset({"GetItem", "BatchGetItem", "Query", "Scan", "TransactGetItems"})
DYNAMODB_WRITES = frozenset({"PutItem", "UpdateItem", "DeleteItem", "BatchWriteItem", "TransactWriteItems"})
STATE_TRANSITION = "stepfunctions:<StateTransition>"


@dataclass(frozen=True)
class Limits:
    """Which buckets apply, and Lambda's account concurrency."""

    rates: Mapping[str, Rate]
    lambda_concurrency: int | None = LAMBDA_CONCURRENCY

    @classmethod
    def aws(cls) -> Limits:
        return cls(dict(AWS_RATES), LAMBDA_CONCURRENCY)

    def scaled(self, factor: float) -> Limits:
        """Every bucket and the concurrency times `factor` (at least one token, one slot)."""
        if factor <= 0:
            raise ValueError(f"a scale factor must be positive, not {factor}")
        concurrency = None if self.lambda_concurrency is None else max(1, int(self.lambda_concurrency * factor))
        return Limits({key: rate.scaled(factor) for key, rate in self.rates.items()}, concurrency)

    def override(self, rates: Mapping[str, Rate], lambda_concurrency: int | None = -1) -> Limits:
        """These buckets set (a key AWS_RATES lacks is added); `lambda_concurrency` set unless left at -1."""
        for key, rate in rates.items():
            if ":" not in key or rate.capacity < 1 or rate.refill_per_s <= 0:
                raise ValueError(f"bucket {key!r}: {rate} (a key is service:operation, at least 1 token, a refill)")
        concurrency = self.lambda_concurrency if lambda_concurrency == -1 else lambda_concurrency
        return Limits({**self.rates, **rates}, concurrency)

    def only(self, keys: Iterable[str], lambda_concurrency: int | None = None) -> Limits:
        """Only these buckets apply (each must exist), and this concurrency (None: unlimited)."""
        wanted = set(keys)
        unknown = wanted - set(self.rates)
        if unknown:
            raise ValueError(f"no such buckets: {sorted(unknown)}; known: {sorted(self.rates)}")
        return Limits({key: self.rates[key] for key in wanted}, lambda_concurrency)

    def request_bucket(self, service: str, operation: str, params: Mapping[str, Any]) -> tuple[str, str] | None:
        """The request bucket this call takes a token from, as (the bucket's own key, the key of its rate), or None
        if none applies. EC2 evaluates each API alone: one bucket per API, its category's size; DynamoDB's
        categories are one bucket each (the table's throughput)."""
        own = f"{service}:{operation}"
        if service == "ec2":
            if operation in EC2_UNFILTERED and not _filtered_or_paginated(params):
                category = "ec2:<unfiltered>"
            elif own in self.rates:
                return own, own
            else:
                category = "ec2:<non-mutating>" if EC2_NON_MUTATING.match(operation) else "ec2:<mutating>"
            return (f"{category}{operation}", category) if category in self.rates else None
        if own in self.rates:
            return own, own
        if service == "dynamodb":
            category = "dynamodb:<reads>" if operation in DYNAMODB_READS else "dynamodb:<writes>"
            if operation in DYNAMODB_READS | DYNAMODB_WRITES and category in self.rates:
                return category, category
        return None


def _filtered_or_paginated(params: Mapping[str, Any]) -> bool:
    return any(key.startswith(("Filter.", "MaxResults", "NextToken")) for key in params)


class Bucket:
    """One token bucket; the caller holds the throttle's lock."""

    def __init__(self, rate: Rate, now: float) -> None:
        self.rate = rate
        self.tokens = rate.capacity
        self.at = now

    def refill(self, now: float) -> None:
        self.tokens = min(self.rate.capacity, self.tokens + (now - self.at) * self.rate.refill_per_s)
        self.at = now

    def wait_s(self, cost: float) -> float:
        """Seconds until `cost` tokens are there (0: now)."""
        return max(0.0, (cost - self.tokens) / self.rate.refill_per_s)


@dataclass
class Meter:
    """What the limits did: see the module docstring."""

    calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    throttled: Counter[tuple[str, str]] = field(default_factory=Counter)
    retried: Counter[tuple[str, str]] = field(default_factory=Counter)
    queued: Counter[str] = field(default_factory=Counter)
    delayed_transitions: int = 0

    def report(self) -> dict[str, Any]:
        def named(counter: Counter[tuple[str, str]]) -> dict[str, int]:
            return {f"{service}:{operation}": n for (service, operation), n in sorted(counter.items())}

        return {
            "calls": named(self.calls),
            "throttled": named(self.throttled),
            "retried": named(self.retried),
            "lambda_queued": dict(sorted(self.queued.items())),
            "delayed_state_transitions": self.delayed_transitions,
        }


class Throttled(HTTPException):
    """A call over its bucket, in the shape the service's protocol gives it."""

    def __init__(self, service: str, protocol: str) -> None:
        super().__init__()
        if protocol == "ec2":
            self.code, self.error = 503, "RequestLimitExceeded"
            self.description = (
                "<?xml version='1.0' encoding='UTF-8'?><Response><Errors><Error><Code>RequestLimitExceeded</Code>"
                "<Message>Request limit exceeded.</Message></Error></Errors><RequestID>spotcr-throttle</RequestID>"
                "</Response>"
            )
            self.content_type = "text/xml"
        elif service == "lambda":
            self.code, self.error = 429, "TooManyRequestsException"
            self.description = json.dumps(
                {"Reason": "ConcurrentInvocationLimitExceeded", "Type": "User", "message": "Rate Exceeded."}
            )
            self.content_type = "application/json"
        elif service == "dynamodb":
            self.code, self.error = 400, "ProvisionedThroughputExceededException"
            message = "Throughput exceeds the current capacity of your table or index."
            self.description = json.dumps(
                {"__type": f"com.amazonaws.dynamodb.v20120810#{self.error}", "message": message}
            )
            self.content_type = "application/x-amz-json-1.0"
        elif protocol == "query":
            self.code, self.error = 400, "Throttling"
            self.description = (
                "<ErrorResponse><Error><Type>Sender</Type><Code>Throttling</Code><Message>Rate exceeded</Message>"
                "</Error><RequestId>spotcr-throttle</RequestId></ErrorResponse>"
            )
            self.content_type = "text/xml"
        else:
            self.code, self.error = 400, "ThrottlingException"
            self.description = json.dumps({"__type": self.error, "message": "Rate exceeded"})
            self.content_type = "application/x-amz-json-1.1"

    def get_headers(self, *args: Any, **kwargs: Any) -> list[tuple[str, str]]:
        return [("Content-Type", self.content_type), ("x-amzn-ErrorType", self.error)]

    def get_body(self, *args: Any, **kwargs: Any) -> str:
        return str(self.description)


_ATTEMPT = re.compile(r"attempt=(\d+)")
# Set while a synchronous Invoke holds its concurrency slot: the handler it runs takes no second one.
_holding_slot: contextvars.ContextVar[bool] = contextvars.ContextVar("spotcr_throttle_slot", default=False)


class Throttle:
    """The buckets and the concurrency, thread-safe; every decision is recorded in `meter`."""

    def __init__(self, limits: Limits, clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
        self.limits = limits
        self.clock = clock
        self.sleep = sleep
        self.meter = Meter()
        self._buckets: dict[str, Bucket] = {}
        self._lock = threading.Condition()
        self._running = 0

    def _bucket(self, key: str, now: float, rate_key: str = "") -> Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = Bucket(self.limits.rates[rate_key or key], now)
        bucket.refill(now)
        return bucket

    def admit(self, service: str, operation: str, params: Mapping[str, Any], attempt: int = 1) -> bool:
        """Take this call's tokens (request bucket, and resource bucket for EC2's instance actions); False: the
        call is over its limit and takes nothing."""
        request = self.limits.request_bucket(service, operation, params)
        wanted: list[tuple[tuple[str, str], float]] = [(request, 1.0)] if request else []
        resource = f"ec2:{operation}:instances"
        if service == "ec2" and resource in self.limits.rates:
            wanted.append(((resource, resource), _instances(operation, params)))
        with self._lock:
            self.meter.calls[(service, operation)] += 1
            now = self.clock()
            buckets = [(self._bucket(key, now, rate_key), cost) for (key, rate_key), cost in wanted]
            if any(bucket.tokens < cost for bucket, cost in buckets):
                self.meter.throttled[(service, operation)] += 1
                return False
            for bucket, cost in buckets:
                bucket.tokens -= cost
            if attempt > 1:
                self.meter.retried[(service, operation)] += 1
            return True

    def transition(self) -> None:
        """A state transition: waits for its token, as Step Functions slows a throttled execution."""
        if STATE_TRANSITION not in self.limits.rates:
            return
        waited = False
        while True:
            with self._lock:
                bucket = self._bucket(STATE_TRANSITION, self.clock())
                wait = bucket.wait_s(1.0)
                if wait == 0:
                    bucket.tokens -= 1
                    if waited:
                        self.meter.delayed_transitions += 1
                    return
            waited = True
            self.sleep(wait)

    def enter_function(self, function: str, wait: bool) -> bool:
        """One more invocation running; False if the account's concurrency is all in use (unless `wait`: then it
        waits for a free slot, as the test's own synchronous deliveries do)."""
        limit = self.limits.lambda_concurrency
        with self._lock:
            if limit is not None and self._running >= limit:
                if not wait:
                    return False
                self.meter.queued[function] += 1
                while self._running >= limit:
                    self._lock.wait()
            self._running += 1
            return True

    def leave_function(self) -> None:
        with self._lock:
            self._running -= 1
            self._lock.notify()


def _instances(operation: str, params: Mapping[str, Any]) -> float:
    """Resource tokens an EC2 instance action takes: one per instance."""
    name = EC2_RESOURCE_COST[operation]
    if name == "MaxCount":
        return float(_first(params.get("MaxCount")) or 1)
    return float(sum(1 for key in params if key.startswith(f"{name}.")) or 1)


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else value


def _protocol(response: Any) -> str:
    from moto.core.responses import get_service_model

    return str(get_service_model(response.boto3_service_name).protocol)


def _attempt(headers: Any) -> int:
    match = _ATTEMPT.search(str(headers.get("amz-sdk-request", "")))
    return int(match.group(1)) if match else 1


def install(
    patches: contextlib.ExitStack,
    limits: Limits,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Meter:
    """Meter every moto request, state transition and Lambda invocation against `limits` until `patches` closes."""
    from moto.core.authorization import ActionAuthenticatorMixin
    from moto.stepfunctions.parser.asl.component.state.state import CommonStateField

    from rehearsal.localaws import awslambda

    throttle = Throttle(limits, clock, sleep)

    def authorize(original: Any) -> Any:
        def metered(response: Any, resource: str = "*") -> None:
            service = response.boto3_service_name
            operation = str(response._get_action())
            params = response.querystring if isinstance(response.querystring, dict) else {}
            if not throttle.admit(service, operation, params, _attempt(response.headers)):
                raise Throttled(service, _protocol(response))
            original(response, resource)

        return metered

    def eval_body(original: Any) -> Any:
        def metered(state: Any, env: Any) -> None:
            throttle.transition()
            original(state, env)

        return metered

    def holding_a_slot(run: Callable[[], Any], function: str, refused: Callable[[], Exception]) -> Any:
        if not throttle.enter_function(function, wait=False):
            raise refused()
        token = _holding_slot.set(True)
        try:
            return run()
        finally:
            _holding_slot.reset(token)
            throttle.leave_function()

    def invoke(original: Any) -> Any:
        def refused() -> Exception:
            throttle.meter.throttled[("lambda", "Invoke")] += 1
            return Throttled("lambda", "rest-json")

        def metered(functions: Any, function: str, body: Any, response_headers: dict[str, str]) -> bytes:
            return bytes(
                holding_a_slot(lambda: original(functions, function, body, response_headers), function, refused)
            )

        return metered

    def attempt(original: Any) -> Any:
        def metered(functions: Any, name: str, payload: Any) -> Any:
            def refused() -> Exception:
                throttle.meter.queued[name] += 1
                return awslambda.TooManyRequests(f"{name}: the account's Lambda concurrency is all in use")

            return holding_a_slot(lambda: original(functions, name, payload), name, refused)

        return metered

    def call(original: Any) -> Any:
        def metered(functions: Any, name: str, payload: Any) -> Any:
            if _holding_slot.get():
                return original(functions, name, payload)
            throttle.enter_function(name, wait=True)
            try:
                return original(functions, name, payload)
            finally:
                throttle.leave_function()

        return metered

    wrap(patches, ActionAuthenticatorMixin, "_authenticate_and_authorize_normal_action", authorize)
    wrap(patches, CommonStateField, "_eval_body", eval_body)
    wrap(patches, awslambda.Functions, "invoke", invoke)
    wrap(patches, awslambda.Functions, "attempt", attempt)
    wrap(patches, awslambda.Functions, "call", call)
    return throttle.meter
