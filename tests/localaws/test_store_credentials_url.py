"""The store-credentials address authenticates and authorizes as AWS does, with the template's own grants.

A job VM signs its request (SigV4) with its instance-profile session; the function URL (AuthType AWS_IAM) answers
only when the signature holds and the session may lambda:InvokeFunctionUrl and lambda:InvokeFunction (via the URL).
With private subnets the private API answers only callers its resource policy or their own policies allow.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from rehearsal import store_credentials
from rehearsal.iam import enforce, principals
from rehearsal.iam.policy import Principal

ACCOUNT, REGION = "123456789012", "us-east-1"
INSTANCE = "i-0123456789abcdef0"
KEY, SECRET = enforce.access_key(f"instance:{INSTANCE}"), "instance-secret"


def local() -> principals.Local:
    return principals.Local(REGION, ACCOUNT)


def job_session(context: dict[str, str] | None = None) -> Principal:
    roles = principals.stack_roles(local(), principals.template(context))
    return Principal(f"arn:aws:sts::{ACCOUNT}:assumed-role/VmLaunchJobRole/{INSTANCE}", roles.job.policies)


class Address:
    """The stand-in on loopback, serving a handler that records the events it is given."""

    def __init__(self, context: dict[str, str] | None, session: Principal) -> None:
        self.enforcer = enforce.Enforcer(keys={}, trusted={}, roles={}, state=enforce.MotoState(ACCOUNT, REGION))
        self.enforcer.add_key(
            KEY, session, {"ec2:SourceInstanceARN": f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/x"}, SECRET
        )
        self.store = principals.store_credentials_address(local(), principals.template(context))
        self.events: list[dict[str, Any]] = []
        self.server = store_credentials.serve(
            "127.0.0.1",
            account=ACCOUNT,
            region=REGION,
            store=self.store,
            enforcer=self.enforcer,
            handler=self.handle,
        )
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/?job=render-42"

    def handle(self, event: dict[str, Any]) -> dict[str, Any]:
        self.events.append(event)
        return {"statusCode": 200, "body": json.dumps({"Job": "render-42"})}

    def get(self, key: str | None = KEY, secret: str = SECRET, service: str | None = None) -> tuple[int, str]:
        headers: dict[str, str] = {}
        if key is not None:
            request = AWSRequest(method="GET", url=self.url)
            SigV4Auth(Credentials(key, secret), service or self.store.signing_service, REGION).add_auth(request)
            headers = dict(request.headers.items())
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url, headers=headers)) as response:
                return int(response.status), response.read().decode()
        except urllib.error.HTTPError as error:
            return int(error.code), error.read().decode()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def url() -> Iterator[Address]:
    address = Address(None, job_session())
    yield address
    address.close()


def test_a_job_vms_signed_request_reaches_the_function_naming_its_session(url: Address) -> None:
    # When a job VM signs its request with its instance-profile session
    status, _ = url.get()
    # Then the function runs with the caller Lambda names: the session, by the key that signed
    assert status == 200
    (event,) = url.events
    assert event["requestContext"]["authorizer"]["iam"]["userArn"] == job_session().arn
    assert event["queryStringParameters"] == {"job": "render-42"}
    assert url.enforcer.denials == []


@pytest.mark.parametrize(
    "request_kind, message",
    [
        ("unsigned", store_credentials.FORBIDDEN),
        ("signed with another secret", store_credentials.BAD_SIGNATURE),
        ("signed with a key no one holds", store_credentials.INVALID_TOKEN),
        ("signed for another service", "scoped to correct service"),
    ],
)
def test_a_request_aws_cannot_authenticate_is_refused_before_the_function_runs(
    url: Address, request_kind: str, message: str
) -> None:
    key, secret, service = {
        "unsigned": (None, SECRET, None),
        "signed with another secret": (KEY, "forged", None),
        "signed with a key no one holds": (enforce.access_key("instance:i-0forged"), SECRET, None),
        "signed for another service": (KEY, SECRET, "execute-api"),
    }[request_kind]
    status, body = url.get(key, secret, service)
    assert (status, url.events) == (403, [])
    assert message in json.loads(body)["Message"]


@pytest.mark.parametrize("grant", ["lambda:InvokeFunctionUrl", "lambda:InvokeFunction"])
def test_a_job_role_without_the_url_grant_is_refused_as_lambda_refuses(grant: str) -> None:
    # Given the job role with one of the two grants a function URL call needs taken out
    address = Address(None, principals.without_grant(job_session(), grant))
    try:
        status, body = address.get()
    finally:
        address.close()
    # Then Lambda's 403, the function never ran, and the denial names what was missing
    assert (status, json.loads(body), address.events) == (403, {"Message": "Forbidden"}, [])
    (denial,) = address.enforcer.denials
    assert grant in denial.reason and "implicit deny" in denial.reason


def test_the_private_api_answers_the_job_role_its_resource_policy_names_and_no_other_role() -> None:
    # Given the stack with private subnets: the store credentials behind a private API (execute-api)
    context = {"private_subnets": "true"}
    address = Address(context, job_session(context))
    other = Principal(f"arn:aws:sts::{ACCOUNT}:assumed-role/SomeOtherRole/{INSTANCE}", ())
    try:
        assert address.store.signing_service == "execute-api"
        # When the job VM signs for execute-api, it is answered as API Gateway's proxy event names it
        status, _ = address.get()
        assert status == 200
        assert address.events[0]["requestContext"]["identity"]["userArn"] == job_session(context).arn
        # And a session of another role, signing just as well, is refused: the API's policy names the job role
        address.enforcer.add_key(KEY, other, secret=SECRET)
        status, _ = address.get()
    finally:
        address.close()
    assert status == 403 and len(address.events) == 1
    assert "execute-api:Invoke" in address.enforcer.denials[-1].reason
