"""What moto's Step Functions lacks: SendTaskFailure keeps its `cause` (moto 5 drops it; notifications read it)."""

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
