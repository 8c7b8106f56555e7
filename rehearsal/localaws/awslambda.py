"""Lambda: invoking one of the stack's functions runs its catalog handler in this process, as the Lambda runtime
would, with its AWS calls signed as the function's role (enforced by rehearsal/iam/enforce.py)."""

from __future__ import annotations

import contextlib
import importlib
import json
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Any

from spotcr_functions import catalog

from rehearsal.iam import enforce
from rehearsal.localaws import ACCOUNT, REGION, wrap


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
