"""A checkpoint key (setting checkpoint_key): the bucket encrypts with SSE-KMS and S3 Bucket Keys, and S3 asks KMS as
the caller (kms:GenerateDataKey to write, kms:Decrypt to read). The local AWS asks the same, so the stack's grants
(the store role's, the store session's policy, the job VMs' role's) are what lets the store work, and without one
of them S3 refuses, as AWS does.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import boto3
import pytest
from botocore.exceptions import ClientError

from rehearsal.iam import enforce, principals
from tests.infra.conftest import Synth
from tests.localaws.vended import ACCOUNT, REGION, Enforced

JOB, RUN = "render-42", "r-0123456789abcdef"
CHECKPOINT = f"jobs/{JOB}/runs/{RUN}/checkpoints/0001"


@pytest.fixture
def sealed(aws: str, custom_synth: Synth) -> Iterator[Enforced]:
    """A bucket whose default encryption is the stack's checkpoint key (custom_synth creates one), IAM enforced."""
    key = boto3.client("kms").create_key(Description="checkpoints")["KeyMetadata"]
    bucket = f"spotcr-test-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=bucket)
    default = {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": key["Arn"]}
    s3.put_bucket_encryption(
        Bucket=bucket,
        ServerSideEncryptionConfiguration={
            "Rules": [{"ApplyServerSideEncryptionByDefault": default, "BucketKeyEnabled": True}]
        },
    )
    world = Enforced(
        bucket, {"StorageCheckpointKey": key["KeyId"]}, synthesized=custom_synth.template.to_json(), key_arn=key["Arn"]
    )
    with enforce.enforced(world.enforcer):
        yield world


def _store(world: Enforced) -> object:
    return world.store_session(JOB, RUN).client("s3", region_name=REGION)


def test_a_store_session_writes_and_reads_a_checkpoint_under_the_stacks_key_grants(sealed: Enforced) -> None:
    s3 = _store(sealed)
    s3.put_object(Bucket=sealed.bucket, Key=CHECKPOINT, Body=b"pages")  # type: ignore[attr-defined]
    body = s3.get_object(Bucket=sealed.bucket, Key=CHECKPOINT)["Body"].read()  # type: ignore[attr-defined]
    assert body == b"pages"
    assert sealed.enforcer.denials == []
    asked = [action for principal, action in sealed.enforcer.evaluated if "StoreRole" in principal]
    assert asked == ["s3:PutObject", "s3:GetObject"]


@pytest.mark.parametrize("grant", ["kms:GenerateDataKey", "kms:Decrypt"])
def test_a_store_role_without_its_key_grant_is_refused_as_s3_refuses(sealed: Enforced, grant: str) -> None:
    # Given the store role with one of its two key actions taken out
    store_role = sealed.roles.store
    sealed.enforcer.roles = {store_role.arn: principals.without_grant(store_role.principal(), grant)}
    s3 = _store(sealed)
    with pytest.raises(ClientError, match="AccessDenied"):
        # When the session writes a checkpoint and reads it back
        s3.put_object(Bucket=sealed.bucket, Key=CHECKPOINT, Body=b"pages")  # type: ignore[attr-defined]
        s3.get_object(Bucket=sealed.bucket, Key=CHECKPOINT)  # type: ignore[attr-defined]
    # Then S3 refuses the call that needs the missing action on the key, naming it
    assert grant in sealed.enforcer.denials[-1].reason


def test_a_session_policy_without_the_key_refuses_the_write_the_role_allows(sealed: Enforced) -> None:
    # Given a session vended without the key in its session policy (functions settings lacking the key's ARN)
    sealed.key_arn = ""
    s3 = _store(sealed)
    with pytest.raises(ClientError, match="AccessDenied"):
        s3.put_object(Bucket=sealed.bucket, Key=CHECKPOINT, Body=b"pages")  # type: ignore[attr-defined]
    assert "kms:GenerateDataKey" in sealed.enforcer.denials[-1].reason


def test_a_job_vm_reads_a_users_spec_with_the_key_and_is_refused_without_its_grant(sealed: Enforced) -> None:
    # Given a spec the user uploaded (encrypted with the bucket's key)
    boto3.client("s3").put_object(Bucket=sealed.bucket, Key="specs/render.json", Body=b"{}")
    with enforce.acting_as(sealed.job_vm("i-0123456789abcdef0")):
        s3 = boto3.client("s3", region_name=REGION)
        # When the job VM reads it with the stack's grants, then it gets the spec
        assert s3.get_object(Bucket=sealed.bucket, Key="specs/render.json")["Body"].read() == b"{}"
        # When a VM whose role lacks kms:Decrypt reads it, then S3 refuses
        sealed.enforcer.add_key("no-key-grant", principals.without_grant(sealed.roles.job.principal(), "kms:Decrypt"))
    with enforce.acting_as("no-key-grant"), pytest.raises(ClientError, match="AccessDenied"):
        boto3.client("s3", region_name=REGION).get_object(Bucket=sealed.bucket, Key="specs/render.json")
    assert "kms:Decrypt" in sealed.enforcer.denials[-1].reason


@pytest.mark.parametrize("told_the_key", [True, False])
def test_the_cli_users_policy_reads_a_checkpoint_with_the_key_the_stack_outputs(
    sealed: Enforced, told_the_key: bool
) -> None:
    # Given a checkpoint in the sealed bucket, and the user's policy printed from the stack's outputs
    boto3.client("s3").put_object(Bucket=sealed.bucket, Key=CHECKPOINT, Body=b"pages")
    outputs = {
        "CheckpointBucket": sealed.bucket,
        "JobTable": "spotcr-jobs",
        "LaunchTemplateId": "lt-0123456789abcdef0",
        "RecoveryStateMachineArn": f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:spotcr-recovery",
    }
    if told_the_key:
        outputs["CheckpointKeyArn"] = sealed.key_arn
    sealed.enforcer.add_key("cli-user", principals.cli_user(ACCOUNT, "spotcr", REGION, outputs))
    # When the user reads it (spotcr logs, a restore by hand), then S3 serves it only if the policy names the key
    with enforce.acting_as("cli-user"):
        s3 = boto3.client("s3", region_name=REGION)
        if told_the_key:
            assert s3.get_object(Bucket=sealed.bucket, Key=CHECKPOINT)["Body"].read() == b"pages"
        else:
            with pytest.raises(ClientError, match="AccessDenied"):
                s3.get_object(Bucket=sealed.bucket, Key=CHECKPOINT)
