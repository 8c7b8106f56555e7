"""What moto's Step Functions lacks: SendTaskFailure keeps its `cause` (moto 5 drops it; notifications read it), and
a Task state that names a Lambda function fails with Lambda's own error when Lambda refuses the invoke
(`Lambda.TooManyRequestsException` for a throttle, as Step Functions names it; moto 5 says `Exception`). And what it
costs that AWS does not: a definition parsed once, not at every execution's start."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

from rehearsal.localaws import wrap


def keep_failure_cause(patches: contextlib.ExitStack) -> None:
    from moto.core.responses import EmptyResult
    from moto.stepfunctions.responses import StepFunctionResponse

    def send_task_failure(response: Any) -> Any:
        response.stepfunction_backend.send_task_failure(
            response._get_param("taskToken"), error=response._get_param("error"), cause=response._get_param("cause")
        )
        return EmptyResult()

    wrap(patches, StepFunctionResponse, "send_task_failure", lambda _original: send_task_failure)


def lambda_errors_named(patches: contextlib.ExitStack) -> None:
    from botocore.exceptions import ClientError
    from moto.stepfunctions.parser.api import HistoryEventType, LambdaFunctionFailedEventDetails
    from moto.stepfunctions.parser.asl.component.common.error_name.custom_error_name import CustomErrorName
    from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import FailureEvent
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_lambda import (
        StateTaskServiceLambda,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.state_task_lambda import StateTaskLambda
    from moto.stepfunctions.parser.asl.eval.event.event_detail import EventDetails

    def from_error(original: Any) -> Any:
        def named(state: Any, env: Any, ex: Exception) -> Any:
            if not isinstance(ex, ClientError):
                return original(state, env, ex)
            error, cause = StateTaskServiceLambda._error_cause_from_client_error(ex)
            return FailureEvent(
                env=env,
                error_name=CustomErrorName(error),
                event_type=HistoryEventType.LambdaFunctionFailed,
                event_details=EventDetails(  # type: ignore[typeddict-item]  # a TypedDict of optional keys, as moto's
                    lambdaFunctionFailedEventDetails=LambdaFunctionFailedEventDetails(error=error, cause=cause)
                ),
            )

        return named

    wrap(patches, StateTaskLambda, "_from_error", from_error)


def parse_once(patches: contextlib.ExitStack) -> None:
    """What moto's Step Functions does again and again in the caller's process, where AWS spends none of the
    account's CPU, done once: an execution's start parses its state machine's definition (moto's ANTLR parser: 0.1
    to 0.3 s of CPU for the recovery workflow here), each JSONPath is parsed at each use (jsonpath_ng builds its
    parser tables every time), and each Lambda task makes a new boto3 client. A wave of 100 warnings started 100
    parses within its first seconds, on the cores the handlers answering those warnings need. The parsed program
    is kept per definition (what one execution changes lives in its own Environment), a parsed path per path, and
    one client per Region and service."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_task import lambda_eval_utils
    from moto.stepfunctions.parser.asl.parse.asl_parser import AmazonStateLanguageParser
    from moto.stepfunctions.parser.asl.utils import json_path
    from moto.stepfunctions.parser.backend.execution_worker import ExecutionWorker

    programs: dict[str, Any] = {}
    parsing = threading.Lock()  # executions started together wait for the one parse

    def entrypoint(worker: Any) -> Any:
        definition = worker._evaluation_details.state_machine_details.definition
        with parsing:
            if definition not in programs:
                programs[definition] = AmazonStateLanguageParser.parse(definition)[0]
            return programs[definition]

    wrap(patches, ExecutionWorker, "_get_evaluation_entrypoint", lambda _original: entrypoint)
    wrap(patches, json_path, "parse", functools.lru_cache(maxsize=1024))

    def one_client(original: Any) -> Any:
        clients: dict[tuple[str, str], Any] = {}

        def client_for(region: str, service: str, state_credentials: Any = None) -> Any:
            # moto makes every client with the same fixed keys whatever the credentials: one per Region and service
            if (region, service) not in clients:
                clients[(region, service)] = original(region, service, state_credentials)
            return clients[(region, service)]

        return client_for

    wrap(patches, lambda_eval_utils, "boto_client_for", one_client)
