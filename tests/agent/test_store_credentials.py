"""The agent's store credentials: fetched signed from the store-credentials URL, used by the S3 store, refreshed."""

from __future__ import annotations

import dataclasses
import json
import threading
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import boto3
import pytest
from botocore.credentials import Credentials
from moto import mock_aws
from spotcr_agent import storage, store_credentials
from spotcr_agent.config import AgentConfig
from spotcr_agent.store import CheckpointStore, StoreUnavailable

from rehearsal import store_credentials as function_url
from rehearsal.iam import enforce, principals
from rehearsal.iam.policy import Principal
from tests.localaws.vended import Enforced, enforced

JOB, RUN = "render-42", "r-00000000000000a1"
URL = "https://abcdefg.lambda-url.us-east-1.on.aws/"


def _answer(key: str, expires_in: timedelta, job: str = JOB, secret: str = "", token: str = "") -> bytes:
    expiry = (datetime.now(UTC) + expires_in).isoformat().replace("+00:00", "Z")
    return json.dumps(
        {
            "AccessKeyId": key,
            "SecretAccessKey": secret or f"secret-{key}",
            "SessionToken": token or f"token-{key}",
            "Expiration": expiry,
            "Job": job,
            "Prefix": f"jobs/{job}/",
        }
    ).encode()


class Url:
    """The function URL as the agent sees it: a queue of (status, body) answers, and the requests it got."""

    def __init__(self, *answers: tuple[int, bytes]) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []
        self.slept: list[float] = []

    def get(self, url: str) -> tuple[int, bytes]:
        self.asked.append(url)
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def fetcher(self, wait_s: float = 60.0) -> store_credentials.Fetch:
        return store_credentials.fetcher(URL, JOB, "us-east-1", get=self.get, sleep=self.slept.append, wait_s=wait_s)


def test_a_new_primary_asks_again_until_it_is_registered() -> None:
    # Given a URL that does not know the job yet (404), then grants it
    url = Url((404, b'{"error": "unknown job render-42"}'), (200, _answer("AKIDFIRST", timedelta(hours=1))))
    # When the agent fetches
    metadata = url.fetcher()()
    # Then it waited once and got the job's credentials, asking for its own job by name
    assert metadata["access_key"] == "AKIDFIRST"
    assert url.slept == [1.0]
    assert url.asked == [f"{URL}?job={JOB}"] * 2


def test_a_refusal_that_lasts_names_the_reason() -> None:
    url = Url((403, b'{"error": "instance i-0123 is not running job render-42"}'))
    with pytest.raises(store_credentials.StoreCredentialsError, match=r"refused \(403\): instance i-0123 is not"):
        url.fetcher(wait_s=10.0)()
    assert sum(url.slept) <= 10.0


def test_the_answer_that_the_job_ended_is_final_never_waited_on() -> None:
    # Given a URL that answers the job ended (as it does to a status command sent after the end)
    url = Url((410, b'{"error": "job render-42 has ended (COMPLETED); its store is read by users, not VMs"}'))
    # When the agent fetches, with the 5 minutes a new primary may wait for its registration
    with pytest.raises(store_credentials.StoreCredentialsError, match=r"refused \(410\): job render-42 has ended"):
        url.fetcher(wait_s=store_credentials.WAIT_S)()
    # Then it asked once and never waited
    assert (len(url.asked), url.slept) == (1, [])


@pytest.mark.parametrize(
    "body",
    [b"not json", b"{}", _answer("AKIDOTHER", timedelta(hours=1), job="someone-else")],
    ids=["not-json", "empty", "another-job"],
)
def test_an_answer_that_is_not_this_jobs_credentials_is_an_error(body: bytes) -> None:
    with pytest.raises(store_credentials.StoreCredentialsError, match=JOB):
        Url((200, body)).fetcher()()


