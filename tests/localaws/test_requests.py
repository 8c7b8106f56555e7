"""The IAM requests an API call makes, as the Service Authorization Reference describes them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from rehearsal.iam.requests import Call, SseKms, UnknownOperation, requests_for

REGION, ACCOUNT = "eu-west-1", "111122223333"
TEMPLATE = "lt-0123456789abcdef0"


class FakeState:
    """A local AWS with one tagged job instance, one launch template and one instance profile."""

    tags: Mapping[str, Mapping[str, str]] = {"i-0aaa": {"spotcr:job": "train-1"}, "subnet-0bbb": {}, "ami-0ccc": {}}

    def ec2_tags(self, resource_id: str) -> Mapping[str, str]:
        return self.tags.get(resource_id, {})

    def launch_template(self, template_id: str, template_name: str, version: str) -> tuple[str, Mapping[str, Any]]:
        assert (template_id, version) == (TEMPLATE, "$Latest")
        return TEMPLATE, {"ImageId": "ami-0ccc", "IamInstanceProfile": {"Arn": "profile"}}

    def subnet_default(self, launch_data: Mapping[str, Any]) -> str:
        return ""

    def instance_profile_roles(self, profile: Mapping[str, str]) -> Sequence[str]:
        return [f"arn:aws:iam::{ACCOUNT}:role/job"] if profile == {"Arn": "profile"} else []

    def state_machine_of_token(self, token: str) -> str:
        return f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:recovery"

    def topic_key(self, topic_arn: str) -> str:
        return ""

    def access_point_tags(self, access_point_id: str) -> Mapping[str, str]:
        return {}

    def file_system_arn(self, file_system_id: str) -> str:
        return f"arn:aws:elasticfilesystem:{REGION}:{ACCOUNT}:file-system/{file_system_id}"

    def stack_arn(self, stack_name: str) -> str:
        return f"arn:aws:cloudformation:{REGION}:{ACCOUNT}:stack/{stack_name}/0a1b"

    def role_arn(self, role_name: str) -> str:
        return f"arn:aws:iam::{ACCOUNT}:role/aws-service-role/spot.amazonaws.com/{role_name}"

    def kms_key_arn(self, key_id: str) -> str:
        return f"arn:aws:kms:{REGION}:{ACCOUNT}:key/{'k-1' if key_id == 'alias/ebs' else key_id}"

    def bucket_encryption(self, bucket: str) -> SseKms | None:
        return SEALED.get(bucket)

    def object_encryption(self, bucket: str, key: str) -> SseKms | None:
        return OLD_OBJECT if (bucket, key) == ("plain", "old") else SEALED.get(bucket)


CHECKPOINT_KEY = f"arn:aws:kms:{REGION}:{ACCOUNT}:key/k-2"
# Buckets whose default encryption is SSE-KMS; "plain" is SSE-S3 now, but holds an object written with a key before.
SEALED = {"sealed": SseKms(CHECKPOINT_KEY, bucket_key=True), "per-object": SseKms(CHECKPOINT_KEY, bucket_key=False)}
OLD_OBJECT = SseKms(f"arn:aws:kms:{REGION}:{ACCOUNT}:key/k-old", bucket_key=True)


def call(service: str, operation: str, **params: Any) -> Call:
    return Call(service, operation, params, REGION, ACCOUNT)


def test_create_tags_names_the_tag_keys_the_new_values_and_the_resources_current_tags() -> None:
    [request] = requests_for(
        call("ec2", "CreateTags", Resources=["i-0aaa"], Tags=[{"Key": "spotcr:run", "Value": "r-1"}]), FakeState()
    )
    assert request.action == "ec2:CreateTags"
    assert request.resource == f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/i-0aaa"
    assert request.context == {
        "aws:TagKeys": ("spotcr:run",),
        "aws:RequestTag/spotcr:run": "r-1",
        "aws:ResourceTag/spotcr:job": "train-1",
        "ec2:ResourceTag/spotcr:job": "train-1",
    }


def test_run_instances_from_a_template_asks_for_each_resource_the_tags_on_create_and_passing_the_role() -> None:
    requests = requests_for(
        call(
            "ec2",
            "RunInstances",
            LaunchTemplate={"LaunchTemplateId": TEMPLATE, "Version": "$Latest"},
            InstanceType="m5.large",
            SubnetId="subnet-0bbb",
            MinCount=1,
            MaxCount=1,
            InstanceMarketOptions={"MarketType": "spot"},
            TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "spotcr:job", "Value": "train-1"}]}],
        ),
        FakeState(),
    )
    template_arn = f"arn:aws:ec2:{REGION}:{ACCOUNT}:launch-template/{TEMPLATE}"
    by_resource = {(r.action, r.resource): r.context for r in requests}
    run = [resource for action, resource in by_resource if action == "ec2:RunInstances"]
    assert sorted(run) == sorted(
        [
            f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/*",
            f"arn:aws:ec2:{REGION}:{ACCOUNT}:network-interface/*",
            f"arn:aws:ec2:{REGION}:{ACCOUNT}:volume/*",
            f"arn:aws:ec2:{REGION}:{ACCOUNT}:spot-instances-request/*",
            f"arn:aws:ec2:{REGION}:{ACCOUNT}:subnet/subnet-0bbb",
            f"arn:aws:ec2:{REGION}::image/ami-0ccc",
            template_arn,
        ]
    )
    assert all(by_resource[("ec2:RunInstances", r)]["ec2:LaunchTemplate"] == template_arn for r in run)
    tagging = by_resource[("ec2:CreateTags", f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/*")]
    assert tagging["ec2:CreateAction"] == "RunInstances"
    assert tagging["aws:RequestTag/spotcr:job"] == "train-1"
    assert by_resource[("iam:PassRole", f"arn:aws:iam::{ACCOUNT}:role/job")] == {
        "iam:PassedToService": "ec2.amazonaws.com"
    }


def test_send_command_asks_for_the_document_and_each_instance_with_its_ssm_resource_tags() -> None:
    document, instance = requests_for(
        call("ssm", "SendCommand", DocumentName="spotcr-restore", InstanceIds=["i-0aaa"]), FakeState()
    )
    assert document.resource == f"arn:aws:ssm:{REGION}:{ACCOUNT}:document/spotcr-restore"
    assert instance.resource == f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/i-0aaa"
    assert instance.context["ssm:resourceTag/spotcr:job"] == "train-1"


def test_assume_role_with_session_tags_also_asks_to_tag_the_session() -> None:
    role = f"arn:aws:iam::{ACCOUNT}:role/store"
    assume, tag = requests_for(
        call("sts", "AssumeRole", RoleArn=role, RoleSessionName="i-0aaa", Tags=[{"Key": "SpotcrJob", "Value": "x"}]),
        FakeState(),
    )
    assert (assume.action, tag.action) == ("sts:AssumeRole", "sts:TagSession")
    assert tag.context == {"aws:TagKeys": ("SpotcrJob",), "aws:RequestTag/SpotcrJob": "x"}


def test_removing_a_tag_names_its_key_only_and_the_resources_current_tags() -> None:
    [request] = requests_for(
        call("ec2", "DeleteTags", Resources=["i-0aaa"], Tags=[{"Key": "spotcr:interrupt"}]), FakeState()
    )
    assert (request.action, request.resource) == ("ec2:DeleteTags", f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/i-0aaa")
    assert request.context == {
        "aws:TagKeys": ("spotcr:interrupt",),
        "aws:ResourceTag/spotcr:job": "train-1",
        "ec2:ResourceTag/spotcr:job": "train-1",
    }


def test_starting_a_tagged_experiment_asks_for_its_template_the_new_experiment_and_its_tags() -> None:
    requests = requests_for(
        call("fis", "StartExperiment", experimentTemplateId="EXT1", tags={"spotcr:job": "train-1"}), FakeState()
    )
    fis = f"arn:aws:fis:{REGION}:{ACCOUNT}"
    assert [(r.action, r.resource) for r in requests] == [
        ("fis:StartExperiment", f"{fis}:experiment-template/EXT1"),
        ("fis:StartExperiment", f"{fis}:experiment/*"),
        ("fis:TagResource", f"{fis}:experiment/*"),
    ]
    assert all(r.context["aws:TagKeys"] == ("spotcr:job",) for r in requests)


def test_a_query_on_an_index_asks_for_the_index() -> None:
    [request] = requests_for(call("dynamodb", "Query", TableName="jobs", IndexName="by-status"), FakeState())
    assert request.resource == f"arn:aws:dynamodb:{REGION}:{ACCOUNT}:table/jobs/index/by-status"


def test_preflights_reads_ask_for_the_public_parameters_path_the_role_the_key_and_each_quota() -> None:
    path = "/aws/service/global-infrastructure/regions/eu-west-1/services"
    [parameters] = requests_for(call("ssm", "GetParametersByPath", Path=path), FakeState())
    assert parameters.resource == f"arn:aws:ssm:{REGION}::parameter{path}"  # AWS's own: no account
    [own] = requests_for(call("ssm", "GetParametersByPath", Path="/spotcr/x"), FakeState())
    assert own.resource == f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter/spotcr/x"
    [role] = requests_for(call("iam", "GetRole", RoleName="AWSServiceRoleForEC2Spot"), FakeState())
    assert role.resource.endswith(":role/aws-service-role/spot.amazonaws.com/AWSServiceRoleForEC2Spot")
    [key] = requests_for(call("kms", "DescribeKey", KeyId="alias/ebs"), FakeState())
    assert (key.action, key.resource) == ("kms:DescribeKey", f"arn:aws:kms:{REGION}:{ACCOUNT}:key/k-1")
    [quota] = requests_for(
        call("servicequotas", "GetServiceQuota", ServiceCode="ec2", QuotaCode="L-34B43A08"), FakeState()
    )
    assert quota.resource == f"arn:aws:servicequotas:{REGION}:{ACCOUNT}:ec2/L-34B43A08"
    [settings] = requests_for(call("lambda", "GetAccountSettings"), FakeState())
    assert (settings.action, settings.resource) == ("lambda:GetAccountSettings", "*")
    [template] = requests_for(call("fis", "GetExperimentTemplate", id="EXT1"), FakeState())
    assert template.resource == f"arn:aws:fis:{REGION}:{ACCOUNT}:experiment-template/EXT1"


def s3(operation: str, bucket: str, key: str) -> Call:
    return call("s3", operation, Resource=f"arn:aws:s3:::{bucket}/{key}")


def test_writing_to_an_sse_kms_bucket_asks_for_a_data_key_through_s3_for_the_bucket() -> None:
    [put, data_key] = requests_for(s3("PutObject", "sealed", "jobs/a"), FakeState())
    assert put.action == "s3:PutObject"
    assert (data_key.action, data_key.resource) == ("kms:GenerateDataKey", CHECKPOINT_KEY)
    assert data_key.context == {
        "kms:ViaService": f"s3.{REGION}.amazonaws.com",
        "kms:CallerAccount": ACCOUNT,
        "kms:EncryptionContext:aws:s3:arn": "arn:aws:s3:::sealed",  # S3 Bucket Keys: the bucket's ARN
    }


def test_reading_an_sse_kms_object_asks_to_decrypt_with_the_key_it_was_written_with() -> None:
    [_, decrypt] = requests_for(s3("GetObject", "sealed", "jobs/a"), FakeState())
    assert (decrypt.action, decrypt.resource) == ("kms:Decrypt", CHECKPOINT_KEY)
    [_, old] = requests_for(s3("GetObject", "plain", "old"), FakeState())
    assert (old.action, old.resource) == ("kms:Decrypt", OLD_OBJECT.key_arn)
    # Without S3 Bucket Keys the encryption context is the object's ARN
    [_, per_object] = requests_for(s3("GetObject", "per-object", "jobs/a"), FakeState())
    assert per_object.context["kms:EncryptionContext:aws:s3:arn"] == "arn:aws:s3:::per-object/jobs/a"


def test_sse_s3_objects_a_head_and_a_delete_ask_nothing_of_kms() -> None:
    for operation, bucket in (("PutObject", "plain"), ("GetObject", "plain"), ("HeadObject", "sealed")):
        [only] = requests_for(s3(operation, bucket, "jobs/a"), FakeState())
        assert only.action.startswith("s3:")
    [delete] = requests_for(s3("DeleteObject", "sealed", "jobs/a"), FakeState())
    assert delete.action == "s3:DeleteObject"


def test_an_operation_without_an_entry_is_an_error_not_an_allow() -> None:
    with pytest.raises(UnknownOperation, match="ec2:ModifyInstanceAttribute has no entry"):
        requests_for(call("ec2", "ModifyInstanceAttribute", InstanceId="i-0aaa"), FakeState())
