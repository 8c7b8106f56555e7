"""Capabilities become IAM statements in one place; unknown ones and unexplained wildcards are refused."""

from __future__ import annotations

import aws_cdk as cdk
import pytest
from aws_cdk import aws_iam as iam
from spotcr_functions import catalog

from infra import grants


def _targets(stack: cdk.Stack) -> grants.GrantTargets:
    return grants.GrantTargets(
        jobs_table_arn="arn:aws:dynamodb:eu-west-1:111122223333:table/jobs",
        jobs_index_names=("by-status",),
        idempotency_table_arn="arn:aws:dynamodb:eu-west-1:111122223333:table/idem",
        document_names={"checkpoint": "spotcr-checkpoint"},
        launch_template_id="lt-0123456789abcdef0",
        job_role_arn="arn:aws:iam::111122223333:role/job",
        state_machine_arn="arn:aws:states:eu-west-1:111122223333:stateMachine:spotcr-recovery",
        failure_topic_arn="arn:aws:sns:eu-west-1:111122223333:failures",
        failure_topic_key_arn="arn:aws:kms:eu-west-1:111122223333:key/k",
        checkpoint_bucket_name="bucket",
        job_spec_buckets=(),
        stack=stack,
    )


def test_every_capability_the_catalog_declares_has_a_mapping() -> None:
    declared = {c for f in catalog.FUNCTIONS for c in f.capabilities} | set(catalog.WORKFLOW_CAPABILITIES)
    assert declared <= set(grants.CAPABILITIES)


@pytest.mark.parametrize("capability", sorted(grants.CAPABILITIES))
def test_each_mapping_has_no_wildcard_action_and_explains_wildcard_resources(capability: str) -> None:
    stack = cdk.Stack(cdk.App())
    for grant in grants.grants_for([capability], _targets(stack)):
        assert not any("*" in action for action in grant.statement.actions)
        if any("*" in resource for resource in grant.statement.resources):
            assert grant.wildcard_reason and len(grant.wildcard_reason) > 40


def test_an_unknown_capability_is_an_error_naming_it() -> None:
    with pytest.raises(KeyError, match="s3:everything"):
        grants.grants_for(["s3:everything"], _targets(cdk.Stack(cdk.App())))


def test_a_wildcard_without_a_reason_is_refused() -> None:
    stack = cdk.Stack(cdk.App())
    role = iam.Role(stack, "Role", assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"))
    statement = iam.PolicyStatement(actions=["s3:GetObject"], resources=["arn:aws:s3:::bucket/*"])
    with pytest.raises(ValueError, match="without a reason"):
        grants.apply(role, [grants.Grant(statement)])
