"""Lambda: invoking one of the stack's functions runs its catalog handler in this process, as the Lambda runtime
would, with its AWS calls signed as the function's role (enforced by rehearsal/iam/enforce.py); and Lambda's event
queue, which runs asynchronous invocations (EventBridge's deliveries) and retries them as Lambda does."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aws_lambda_powertools.metrics.provider.cloudwatch_emf.cloudwatch import AmazonCloudWatchEMFProvider
from spotcr_functions import catalog, observability

from rehearsal.iam import enforce
from rehearsal.localaws import ACCOUNT, REGION, wrap


class _PerInvocationMetrics(AmazonCloudWatchEMFProvider):
    """Powertools' metrics provider with what one invocation adds (metrics, dimensions, metadata) held per thread.

    Lambda runs each concurrent invocation in an execution environment of its own, so the module-level metric set
    that every handler shares (spotcr_functions.observability) is only ever touched by one invocation at a time.
    Here concurrent invocations are threads of one process: with one shared set, an invocation's flush could empty
    it between another's check and serialization, and Powertools raised "Must contain at least one metric"."""

    _invocation = threading.local()

    def _fresh(self, name: str) -> Any:
        if name == "dimension_sets":
            return []
        if name == "dimension_set":
            return {key: str(value) for key, value in self.default_dimensions.items()}
        return {}

    @staticmethod
    def _own(name: str) -> Any:
        def get(self: _PerInvocationMetrics) -> Any:
            state = vars(_PerInvocationMetrics._invocation)
            if name not in state:
                state[name] = self._fresh(name)
            return state[name]

        def put(self: _PerInvocationMetrics, value: Any) -> None:
            setattr(_PerInvocationMetrics._invocation, name, value)

        return property(get, put)

    metric_set = _own("metric_set")
    dimension_set = _own("dimension_set")
    dimension_sets = _own("dimension_sets")
    metadata_set = _own("metadata_set")


# Swapping the class of the one provider instance reaches the handlers' `log_metrics` closures, made at import.
observability.metrics.provider.__class__ = _PerInvocationMetrics


@dataclass(frozen=True)
class LambdaContext:
    """The attributes of the Lambda context object that handlers and Powertools read."""

    function_name: str
    invoked_function_arn: str
    memory_limit_in_mb: int
    timeout_s: int
    aws_request_id: str
    started: float
    function_version: str = "$LATEST"
    log_group_name: str = "/aws/lambda/rehearsal"
    log_stream_name: str = "rehearsal"

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self.started + self.timeout_s - time.monotonic()) * 1000))


@dataclass(frozen=True)
class Functions:
    """The catalog's functions as the stack deploys them: each named `<prefix><catalog name>`."""

    prefix: str

    def arn(self, name: str) -> str:
        """The deployed function's ARN, by its catalog name."""
        return f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{self.prefix}{name}"

    def call(self, name: str, payload: Any) -> Any:
        """Run the function (by its catalog name) as Lambda runs it: its AWS calls made as the function's role."""
        function = catalog.by_name(name)
        module_name, attribute = function.handler.rsplit(".", 1)
        handler = getattr(importlib.import_module(module_name), attribute)
        context = LambdaContext(
            function_name=self.prefix + name,
            invoked_function_arn=self.arn(name),
            memory_limit_in_mb=function.memory_mb,
            timeout_s=function.timeout_s,
            aws_request_id=str(uuid.uuid4()),
            started=time.monotonic(),
        )
        with enforce.acting_as(enforce.function_key(function.name)):
            return handler(payload, context)

    def attempt(self, name: str, payload: Any) -> Any:
        """One try of an asynchronous invocation (EventQueue's): as `call`, but under a concurrency limit
        (rehearsal/localaws/throttle.py) TooManyRequests when no slot is free, where `call` would wait."""
        return self.call(name, payload)

    def catalog_name(self, function: str) -> str:
        """The catalog name of a deployed function, given by name or ARN (a qualifier dropped)."""
        name = function.rsplit(":function:", maxsplit=1)[-1].split(":", maxsplit=1)[0]
        if not name.startswith(self.prefix):
            raise KeyError(f"no local function {function!r}: the stack's are named {self.prefix}<name>")
        return name.removeprefix(self.prefix)

    def invoke(self, function: str, body: Any, response_headers: dict[str, str]) -> bytes:
        """Lambda's Invoke: the handler's result, or its error as Lambda names an unhandled one."""
        raw = body.decode() if isinstance(body, bytes) else body
        try:
            return json.dumps(self.call(self.catalog_name(function), json.loads(raw or "{}"))).encode()
        except Exception as error:
            response_headers["x-amz-function-error"] = "Unhandled"
            return json.dumps(
                {
                    "errorMessage": str(error),
                    "errorType": type(error).__name__,
                    "stackTrace": traceback.format_tb(error.__traceback__),
                }
            ).encode()

    def serve(self, patches: contextlib.ExitStack) -> None:
        """moto's Lambda invokes (Step Functions' tasks included) run the handlers here until `patches` closes."""
        from moto.awslambda_simple.models import LambdaSimpleBackend

        def invoke(backend: Any, function_name: str, *args: Any) -> bytes:
            _qualifier, body, _headers, response_headers = args
            return self.invoke(function_name, body, response_headers)

        wrap(patches, LambdaSimpleBackend, "invoke", lambda _original: invoke)


