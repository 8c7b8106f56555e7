"""The store-credentials function: who gets S3 credentials for which job, and what the session may touch.

Events are AWS's published function URL request (tests/events/function-url/) and, with private subnets, its
published API Gateway REST proxy request (tests/events/api-gateway/), with the caller an instance profile session
of the job role, as AWS names it: arn:aws:sts::<account>:assumed-role/<role>/<instance id>.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import boto3
import pytest
from spotcr_contracts import tags as tag_names
from spotcr_functions import store_access
from spotcr_functions.models import Status

from rehearsal.controlplane import ACCOUNT, EVENTS, REGION, ControlPlane, ec2_event, invoke_function, route
from tests.functions.support import BUCKET, JOB_ROLE, SAMPLE, STORE_ROLE_ARN, answer, instance_session, request

API_SAMPLE = json.loads((EVENTS / "api-gateway" / "rest-request-aws-iam.json").read_text())


def api_request(job: str | None, user_arn: str | None) -> dict[str, Any]:
    """The private API's request: API Gateway names the AWS_IAM caller in requestContext.identity."""
    event = copy.deepcopy(API_SAMPLE)
    event["queryStringParameters"] = {"job": job} if job is not None else None
    event["multiValueQueryStringParameters"] = {"job": [job]} if job is not None else None
    event["requestContext"]["identity"]["userArn"] = user_arn
    return event


def registered_job(plane: ControlPlane, job: str = "render-42") -> str:
    instance_id = plane.launch_job_instance({tag_names.JOB: job, tag_names.COMMAND: "/opt/job/run"})
    route(ec2_event("state-change-running", instance_id))
    assert plane.job(job).instance_id == instance_id
    return instance_id


def test_the_published_sample_parses_and_its_iam_user_caller_is_refused(vending: list[dict[str, Any]]) -> None:
    # Given AWS's sample request as published: the caller is an IAM user, not an instance
    status, body = answer(copy.deepcopy(SAMPLE))
    # Then it is refused, naming why, and no role is assumed
    assert status == 403
    assert body["error"] == "caller arn:aws:iam::111122223333:user/example-user is not an assumed-role session"
    assert vending == []


def test_the_instance_running_a_job_gets_credentials_for_that_job_only(
    plane: ControlPlane, vending: list[dict[str, Any]]
) -> None:
    # Given a registered job and a request signed by its instance's role session
    instance_id = registered_job(plane)
    # When its agent asks for the job's store credentials
    status, body = answer(request("render-42", instance_session(instance_id)))
    # Then it gets a session of the store role named after the instance, for its run's prefix only
    run = plane.job("render-42").run_id
    assert status == 200, body
    assert {"AccessKeyId", "SecretAccessKey", "SessionToken", "Expiration"} <= set(body)
    assert (body["Job"], body["Run"], body["Prefix"]) == ("render-42", run, f"jobs/render-42/runs/{run}/")
    [call] = vending
    assert call["role_arn"] == STORE_ROLE_ARN
    assert call["session_name"] == instance_id
    assert call["session_tags"] == {"SpotcrJob": "render-42"}
    assert call["duration_s"] == 3600  # the role-chaining limit
    assert call["policy"] == store_access.session_policy("aws", BUCKET, run)
    identity = boto3.client(
        "sts",
        region_name=REGION,
        aws_access_key_id=body["AccessKeyId"],
        aws_secret_access_key=body["SecretAccessKey"],
        aws_session_token=body["SessionToken"],
    ).get_caller_identity()
    assert identity["Arn"].endswith(f":assumed-role/spotcr-StoreRole-0F1E2D3C4B5A/{instance_id}")


