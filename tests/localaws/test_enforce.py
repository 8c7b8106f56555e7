"""The local AWS enforces the synthesized stack's IAM on the functions' calls, and refuses as AWS refuses.

Registering a job tags its instance with the run it mints (spotcr:run): the stack must grant that, and a grant
limited to spotcr:error (as before) is refused with EC2's UnauthorizedOperation, naming the role, action and instance.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from spotcr_contracts import tags as tag_names

from rehearsal.controlplane import ACCOUNT, REGION, ControlPlane, ec2_event, function_key, route
from rehearsal.iam import enforce
from tests.workflow.conftest import aws_env, plane

__all__ = ["aws_env", "plane"]  # the workflow tests' control plane, IAM enforced


def _registration_tagging_limited_to(keys: list[str], policies: tuple[Any, ...]) -> tuple[Any, ...]:
    """The policies with every instance CreateTags statement keyed on aws:TagKeys narrowed to `keys`."""
    narrowed = []
    for document in policies:
        statements = []
        for statement in document["Statement"]:
            condition = statement.get("Condition", {})
            if "aws:TagKeys" in condition.get("ForAllValues:StringEquals", {}):
                tag_keys = {**condition["ForAllValues:StringEquals"], "aws:TagKeys": keys}
                statements.append({**statement, "Condition": {**condition, "ForAllValues:StringEquals": tag_keys}})
            else:
                statements.append(statement)
        narrowed.append({**document, "Statement": statements})
    return tuple(narrowed)


def test_registering_a_job_tags_its_run_under_the_stacks_own_grants(plane: ControlPlane) -> None:
    # Given a job instance the user launched
    instance_id = plane.launch_job_instance({tag_names.JOB: "train-1", tag_names.COMMAND: "/opt/job/run"})

    # When it runs and the state-change function registers it, as its role in the synthesized stack
    route(ec2_event("state-change-running", instance_id))

    # Then the run is tagged on the instance and IAM refused nothing
    assert plane.instance_tags(instance_id)[tag_names.RUN] == plane.job("train-1").run_id
    assert plane.enforcer.denials == []
    assert ("arn:aws:iam::123456789012:role/FunctionsstatechangeRole", "ec2:CreateTags") in plane.enforcer.evaluated


def test_a_tag_grant_limited_to_spotcr_error_is_refused_as_ec2_refuses_it(plane: ControlPlane) -> None:
    # Given the state-change role with the grant as it was: CreateTags only for the spotcr:error key
    key = function_key("state-change")
    role = plane.enforcer.keys[key]
    old = dataclasses.replace(role, policies=_registration_tagging_limited_to([tag_names.ERROR], role.policies))
    plane.enforcer.keys = {**plane.enforcer.keys, key: old}
    instance_id = plane.launch_job_instance({tag_names.JOB: "train-1", tag_names.COMMAND: "/opt/job/run"})

    # When the function registers the job
    with pytest.raises(ClientError) as refused:
        route(ec2_event("state-change-running", instance_id))

    # Then EC2 refuses the run's tag as AWS does, and the instance never learns its run
    error = refused.value.response
    assert error["Error"]["Code"] == "UnauthorizedOperation"
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 403
    instance_arn = f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/{instance_id}"
    assert error["Error"]["Message"].startswith(
        "You are not authorized to perform this operation. User: "
        f"arn:aws:iam::{ACCOUNT}:role/FunctionsstatechangeRole is not authorized to perform: ec2:CreateTags on "
        f"resource: {instance_arn} because no identity-based policy allows the ec2:CreateTags action"
    )
    assert tag_names.RUN not in plane.instance_tags(instance_id)
    [denial] = plane.enforcer.denials
    [tagging] = [r for r in denial.requests if r.action == "ec2:CreateTags"]
    assert tagging.context["aws:TagKeys"] == (tag_names.RUN,)
    assert tagging.context[f"aws:ResourceTag/{tag_names.JOB}"] == "train-1"


def test_a_caller_that_is_no_principal_is_refused_not_allowed(plane: ControlPlane) -> None:
    # Given a key no spotcr principal holds
    stranger = boto3.client(
        "dynamodb", region_name=REGION, aws_access_key_id="AKIASTRANGER00000000", aws_secret_access_key="x"
    )

    # When it reads the jobs table, then DynamoDB refuses it as AWS refuses an unauthorized call
    with pytest.raises(ClientError) as refused:
        stranger.get_item(TableName="spotcr-jobs", Key={"job_id": {"S": "train-1"}})
    assert refused.value.response["Error"]["Code"] == "AccessDeniedException"
    assert "AKIASTRANGER00000000" in refused.value.response["Error"]["Message"]


def test_a_function_may_not_call_what_its_role_is_not_granted(plane: ControlPlane) -> None:
    # Given the scheduler's role, which holds no grant on the idempotency table
    with enforce.acting_as(function_key("scheduler")):
        dynamodb = boto3.client("dynamodb", region_name=REGION)

        # When it reads that table, then DynamoDB refuses it, naming the role, the action and the table
        with pytest.raises(ClientError) as refused:
            dynamodb.get_item(TableName="spotcr-idempotency", Key={"id": {"S": "x"}})
    message = refused.value.response["Error"]["Message"]
    assert refused.value.response["Error"]["Code"] == "AccessDeniedException"
    assert f"User: arn:aws:iam::{ACCOUNT}:role/FunctionsschedulerRole is not authorized to perform: " in message
    assert f"dynamodb:GetItem on resource: arn:aws:dynamodb:{REGION}:{ACCOUNT}:table/spotcr-idempotency" in message


def test_enforcement_is_undone_on_leaving(plane: ControlPlane) -> None:
    # Given the enforcement the plane fixture entered, left again by a nested one
    from moto.core.authorization import ActionAuthenticatorMixin

    hooked = ActionAuthenticatorMixin.__dict__["_authenticate_and_authorize_action"]
    with enforce.enforced(plane.enforcer):
        assert ActionAuthenticatorMixin.__dict__["_authenticate_and_authorize_action"] is not hooked

    # Then the hook in place before is back
    assert ActionAuthenticatorMixin.__dict__["_authenticate_and_authorize_action"] is hooked


def test_an_operation_without_a_request_model_is_refused_naming_it_in_server_mode() -> None:
    # Given the local AWS as a server (as the rehearsal runs it), and a principal allowed everything
    from moto.server import ThreadedMotoServer

    from rehearsal.iam.policy import Principal

    key = enforce.access_key("test:anything")
    anything = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    enforcer = enforce.Enforcer(
        keys={key: Principal(f"arn:aws:iam::{ACCOUNT}:role/anything", (anything,))},
        trusted={"testing": "the test"},
        roles={},
        state=enforce.MotoState(ACCOUNT, REGION),
    )
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        trusted = boto3.client(
            "s3", region_name=REGION, endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="x"
        )
        trusted.create_bucket(Bucket="spotcr-unmodelled")
        s3 = boto3.client(
            "s3", region_name=REGION, endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key="x"
        )
        # When it calls an operation requests.py has no entry for
        with enforce.enforced(enforcer), pytest.raises(ClientError) as refused:
            s3.get_bucket_tagging(Bucket="spotcr-unmodelled")
    finally:
        server.stop()

    # Then S3 answers 403 AccessDenied naming the operation, not a 500: a gap in the model is never an allow
    error = refused.value.response
    assert (error["Error"]["Code"], error["ResponseMetadata"]["HTTPStatusCode"]) == ("AccessDenied", 403)
    assert "the local AWS has no IAM request model for s3:GetBucketTagging" in error["Error"]["Message"]
