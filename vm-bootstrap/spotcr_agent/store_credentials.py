"""The agent's S3 credentials for its own run's prefix, fetched from the store-credentials function URL.

With private subnets the same function answers behind a private API Gateway API (an `execute-api` address, reached
through the stack's VPC endpoint). The request is signed (SigV4, service `lambda` for a function URL, `execute-api`
for the API) with the instance role's own credentials; the answer is a session of the store role limited to its run,
jobs/<job>/runs/<run>/ (and what the run must touch of its job), valid for at most an hour (role chaining).
botocore refreshes it before it expires (RefreshableCredentials): 15 minutes ahead when it can, 10 minutes ahead
at the latest.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

METHOD = "spotcr-store-credentials"
WAIT_S = 300.0  # a new primary may ask before the control plane registered it (it registers on "running")
RETRY_S = (1.0, 2.0, 4.0, 8.0, 15.0)
ENDED_STATUS = 410  # the job has ended: the function never grants its store again, so asking again is pointless

Fetch = Callable[[], Mapping[str, Any]]


class StoreCredentialsError(RuntimeError):
    """The store-credentials URL did not grant credentials; the message carries its reason."""


def request_url(url: str, job_id: str) -> str:
    return f"{url.rstrip('/')}/?{urllib.parse.urlencode({'job': job_id})}"


def signing_service(url: str) -> str:
    """The SigV4 service of the store-credentials address: API Gateway's for an execute-api host, else Lambda's."""
    host = urllib.parse.urlsplit(url).hostname or ""
    return "execute-api" if ".execute-api." in f".{host}" else "lambda"


def signed_get(url: str, region: str, signer: Any = None, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """GET the URL signed with the default credential chain (on a VM: the instance role from IMDS)."""
    import botocore.session
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest

    credentials = signer or botocore.session.Session().get_credentials()
    if credentials is None:
        raise StoreCredentialsError("no AWS credentials to sign the store-credentials request with")
    request = AWSRequest(method="GET", url=url)
    SigV4Auth(credentials.get_frozen_credentials(), signing_service(url), region).add_auth(request)
    prepared = urllib.request.Request(url, headers=dict(request.headers.items()), method="GET")  # noqa: S310
    try:
        with urllib.request.urlopen(prepared, timeout=timeout_s) as response:  # noqa: S310 (https function URL)
            return int(response.status), response.read()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read()


def fetcher(
    url: str,
    job_id: str,
    region: str,
    *,
    get: Callable[[str], tuple[int, bytes]] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    wait_s: float = WAIT_S,
) -> Fetch:
    """A function returning fresh credentials in botocore's metadata form; refusals are retried up to wait_s,
    except the answer that the job has ended, which is final."""
    target = request_url(url, job_id)
    do_get = get or (lambda address: signed_get(address, region))

    def fetch() -> Mapping[str, Any]:
        waited = 0.0
        attempt = 0
        while True:
            try:
                status, body = do_get(target)
                reason = _reason(body)
            except OSError as error:
                status, reason = 0, f"{type(error).__name__}: {error}"
            if status == 200:
                metadata = _metadata(body, job_id)
                log.info("store credentials for a run of jobs/%s/ until %s", job_id, metadata["expiry_time"])
                return metadata
            pause = RETRY_S[min(attempt, len(RETRY_S) - 1)]
            if status == ENDED_STATUS or waited + pause > wait_s:
                raise StoreCredentialsError(f"store credentials for job {job_id} refused ({status}): {reason}")
            log.warning("store credentials not granted yet (%s: %s); asking again in %.0f s", status, reason, pause)
            sleep(pause)
            waited += pause
            attempt += 1

    return fetch


def _reason(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error", ""))[:300]
    except (ValueError, AttributeError):
        return body[:300].decode(errors="replace")


def _metadata(body: bytes, job_id: str) -> dict[str, str]:
    try:
        data = json.loads(body)
        metadata = {
            "access_key": data["AccessKeyId"],
            "secret_key": data["SecretAccessKey"],
            "token": data["SessionToken"],
            "expiry_time": data["Expiration"],
        }
    except (ValueError, KeyError, TypeError) as error:
        raise StoreCredentialsError(f"store credentials for job {job_id}: malformed answer ({error})") from error
    if data.get("Job") != job_id:
        raise StoreCredentialsError(f"store credentials answered for job {data.get('Job')!r}, not {job_id!r}")
    if data.get("AccessPointId"):
        metadata["efs_access_point_id"] = str(data["AccessPointId"])  # the job's own EFS access point (efs storage)
    if data.get("Nodes"):
        # A job over several VMs: every node's address, this node's index, the run's launch key (its agents' port).
        metadata["nodes"] = ",".join(str(address) for address in data["Nodes"])
        metadata["node_index"] = str(data.get("Node", ""))
        metadata["launch_key"] = str(data.get("LaunchKey", ""))
    return metadata


def session(fetch: Fetch, region: str | None = None) -> Any:
    """A boto3 session whose credentials come from `fetch` and are refreshed before they expire."""
    import boto3
    import botocore.session
    from botocore.credentials import CredentialProvider, RefreshableCredentials

    class _Provider(CredentialProvider):
        METHOD = METHOD
        CANONICAL_NAME = METHOD

        def load(self) -> RefreshableCredentials:
            return RefreshableCredentials.create_from_metadata(metadata=fetch(), refresh_using=fetch, method=METHOD)

    core = botocore.session.Session()
    core.get_component("credential_provider").insert_before("env", _Provider())
    return boto3.session.Session(botocore_session=core, region_name=region or None)