def test_credentials_are_refreshed_before_they_expire() -> None:
    # Given an answer expiring within botocore's mandatory refresh window (10 minutes), then a fresh one
    url = Url((200, _answer("AKIDSHORT", timedelta(minutes=5))), (200, _answer("AKIDFRESH", timedelta(hours=1))))
    credentials = store_credentials.session(url.fetcher()).get_credentials()
    # When the session's credentials are used
    frozen = credentials.get_frozen_credentials()
    # Then they were fetched again before use, and are not fetched while fresh
    assert frozen.access_key == "AKIDFRESH"
    assert credentials.method == store_credentials.METHOD
    assert len(url.asked) == 2
    assert credentials.get_frozen_credentials().access_key == "AKIDFRESH"
    assert len(url.asked) == 2


@pytest.fixture
def moto_s3(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "instance-role")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "instance-role")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="spotcr-checkpoints")
        yield


def _vended_store(world: Enforced, job: str, run: str) -> tuple[CheckpointStore, str]:
    """The agent's S3 store of JOB, the URL answering with a session vended for (job, run); its access key."""
    vended = world.store_session(job, run).get_credentials()
    url = Url((200, _answer(vended.access_key, timedelta(hours=1), secret=vended.secret_key, token=vended.token)))
    session = store_credentials.session(url.fetcher(), "us-east-1")
    store = CheckpointStore.for_s3("spotcr-checkpoints", JOB, region="us-east-1", session=session, run_id=RUN)
    return store, vended.access_key


def test_the_s3_store_signs_with_the_vended_credentials_not_the_instance_role(moto_s3: None) -> None:
    # Given a store opened with the vended session, IAM enforced (the VM's own key, "instance-role", has no grant)
    with enforced("spotcr-checkpoints") as world:
        store, vended = _vended_store(world, JOB, RUN)
        signed_with: list[str] = []
        store.backend.client.meta.events.register(  # type: ignore[attr-defined]
            "before-send.s3", lambda request, **_: signed_with.append(request.headers["Authorization"].decode())
        )
        # When it checks the store and writes an object of its run
        store.check()
        store.backend.put(f"jobs/{JOB}/runs/{RUN}/probe", b"x")
    # Then every request was signed with the vended key, IAM allowed each, and the check listed only the job's prefix
    assert signed_with and all(f"Credential={vended}/" in header for header in signed_with)
    assert world.enforcer.denials == []
    assert store.backend.scope == f"jobs/{JOB}/"  # type: ignore[attr-defined]


def test_credentials_vended_for_another_job_cannot_write_this_jobs_store(moto_s3: None) -> None:
    # Given a store of this job whose URL answered with another job's vended session
    with enforced("spotcr-checkpoints") as world:
        store, _ = _vended_store(world, "render-other", RUN)
        # When it writes an object of this job, then S3 refuses it, as IAM denies the vended session
        with pytest.raises(StoreUnavailable, match="AccessDenied"):
            store.backend.put(f"jobs/{JOB}/runs/{RUN}/probe", b"x")
    assert "s3:PutObject" in world.enforcer.denials[-1].reason


def test_the_agent_uses_vended_credentials_when_its_config_names_the_url(moto_s3: None) -> None:
    config = AgentConfig(job_id=JOB, instance_id="i-0123456789abcdef0", storage="s3", generation=0, bucket="b")
    assert storage.store_session(config) is None  # no URL: the AWS environment's credentials (an agent run by hand)
    with_url = dataclasses.replace(config, store_credentials_url=URL)
    assert storage.store_session(with_url) is storage.store_session(with_url)  # one session (and fetch) per job