def test_the_session_policy_names_the_runs_prefix_and_only_the_checkpoint_state_of_other_runs() -> None:
    policy = store_access.session_policy("aws", BUCKET, "r-0123456789abcdef")
    objects, earlier, sweep, listing = policy["Statement"]
    job = "arn:aws:s3:::spotcr-checkpoints/jobs/${aws:PrincipalTag/SpotcrJob}/"  # the session tag names the job
    assert objects == {
        "Effect": "Allow",
        "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
        "Resource": [f"{job}runs/r-0123456789abcdef/*", f"{job}criu-logs/*", f"{job}agent-logs/*"],
    }
    runs = f"{job}runs/r-????????????????/"
    # Of other runs: read and delete the checkpoint state, write only a prune's sweep marker
    assert earlier == {
        "Effect": "Allow",
        "Action": ["s3:GetObject", "s3:DeleteObject"],
        "Resource": [f"{runs}{part}/*" for part in ("checkpoints", "chunks", "commits", "sweeps")],
    }
    assert sweep == {"Effect": "Allow", "Action": "s3:PutObject", "Resource": f"{runs}sweeps/*"}
    assert listing == {
        "Effect": "Allow",
        "Action": "s3:ListBucket",
        "Resource": "arn:aws:s3:::spotcr-checkpoints",
        "Condition": {"StringLike": {"s3:prefix": "jobs/${aws:PrincipalTag/SpotcrJob}/*"}},
    }


MALFORMED_CALLERS = {
    "no IAM authorizer (AuthType NONE)": (None, "no IAM caller in the request"),
    "another role": (instance_session("i-0123456789abcdef0", role="Admin"), "is not the job VMs' role"),
    "a session not named by EC2": (instance_session("alice"), "is not an instance profile session"),
    "a federated user": (f"arn:aws:sts::{ACCOUNT}:federated-user/bob", "is not an assumed-role session"),
    "a role ARN with a path trick": (f"arn:aws:sts::{ACCOUNT}:assumed-role/{JOB_ROLE}/i-0123/x", "not an assumed"),
}


@pytest.mark.parametrize("caller", MALFORMED_CALLERS.values(), ids=MALFORMED_CALLERS.keys())
def test_callers_other_than_a_job_instance_are_refused(
    plane: ControlPlane, vending: list[dict[str, Any]], caller: tuple[str | None, str]
) -> None:
    registered_job(plane)
    user_arn, reason = caller
    status, body = answer(request("render-42", user_arn))
    assert status == 403
    assert reason in body["error"]
    assert vending == []


def test_an_unknown_job_is_refused_with_404_so_a_new_primary_asks_again(
    plane: ControlPlane, vending: list[dict[str, Any]]
) -> None:
    status, body = answer(request("never-registered", instance_session("i-0123456789abcdef0")))
    assert (status, body["error"]) == (404, "unknown job never-registered: it is not registered (yet)")
    assert vending == []


def test_an_instance_not_running_the_job_is_refused(plane: ControlPlane, vending: list[dict[str, Any]]) -> None:
    # Given two jobs, each on its own instance
    registered_job(plane, "render-42")
    other = registered_job(plane, "render-43")
    # When the instance of render-43 asks for render-42's store
    status, body = answer(request("render-42", instance_session(other)))
    # Then it is refused
    assert (status, body["error"]) == (403, f"instance {other} is not running job render-42")
    assert vending == []


@pytest.mark.parametrize("job", ["", "Render_42", "a" * 64, "../other", "render-42/*"])
def test_a_job_that_is_no_job_name_is_refused(plane: ControlPlane, vending: list[dict[str, Any]], job: str) -> None:
    instance_id = registered_job(plane)
    status, body = answer(request(job, instance_session(instance_id)))
    assert status == 400
    assert "job" in body["error"]
    assert vending == []


@pytest.mark.parametrize("ended", ["COMPLETED", "FAILED", "CANCELLED"])
def test_an_ended_job_gets_no_credentials_and_is_told_so_for_good(
    plane: ControlPlane, vending: list[dict[str, Any]], ended: str
) -> None:
    # Given a job that ended (a cancelled one included) while its instance still runs
    instance_id = registered_job(plane)
    boto3.resource("dynamodb", region_name=REGION).Table("spotcr-jobs").update_item(
        Key={"job_id": "render-42"},
        UpdateExpression="SET #s = :s",
        ExpressionAttributeNames={"#s": "status"},
        ExpressionAttributeValues={":s": ended},
    )
    # When its agent asks for the store
    status, body = answer(request("render-42", instance_session(instance_id)))
    # Then it is refused with 410 (Gone), which the agent never asks again after
    assert (status, body["error"]) == (410, f"job render-42 has ended ({ended}); its store is read by users, not VMs")
    assert vending == []


