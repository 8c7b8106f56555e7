"""The handler tests run on the same moto control plane as the workflow tests."""

from typing import Any

import pytest
from spotcr_functions.cloud import Cloud
from spotcr_functions.config import ENV

from rehearsal.controlplane import ControlPlane
from tests.functions.support import JOB_ROLE, STORE_ROLE_ARN
from tests.workflow.conftest import aws_env, plane

__all__ = ["aws_env", "plane"]


@pytest.fixture
def vending(plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The stack's settings for store-credentials; returns the AssumeRole requests the function makes."""
    monkeypatch.setenv(ENV["store_role_arn"], STORE_ROLE_ARN)
    monkeypatch.setenv(ENV["job_role_name"], JOB_ROLE)
    calls: list[dict[str, Any]] = []
    original = Cloud.assume_store_role

    def recorded(self: Cloud, **kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        return original(self, **kwargs)

    monkeypatch.setattr(Cloud, "assume_store_role", recorded)
    return calls
