"""Per-job isolation in the checkpoint bucket: the store role and the store-credentials function URL.

Job VMs hold no grant on jobs/ themselves. Their agent signs a request to the store-credentials function URL
(AuthType AWS_IAM) with the instance role; the function checks that the job's record names the calling instance
and assumes the store role with the job as session tag and a session policy, both limited to jobs/<job>/. With EFS
the same session mounts the file system through the job's own access point only (the session policy names it).
"""

from __future__ import annotations

import aws_cdk as cdk
import jsii
from aws_cdk import aws_efs as efs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_s3 as s3
from constructs import Construct

from infra import grants


@jsii.implements(cdk.IStableStringProducer)
class Later:
    """A value known only once a later construct exists (CloudFormation has no cycle; the construct order has)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.value: str | None = None

    def produce(self) -> str:
        if self.value is None:
            raise ValueError(f"{self.what} was never set")
        return self.value

    def token(self) -> str:
        return cdk.Lazy.string(self)


class StoreAccess(Construct):
    def __init__(
        self, scope: Construct, construct_id: str, *, bucket: s3.IBucket, file_system: efs.IFileSystem | None = None
    ) -> None:
        super().__init__(scope, construct_id)
        self._vendor_role_arn = Later("the store-credentials function's role")
        self.role = iam.Role(
            self,
            "StoreRole",
            assumed_by=iam.ArnPrincipal(self._vendor_role_arn.token()).with_session_tags(),
            description="spotcr job store: one job's jobs/<job>/ prefix per session (session tag SpotcrJob)",
            max_session_duration=cdk.Duration.hours(1),
        )
        file_system_arn = file_system.file_system_arn if file_system is not None else None
        grants.apply(self.role, grants.job_store(bucket.bucket_arn, file_system_arn))

    def serve(self, function: lambda_.Function, job_role: iam.IRole) -> lambda_.FunctionUrl:
        """The function that vends store sessions, at a URL only the job VMs' role may call (SigV4)."""
        if function.role is None:
            raise ValueError("the store-credentials function has no role")
        self._vendor_role_arn.value = function.role.role_arn
        url = function.add_function_url(auth_type=lambda_.FunctionUrlAuthType.AWS_IAM)
        url.grant_invoke_url(job_role)
        return url