def test_a_backup_and_the_interrupted_instance_may_hold_the_job_while_it_recovers(plane: ControlPlane) -> None:
    # Given a job whose record, during a recovery, names its interrupted instance and its backup
    instance_id = registered_job(plane)
    recovering = dataclasses.replace(
        plane.job("render-42"),
        status=Status.RECOVERING,
        recovering_from=instance_id,
        backup_instance_id="i-0bbbbbbbbbbbbbbb1",
    )
    # Then both may hold it (the interrupted one writes the final dump), and no other instance
    store_access.authorize(recovering, "render-42", instance_id)
    store_access.authorize(recovering, "render-42", "i-0bbbbbbbbbbbbbbb1")
    with pytest.raises(store_access.Refused, match="is not running job"):
        store_access.authorize(recovering, "render-42", "i-0ccccccccccccccc2")
    # And once the recovery is over, the interrupted instance no longer may
    finished = dataclasses.replace(
        recovering, status=Status.RUNNING, instance_id="i-0bbbbbbbbbbbbbbb1", backup_instance_id=None
    )
    with pytest.raises(store_access.Refused, match="is not running job"):
        store_access.authorize(finished, "render-42", instance_id)


def test_a_request_that_is_no_function_url_event_is_answered_400(vending: list[dict[str, Any]]) -> None:
    response = invoke_function("store-credentials", {"detail-type": "EC2 Instance State-change Notification"})
    assert response["statusCode"] == 400
    assert vending == []


def test_the_published_api_gateway_sample_parses_and_its_iam_user_caller_is_refused(
    vending: list[dict[str, Any]],
) -> None:
    # Given AWS's REST proxy sample as published (the private API's shape): the caller is an IAM user
    status, body = answer(copy.deepcopy(API_SAMPLE))
    # Then it is read as a request, and refused for its caller, not as an unknown event
    assert status == 403
    assert body["error"] == "caller arn:aws:iam::111122223333:user/example-user is not an assumed-role session"
    assert vending == []


def test_through_the_private_api_the_instance_running_a_job_gets_that_jobs_credentials(
    plane: ControlPlane, vending: list[dict[str, Any]]
) -> None:
    # Given a registered job, asked for through the private API by its instance's role session
    instance_id = registered_job(plane)
    status, body = answer(api_request("render-42", instance_session(instance_id)))
    # Then the same answer as through the function URL: a session for the run's prefix only
    run = plane.job("render-42").run_id
    assert status == 200, body
    assert (body["Job"], body["Run"], body["Prefix"]) == ("render-42", run, f"jobs/render-42/runs/{run}/")
    [call] = vending
    assert (call["session_name"], call["session_tags"]) == (instance_id, {"SpotcrJob": "render-42"})


@pytest.mark.parametrize(
    ("job", "user_arn", "status"),
    [
        ("render-42", None, 403),  # no IAM caller: a method without AWS_IAM auth
        ("render-42", f"arn:aws:sts::{ACCOUNT}:assumed-role/OtherRole/i-0123456789abcdef0", 403),
        (None, f"arn:aws:sts::{ACCOUNT}:assumed-role/{JOB_ROLE}/i-0123456789abcdef0", 400),
    ],
    ids=["no caller", "another role", "no job"],
)
def test_through_the_private_api_other_callers_and_requests_are_refused(
    plane: ControlPlane, vending: list[dict[str, Any]], job: str | None, user_arn: str | None, status: int
) -> None:
    registered_job(plane)
    assert answer(api_request(job, user_arn))[0] == status
    assert vending == []
