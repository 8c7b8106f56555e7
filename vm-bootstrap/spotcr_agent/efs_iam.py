"""EFS mounted through the job's own access point with IAM, signed with the job's vended store credentials.

amazon-efs-utils' mount.efs (`-o tls,iam,accesspoint=fsap-...,awsprofile=NAME`) reads the named profile from
/root/.aws/credentials when it mounts; its watchdog reads it again each time it renews the TLS client certificate,
which carries the signed credentials (tls_cert_renewal_interval_min, 60 by default: efs-utils dist/efs-utils.conf
and watchdog's get_aws_security_credentials, "credentials:<profile>"). A vended session lasts at most an hour (role
chaining), so the agent rewrites the profile well before each expiry, for as long as it runs.
"""

from __future__ import annotations

import configparser
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROFILE = "spotcr-job-store"
CREDENTIALS_FILE = Path("/root/.aws/credentials")
REFRESH_BEFORE_S = 30 * 60.0  # a renewal at any moment reads credentials valid for half an hour at least
RETRY_S = 60.0
MOUNT_HELPER = "mount.efs"

Fetch = Callable[[], Mapping[str, Any]]


def mount_argv(
    efs_id: str, access_point_id: str, mount_point: Path, region: str = "", profile: str = PROFILE
) -> list[str]:
    """The mount through the access point only: TLS (required for IAM), IAM with the profile's credentials, and the
    region named (the profile has none, and mount.efs would otherwise ask IMDS or its config file)."""
    options = f"tls,iam,accesspoint={access_point_id},awsprofile={profile}" + (f",region={region}" if region else "")
    return ["mount", "-t", "efs", "-o", options, f"{efs_id}:/", str(mount_point)]


def write_profile(credentials: Mapping[str, Any], path: Path | None = None, profile: str = PROFILE) -> None:
    """Replace the profile's credentials (others in the file are kept); the file is root's only (0600)."""
    path = path or CREDENTIALS_FILE
    parser = configparser.ConfigParser(interpolation=None)
    if path.exists():
        parser.read(path)
    parser[profile] = {
        "aws_access_key_id": str(credentials["access_key"]),
        "aws_secret_access_key": str(credentials["secret_key"]),
        "aws_session_token": str(credentials["token"]),
    }
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        parser.write(handle)
    os.replace(temporary, path)


def refresh(fetch: Fetch, path: Path | None = None, now: Callable[[], float] = time.time) -> float:
    """Write fresh credentials to the profile; the seconds until the next refresh is due."""
    credentials = fetch()
    write_profile(credentials, path)
    expiry = datetime.fromisoformat(str(credentials["expiry_time"]).replace("Z", "+00:00")).timestamp()
    log.info("efs: profile %s refreshed; its credentials expire at %s", PROFILE, credentials["expiry_time"])
    return max(RETRY_S, expiry - now() - REFRESH_BEFORE_S)


def keep_fresh(
    fetch: Fetch, stop: threading.Event, path: Path | None = None, now: Callable[[], float] = time.time
) -> None:
    """Refresh the profile before each expiry until `stop` is set; a failed refresh is tried again in a minute."""
    while True:
        try:
            wait_s = refresh(fetch, path, now)
        except Exception as error:  # kept alive: the mount must not lose its credentials
            log.warning("efs: refreshing the mount's credentials failed (%s); trying again in %.0f s", error, RETRY_S)
            wait_s = RETRY_S
        if stop.wait(wait_s):
            return


def start(fetch: Fetch, stop: threading.Event, path: Path | None = None) -> threading.Thread:
    thread = threading.Thread(target=keep_fresh, args=(fetch, stop, path), name="efs-credentials", daemon=True)
    thread.start()
    return thread
