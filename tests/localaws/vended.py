"""AWS calls made as the principal that makes them in production, IAM enforced, for tests on the moto server.

A job VM's calls are its instance-profile session's (the job role, with the instance AWS puts in its context). The
store's calls are a vended store session's: the store-credentials function's role assumes the store role with
the job's session tag and the session policy it gives (spotcr_functions.store_access.session_policy), as in AWS.
The test itself builds the world with moto's own key ("testing"), which is trusted (CloudFormation's part).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import boto3
from spotcr_functions import store_access

from rehearsal.iam import enforce, principals
from rehearsal.iam.policy import Principal

ACCOUNT, REGION = "123456789012", "us-east-1"  # the moto server's
VENDOR = enforce.function_key("store-credentials")


class Enforced:
    """The stack's roles with the test's bucket as the checkpoint bucket; every untrusted call evaluated."""

    def __init__(
        self,
        bucket: str,
        names: Mapping[str, str] | None = None,
        synthesized: Mapping[str, Any] | None = None,
        key_arn: str = "",
    ) -> None:
        """`names`: more of the stack's resources by logical-id stem, as the test names them (RegistryAgentBus);
        `synthesized`: the stack's template (by default cdk.json's settings); `key_arn`: the checkpoint key, as the
        functions' settings name it (store sessions' session policy)."""
        self.bucket = bucket
        self.key_arn = key_arn
        local = principals.Local(REGION, ACCOUNT, {"StorageCheckpoints": bucket, **(names or {})})
        template = principals.template() if synthesized is None else synthesized
        self.roles = principals.stack_roles(local, template)
        self.enforcer = enforce.Enforcer(
            keys={VENDOR: self.roles.functions["store-credentials"].principal()},
            trusted={"testing": "the test, building the world"},
            roles={self.roles.store.arn: self.roles.store.principal()},
            state=enforce.MotoState(ACCOUNT, REGION),
            resource_policies=principals.resource_policies(local, template),
        )

    def job_vm(self, instance_id: str) -> str:
        """The access key of this job VM's instance-profile session (as the rehearsal's instance_env gives it)."""
        key = enforce.access_key(f"instance:{instance_id}")
        session = f"arn:aws:sts::{ACCOUNT}:assumed-role/{self.roles.job.arn.rsplit('/', 1)[-1]}/{instance_id}"
        source = {"ec2:SourceInstanceARN": f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/{instance_id}"}
        self.enforcer.add_key(key, Principal(session, self.roles.job.policies), source)
        return key

    def store_session(self, job_id: str, run_id: str) -> Any:
        """A boto3 session as store-credentials vends it to the instance running this run of the job."""
        policy = store_access.session_policy("aws", self.bucket, run_id, key_arn=self.key_arn)
        with enforce.acting_as(VENDOR):
            credentials = boto3.client("sts", region_name=REGION).assume_role(
                RoleArn=self.roles.store.arn,
                RoleSessionName=f"i-{uuid.uuid4().hex[:17]}",  # each store its own VM, as in AWS
                Policy=json.dumps(policy),
                Tags=[{"Key": store_access.SESSION_TAG, "Value": job_id}],
                DurationSeconds=3600,
            )["Credentials"]
        return boto3.session.Session(
            aws_access_key_id=credentials["AccessKeyId"],
            aws_secret_access_key=credentials["SecretAccessKey"],
            aws_session_token=credentials["SessionToken"],
            region_name=REGION,
        )


@contextlib.contextmanager
def enforced(bucket: str, names: Mapping[str, str] | None = None) -> Iterator[Enforced]:
    world = Enforced(bucket, names)
    with enforce.enforced(world.enforcer):
        yield world
