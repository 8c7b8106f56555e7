"""A throttle that outlasts a function's SDK retries leaves it by the name the state machine retries."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError
from spotcr_functions.cloud import Throttled
from spotcr_functions.handlers import _edge


def _refused(code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "no"}, "ResponseMetadata": {"HTTPStatusCode": 400}}, "Op")


@pytest.mark.parametrize(
    "code", ["RequestLimitExceeded", "ThrottlingException", "ProvisionedThroughputExceededException"]
)
def test_a_throttle_leaves_a_step_as_throttled(code: str) -> None:
    @_edge.throttles_named
    def step(event: dict[str, Any], context: Any) -> dict[str, Any]:
        raise _refused(code)

    with pytest.raises(Throttled) as raised:
        step({}, None)
    assert type(raised.value).__name__ == "Throttled"  # Lambda's errorType, which the ASL's Retry names
    assert isinstance(raised.value.__cause__, ClientError)


def test_any_other_client_error_leaves_unchanged() -> None:
    @_edge.throttles_named
    def step(event: dict[str, Any], context: Any) -> dict[str, Any]:
        raise _refused("InvalidInstanceID.NotFound")

    with pytest.raises(ClientError):
        step({}, None)