class TooManyRequests(Exception):
    """Lambda refused an invocation: the account's concurrency is all in use (429 TooManyRequestsException)."""


@dataclass(frozen=True)
class AsyncRetries:
    """How Lambda's event queue retries an asynchronous invocation (AWS Lambda Developer Guide, "How Lambda handles
    errors and retries with asynchronous invocation"): a throttled one goes back to the queue and is tried again,
    1 s later at first, the interval doubling up to 5 minutes, for up to 6 hours (the maximum event age); a function
    error is retried twice, 1 minute then 2 minutes later. `scaled(f)` multiplies every wait (a test's minutes)."""

    throttle_first_s: float = 1.0
    throttle_max_s: float = 300.0
    max_age_s: float = 6 * 3600.0
    error_waits_s: tuple[float, ...] = (60.0, 120.0)

    def scaled(self, factor: float) -> AsyncRetries:
        if factor <= 0:
            raise ValueError(f"a scale factor must be positive, not {factor}")
        return dataclasses.replace(
            self,
            throttle_first_s=self.throttle_first_s * factor,
            throttle_max_s=self.throttle_max_s * factor,
            max_age_s=self.max_age_s * factor,
            error_waits_s=tuple(wait * factor for wait in self.error_waits_s),
        )


class EventQueue:
    """Lambda's asynchronous invocation: `submit` returns at once and the event runs on a thread of its own, tried
    again as `retries` says; an event given up is kept in `dropped` (Lambda would send it to the function's
    on-failure destination). Use as a context manager: leaving waits for every event to run or be dropped."""

    def __init__(
        self,
        run: Callable[[str, Any], Any],
        retries: AsyncRetries = AsyncRetries(),
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.retries = retries
        self.dropped: list[str] = []
        self.errors_retried = 0  # function errors the queue retried
        self._run = run
        self._sleep = sleep
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> EventQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.join()

    def submit(self, function: str, payload: Any) -> None:
        thread = threading.Thread(target=self._invoke, args=(function, payload), name=f"event-{function}", daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def join(self) -> None:
        """Wait for every event submitted so far (and those their runs submit) to run or be dropped."""
        while True:
            with self._lock:
                running = [thread for thread in self._threads if thread.is_alive()]
                self._threads = running
            if not running:
                return
            for thread in running:
                thread.join()

    def _invoke(self, function: str, payload: Any) -> None:
        age, wait, errors = 0.0, self.retries.throttle_first_s, 0
        while True:
            try:
                self._run(function, payload)
                return
            except TooManyRequests:
                if age + wait > self.retries.max_age_s:
                    self._drop(f"{function}: throttled for {age:g} s, past the event's maximum age")
                    return
                self._sleep(wait)
                age, wait = age + wait, min(wait * 2, self.retries.throttle_max_s)
            except Exception as error:  # a function error: retried, then dropped
                if errors == len(self.retries.error_waits_s):
                    self._drop(f"{function}: failed {errors + 1} times, last: {type(error).__name__}: {error}")
                    return
                with self._lock:
                    self.errors_retried += 1
                self._sleep(self.retries.error_waits_s[errors])
                age, errors = age + self.retries.error_waits_s[errors], errors + 1

    def _drop(self, why: str) -> None:
        with self._lock:
            self.dropped.append(why)
