"""EFS with efs_isolation: the agent mounts its job's own access point with IAM and keeps the mount's profile fresh.

mount.efs is a recorder on PATH (the asset's, fetched at artifact build, is installed by install-artifact.sh:
test_vm_install); the mount command is recorded, not run. The credential refresh is driven by a stop event that
counts its waits: no sleeping.
"""

from __future__ import annotations

import configparser
import json
import stat
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from spotcr_agent import efs_iam, storage, store_credentials

from tests.agent.conftest import make_config

ACCESS_POINT = "fsap-0123456789abcdef0"
REGION = "eu-west-1"
URL = f"https://abcdefg.lambda-url.{REGION}.on.aws/"
EXPIRY = "2026-11-23T21:00:00Z"
EXPIRY_TS = 1_795_467_600.0  # EXPIRY as unix seconds


def _credentials(key: str, access_point: str = ACCESS_POINT) -> dict[str, str]:
    values = {"access_key": key, "secret_key": f"secret-{key}", "token": f"token-{key}", "expiry_time": EXPIRY}
    if access_point:
        values["efs_access_point_id"] = access_point
    return values


@pytest.fixture
def profile_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "root-aws" / "credentials"
    monkeypatch.setattr(efs_iam, "CREDENTIALS_FILE", path)
    return path


@pytest.fixture
def mount_helper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    helper = bin_dir / "mount.efs"
    helper.write_text("#!/bin/sh\nexit 0\n")
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return helper


def _profile(path: Path) -> Mapping[str, Mapping[str, str]]:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(path)
    return {name: dict(parser[name]) for name in parser.sections()}


def test_the_mount_goes_through_the_access_point_with_iam_and_the_jobs_profile() -> None:
    argv = efs_iam.mount_argv("fs-0123", ACCESS_POINT, Path("/mnt/spotcr"), "eu-west-1")
    assert argv == [
        "mount",
        "-t",
        "efs",
        "-o",
        f"tls,iam,accesspoint={ACCESS_POINT},awsprofile=spotcr-job-store,region=eu-west-1",
        "fs-0123:/",
        "/mnt/spotcr",
    ]


def test_prepare_mounts_the_access_point_the_store_url_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, profile_file: Path, mount_helper: Path
) -> None:
    # Given an efs job with efs_isolation, whose store-credentials URL names its access point
    mount_point = tmp_path / "mnt"
    config = make_config(
        tmp_path,
        mount_point=mount_point,
        efs_id="fs-0123",
        efs_isolation=True,
        store_credentials_url=URL,
        region=REGION,
    )
    monkeypatch.setattr(storage, "efs_credentials", lambda _config: lambda: _credentials("K1"))
    ran: list[list[str]] = []
    # When the storage is prepared
    storage.prepare(config, runner=ran.append)
    # Then the access point was mounted with IAM, signed with the profile just written (root's only)
    job_dir = mount_point / "jobs" / "job-1"
    assert ran == [efs_iam.mount_argv("fs-0123", ACCESS_POINT, job_dir, REGION)]
    assert ran[0][4].endswith(",region=eu-west-1")
    assert _profile(profile_file)["spotcr-job-store"] == {
        "aws_access_key_id": "K1",
        "aws_secret_access_key": "secret-K1",
        "aws_session_token": "token-K1",
    }
    assert stat.S_IMODE(profile_file.stat().st_mode) == 0o600


def test_without_the_mount_helper_the_storage_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, profile_file: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    config = make_config(
        tmp_path, mount_point=tmp_path / "mnt", efs_id="fs-0123", efs_isolation=True, store_credentials_url=URL
    )
    with pytest.raises(storage.StorageError, match=r"needs mount\.efs, which the agent asset.s install-artifact\.sh"):
        storage.prepare(config, runner=lambda argv: None)
    assert not profile_file.exists()


def test_an_answer_without_an_access_point_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, profile_file: Path, mount_helper: Path
) -> None:
    config = make_config(
        tmp_path, mount_point=tmp_path / "mnt", efs_id="fs-0123", efs_isolation=True, store_credentials_url=URL
    )
    monkeypatch.setattr(storage, "efs_credentials", lambda _config: lambda: _credentials("K1", access_point=""))
    ran: list[list[str]] = []
    with pytest.raises(storage.StorageError, match="named no EFS access point for job"):
        storage.prepare(config, runner=ran.append)
    assert ran == []


def test_the_store_answer_carries_the_access_point_to_the_mount() -> None:
    body = {
        "AccessKeyId": "K1",
        "SecretAccessKey": "s",
        "SessionToken": "t",
        "Expiration": EXPIRY,
        "Job": "render-42",
        "AccessPointId": ACCESS_POINT,
    }
    fetch = store_credentials.fetcher(URL, "render-42", "eu-west-1", get=lambda _: (200, json.dumps(body).encode()))
    assert fetch()["efs_access_point_id"] == ACCESS_POINT


def test_a_refresh_rewrites_the_profile_and_keeps_other_profiles(profile_file: Path) -> None:
    # Given a credentials file with the user's own profile beside the mount's
    profile_file.parent.mkdir(parents=True)
    profile_file.write_text("[default]\naws_access_key_id = mine\n")
    efs_iam.write_profile(_credentials("K1"))
    # When the profile is refreshed an hour before expiry
    wait_s = efs_iam.refresh(lambda: _credentials("K2"), now=lambda: EXPIRY_TS - 3600)
    # Then the mount's profile holds the new credentials, the user's is untouched, and the next refresh is due
    # half an hour before the new expiry
    profiles = _profile(profile_file)
    assert profiles["spotcr-job-store"]["aws_access_key_id"] == "K2"
    assert profiles["default"] == {"aws_access_key_id": "mine"}
    assert wait_s == 1800


class CountingStop(threading.Event):
    """A stop event that records each wait and is set after `limit` of them (no real waiting)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float(timeout or 0))
        return len(self.waits) >= self.limit


def test_keep_fresh_survives_a_failed_fetch_and_refreshes_before_each_expiry(profile_file: Path) -> None:
    # Given a store URL that fails once, then answers
    answers: list[Any] = [OSError("url down"), _credentials("K2"), _credentials("K3")]

    def fetch() -> dict[str, str]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return dict(answer)

    stop = CountingStop(limit=3)
    # When the keeper runs until stopped
    efs_iam.keep_fresh(fetch, stop, now=lambda: EXPIRY_TS - 3600)
    # Then it retried after a minute, then refreshed twice, each time due half an hour before expiry
    assert stop.waits == [efs_iam.RETRY_S, 1800.0, 1800.0]
    assert _profile(profile_file)["spotcr-job-store"]["aws_access_key_id"] == "K3"


def test_the_keeper_runs_only_for_isolated_efs(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    for kind, isolated in (("s3", False), ("efs", False), ("ebs", False)):
        config = make_config(tmp_path, storage=kind, bucket="b", efs_isolation=isolated)
        assert storage.keep_efs_credentials(config, stop) is None


def test_the_store_opens_only_on_the_mounted_job_directory(tmp_path: Path) -> None:
    # Given isolated EFS whose job directory is not mounted (the mount point itself may be anything)
    config = make_config(tmp_path, mount_point=tmp_path / "mnt", efs_id="fs-0123", efs_isolation=True)
    # Then the store refuses, naming the job's directory: nothing is written to the root disk
    with pytest.raises(storage.StorageError, match=f"{tmp_path / 'mnt' / 'jobs' / 'job-1'} is not mounted"):
        storage.open_store(config)