def _signed_request(address: str, host: str) -> dict[str, str]:
    """What a local server saw of the agent's signed GET to address, sent as if to host (the name it signs)."""
    seen: dict[str, str] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.update({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
            body = _answer("AKIDSIGNED", timedelta(hours=1))
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            del format, args

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    original = store_credentials.urllib.request.urlopen

    def to_local(request: Any, timeout: float) -> Any:
        # The signed request, sent to the local server instead of its AWS host
        request.full_url = request.full_url.replace(f"https://{host}", f"http://127.0.0.1:{port}")
        return original(request, timeout=timeout)

    try:
        signer = Credentials("ASIAINSTANCEROLE", "secret", "instance-token")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(store_credentials.urllib.request, "urlopen", to_local)
            status, _ = store_credentials.signed_get(address, "us-east-1", signer=signer)
    finally:
        server.shutdown()
        server.server_close()
    assert status == 200
    return seen


def test_the_request_to_a_function_url_is_signed_with_sigv4_for_lambda() -> None:
    # When the agent asks the function URL with its instance role's credentials
    seen = _signed_request(f"{URL}?job={JOB}", "abcdefg.lambda-url.us-east-1.on.aws")
    # Then the request carries a SigV4 signature for the lambda service, with the session token
    assert seen["path"] == f"/?job={JOB}"
    assert seen["authorization"].startswith("AWS4-HMAC-SHA256 Credential=ASIAINSTANCEROLE/")
    assert "/us-east-1/lambda/aws4_request" in seen["authorization"]
    assert seen["x-amz-security-token"] == "instance-token"


def test_the_request_to_the_private_api_is_signed_with_sigv4_for_execute_api() -> None:
    # Given the private API's address (private subnets), as the stack's output names it
    host = "a1b2c3d4e5.execute-api.us-east-1.amazonaws.com"
    # When the agent asks it
    seen = _signed_request(f"https://{host}/prod/?job={JOB}", host)
    # Then the signature is API Gateway's (a lambda signature would be refused there), for the stage's path
    assert seen["path"] == f"/prod/?job={JOB}"
    assert "/us-east-1/execute-api/aws4_request" in seen["authorization"]


@pytest.mark.parametrize("grant", [None, "lambda:InvokeFunctionUrl"])
def test_the_agents_signed_request_passes_aws_authentication_only_with_the_job_roles_grant(grant: str | None) -> None:
    # Given the function URL as AWS authorizes it (rehearsal/store_credentials.py), the job role from the template,
    # and a job VM's instance-profile session, with or without the URL grant
    account, region, instance = "123456789012", "us-east-1", "i-0123456789abcdef0"
    local = principals.Local(region, account)
    job = Principal(
        f"arn:aws:sts::{account}:assumed-role/VmLaunchJobRole/{instance}",
        principals.stack_roles(local, principals.template()).job.policies,
    )
    key = enforce.access_key(f"instance:{instance}")
    enforcer = enforce.Enforcer(keys={}, trusted={}, roles={}, state=enforce.MotoState(account, region))
    enforcer.add_key(key, principals.without_grant(job, grant) if grant else job, secret="instance-secret")
    callers: list[str] = []

    def handler(event: dict[str, Any]) -> dict[str, Any]:
        callers.append(event["requestContext"]["authorizer"]["iam"]["userArn"])
        return {"statusCode": 200, "body": _answer("AKIDVENDED", timedelta(hours=1)).decode()}

    store = principals.store_credentials_address(local, principals.template())
    server = function_url.serve(
        "127.0.0.1", account=account, region=region, store=store, enforcer=enforcer, handler=handler
    )
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    signer = Credentials(key, "instance-secret")
    fetch = store_credentials.fetcher(
        url, JOB, region, get=lambda address: store_credentials.signed_get(address, region, signer=signer), wait_s=0
    )
    try:
        # When the agent asks for its job's store credentials, signing as it does on a VM
        if grant is None:
            # Then AWS authenticates its signature and names its session to the function
            assert fetch()["access_key"] == "AKIDVENDED" and callers == [job.arn]
        else:
            # Then without the grant Lambda refuses it before the function runs
            with pytest.raises(store_credentials.StoreCredentialsError, match=r"refused \(403\)"):
                fetch()
            assert callers == [] and grant in enforcer.denials[-1].reason
    finally:
        server.shutdown()
        server.server_close()
