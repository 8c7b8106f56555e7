"""The checkpoint key (setting checkpoint_key): SSE-KMS with S3 Bucket Keys on the checkpoint bucket, and the key
granted only to what reads or writes checkpoints, only as S3 uses it for that bucket. custom_synth creates the key,
private_custom_synth names the user's; default_synth keeps SSE-S3 and grants no key.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from spotcr_functions import store_access

from infra.settings import CREATE_KEY, InvalidSetting, Settings
from tests.infra.conftest import CHECKPOINT_KEY_ARN, Synth
from tests.infra.support import as_list, child, logical_id, statements_by_role

# The condition key that ties a key grant to the checkpoint bucket (S3 Bucket Keys' encryption context).
S3_CONTEXT_KEY = "kms:EncryptionContext:aws:s3:arn"


def _bucket(synth: Synth) -> tuple[str, dict[str, Any]]:
    bucket = logical_id(synth, child(synth, "Storage", "Checkpoints"))
    return bucket, synth.resources[bucket]["Properties"]


def _key_statements(synth: Synth, role_path: tuple[str, ...]) -> list[dict[str, Any]]:
    role = logical_id(synth, child(synth, *role_path))
    return [
        s for s in statements_by_role(synth).get(role, []) if any(a.startswith("kms:") for a in as_list(s["Action"]))
    ]


def test_by_default_the_bucket_uses_sse_s3_and_no_role_may_use_a_key_through_s3(default_synth: Synth) -> None:
    _, bucket = _bucket(default_synth)
    [rule] = bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert rule == {"ServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}
    for statements in statements_by_role(default_synth).values():
        assert not [s for s in statements if S3_CONTEXT_KEY in str(s.get("Condition", {}))]


@pytest.mark.parametrize("configuration", ["custom_synth", "private_custom_synth"])
def test_a_checkpoint_key_encrypts_the_bucket_with_bucket_keys(
    configuration: str, request: pytest.FixtureRequest
) -> None:
    synth: Synth = request.getfixturevalue(configuration)
    _, bucket = _bucket(synth)
    [rule] = bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert rule["BucketKeyEnabled"] is True
    assert rule["ServerSideEncryptionByDefault"]["SSEAlgorithm"] == "aws:kms"
    key = rule["ServerSideEncryptionByDefault"]["KMSMasterKeyID"]
    if configuration == "private_custom_synth":
        assert key == CHECKPOINT_KEY_ARN
    else:
        assert key == {"Fn::GetAtt": [logical_id(synth, child(synth, "Storage", "CheckpointKey")), "Arn"]}


@pytest.mark.parametrize(
    ("role_path", "actions"),
    [
        (("StoreAccess", "StoreRole"), ["kms:GenerateDataKey", "kms:Decrypt"]),
        (("VmLaunch", "JobRole"), ["kms:Decrypt"]),  # the user's job specs under specs/: read only
    ],
)
def test_the_roles_that_touch_checkpoints_use_the_key_only_through_s3_for_the_bucket(
    private_custom_synth: Synth, role_path: tuple[str, ...], actions: list[str]
) -> None:
    bucket, _ = _bucket(private_custom_synth)
    [statement] = _key_statements(private_custom_synth, role_path)
    assert as_list(statement["Action"]) == actions
    assert statement["Resource"] == CHECKPOINT_KEY_ARN
    via = {"Fn::Join": ["", ["s3.", {"Ref": "AWS::Region"}, ".amazonaws.com"]]}
    condition = {"StringEquals": {"kms:ViaService": via, S3_CONTEXT_KEY: {"Fn::GetAtt": [bucket, "Arn"]}}}
    assert statement["Condition"] == condition


def test_a_key_the_stack_creates_rotates_is_kept_and_leaves_its_grants_to_iam(custom_synth: Synth) -> None:
    key_id = logical_id(custom_synth, child(custom_synth, "Storage", "CheckpointKey"))
    key = custom_synth.resources[key_id]
    assert key["DeletionPolicy"] == "Retain" and key["Properties"]["EnableKeyRotation"] is True
    # The account's root, and no one else: IAM policies (the grants above) decide who uses it.
    [statement] = key["Properties"]["KeyPolicy"]["Statement"]
    assert statement["Principal"]["AWS"]["Fn::Join"][1][-1] == ":root"
    assert statement["Action"] == "kms:*" and "Condition" not in statement


def test_functions_are_told_the_key_for_store_sessions(custom_synth: Synth, default_synth: Synth) -> None:
    variable = "SPOTCR_CHECKPOINT_KEY_ARN"
    values = {
        name: {
            str(f["Properties"]["Environment"]["Variables"].get(variable))
            for f in synth.of_type("AWS::Lambda::Function").values()
            if "Environment" in f["Properties"]
        }
        for name, synth in (("custom", custom_synth), ("default", default_synth))
    }
    key_id = logical_id(custom_synth, child(custom_synth, "Storage", "CheckpointKey"))
    assert values["custom"] == {str({"Fn::GetAtt": [key_id, "Arn"]})}
    assert values["default"] == {""}


def test_a_store_sessions_policy_names_the_key_and_stays_within_assume_roles_limit() -> None:
    # Given a bucket name as long as CloudFormation makes them, EFS storage and a key (the job's name, up to 63
    # characters, is the session tag's, so no length of it counts here)
    bucket = "spotcr-storagecheckpoints2cdbdf43-0123456789ab"
    efs = "arn:aws-us-gov:elasticfilesystem:us-gov-west-1:123456789012:access-point/fsap-0123456789abcdef0"
    policy = store_access.session_policy(
        "aws-us-gov",
        bucket,
        "r-0123456789abcdef",
        access_point_arn=efs,
        file_system_id="fs-0123456789abcdef0",
        key_arn=CHECKPOINT_KEY_ARN,
    )
    # Then the key's actions are allowed on that key (the store role's grant holds the conditions)
    [statement] = [s for s in policy["Statement"] if s["Resource"] == CHECKPOINT_KEY_ARN]
    assert statement["Action"] == ["kms:GenerateDataKey", "kms:Decrypt"]
    assert len(json.dumps(policy, separators=(",", ":"))) <= 2048  # AssumeRole's limit on a session policy
    without = store_access.session_policy("aws", bucket, "r-0123456789abcdef")
    assert not [s for s in without["Statement"] if "kms:Decrypt" in s["Action"]]


def test_the_setting_takes_create_or_a_key_arn_and_refuses_anything_else_naming_itself() -> None:
    assert Settings.from_mapping({}).checkpoint_key is None
    assert Settings.from_mapping({"checkpoint_key": "create"}).checkpoint_key == CREATE_KEY
    assert Settings.from_mapping({"checkpoint_key": CHECKPOINT_KEY_ARN}).checkpoint_key == CHECKPOINT_KEY_ARN
    assert Settings.from_mapping({"checkpoint_key": "false"}).checkpoint_key is None
    for bad in ("alias/spotcr", "arn:aws:kms:eu-west-1:111122223333:alias/spotcr", "yes"):
        with pytest.raises(InvalidSetting, match="checkpoint_key"):
            Settings.from_mapping({"checkpoint_key": bad})
