"""What moto's Step Functions lacks: SendTaskFailure keeps its `cause` (moto 5 drops it; notifications read it), and
a Task state that names a Lambda function fails with Lambda's own error when Lambda refuses the invoke
(`Lambda.TooManyRequestsException` for a throttle, as Step Functions names it; moto 5 says `Exception`)."""

from __future__ import annotations

import contextlib
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
