from __future__ import annotations

from collections.abc import Iterator

import pytest
from moto import mock_aws

from rehearsal.controlplane import MOTO_CONFIG, REGION, ControlPlane


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "POWERTOOLS_METRICS_NAMESPACE": "spotcr",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture
def plane(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[ControlPlane]:
    with mock_aws(config=MOTO_CONFIG), ControlPlane() as control_plane:
        yield control_plane
        # A test's monkeypatch.setenv of a setting sits on top of the plane's: undo it first, so that closing the
        # plane then restores the environment as it was (undone later, it would put the plane's values back).
        monkeypatch.undo()
