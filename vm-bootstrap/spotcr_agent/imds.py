"""The EC2 instance metadata service (IMDSv2), the agent's view of its own VM."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from typing import Protocol

TOKEN_TTL_S = 21_600


class ImdsError(RuntimeError):
    """IMDS did not answer as expected."""


class Metadata(Protocol):
    def get(self, path: str) -> str | None: ...


class Imds:
    """IMDSv2 over HTTP: a session token, then GETs under /latest/. Missing paths (404) read as None."""

    def __init__(self, endpoint: str, timeout_s: float = 2.0) -> None:
        self._endpoint = endpoint.rstrip("/")
        self._timeout_s = timeout_s
        self._token = ""
        self._token_expires = 0.0

    def _fetch_token(self) -> str:
        if self._token and time.monotonic() < self._token_expires:
            return self._token
        request = urllib.request.Request(  # noqa: S310 (the endpoint is configuration, http by design)
            f"{self._endpoint}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:  # noqa: S310 (endpoint is config)
                self._token = response.read().decode()
        except (OSError, urllib.error.URLError) as error:
            raise ImdsError(f"IMDS token request to {self._endpoint} failed: {error}") from error
        self._token_expires = time.monotonic() + TOKEN_TTL_S - 60
        return self._token

    def get(self, path: str) -> str | None:
        url = f"{self._endpoint}/latest/{urllib.parse.quote(path, safe='/')}"
        headers = {"X-aws-ec2-metadata-token": self._fetch_token()}
        request = urllib.request.Request(url, headers=headers)  # noqa: S310 (the endpoint is configuration)
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:  # noqa: S310 (endpoint is config)
                return str(response.read().decode())
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            if error.code == 401:
                self._token = ""
            raise ImdsError(f"IMDS GET {path} failed: HTTP {error.code}") from error
        except (OSError, urllib.error.URLError) as error:
            raise ImdsError(f"IMDS GET {path} failed: {error}") from error


def require(metadata: Metadata, path: str) -> str:
    value = metadata.get(path)
    if value is None:
        raise ImdsError(f"IMDS has no {path}")
    return value.strip()


def instance_tags(metadata: Metadata) -> dict[str, str]:
    """The instance's tags (needs 'instance metadata tags' enabled on the instance)."""
    listing = metadata.get("meta-data/tags/instance")
    if listing is None:
        raise ImdsError("IMDS has no meta-data/tags/instance: enable instance metadata tags (InstanceMetadataTags)")
    tags: dict[str, str] = {}
    for key in filter(None, (line.strip() for line in listing.splitlines())):
        value = metadata.get(f"meta-data/tags/instance/{key}")
        if value is not None:
            tags[key] = value
    return tags


def spot_instance_action(metadata: Metadata) -> str | None:
    """The pending spot interruption (JSON text), or None while there is none."""
    return metadata.get("meta-data/spot/instance-action")


def reclaim_time(action: str | None) -> float | None:
    """The unix time EC2 reclaims the instance, from a spot/instance-action ({"action": "terminate", "time":
    "2017-09-18T08:22:00Z"}); None without one, or when it names no time this can read."""
    if not action:
        return None
    try:
        when = json.loads(action).get("time")
        return datetime.fromisoformat(str(when).replace("Z", "+00:00")).timestamp() if when else None
    except (ValueError, AttributeError):
        return None
