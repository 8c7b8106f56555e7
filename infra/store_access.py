"""Per-job isolation in the checkpoint bucket: the store role and the store-credentials function URL.

With private subnets the same function is served by a private API Gateway REST API instead (function URLs are
reachable over the internet only, and absent in some regions): AWS_IAM auth on its one method, and a resource policy
that lets only the job VMs' role call it, only through the stack's execute-api VPC endpoint.

Job VMs hold no grant on jobs/ themselves. Their agent signs a request to the store-credentials function URL
(AuthType AWS_IAM) with the instance role; the function checks that the job's record names the calling instance
and assumes the store role with the job as session tag and a session policy, both limited to jobs/<job>/. With EFS
the same session mounts the file system through the job's own access point only (the session policy names it).
"""

from __future__ import annotations

import aws_cdk as cdk
import jsii
from aws_cdk import aws_apigateway as apigateway
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_efs as efs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_s3 as s3
from constructs import Construct

from infra import grants
from infra.nag import acknowledge

API_STAGE = "v1"


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
        self,
        scope: Construct,
        construct_id: str,
        *,
        bucket: s3.IBucket,
        file_system: efs.IFileSystem | None = None,
        key: kms.IKey | None = None,
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
        key_arn = key.key_arn if key is not None else None
        grants.apply(self.role, grants.job_store(bucket.bucket_arn, file_system_arn, key_arn))

    def serve(
        self, function: lambda_.Function, job_role: iam.IRole, private_endpoint: ec2.IVpcEndpoint | None = None
    ) -> str:
        """The address of the function that vends store sessions, which only the job VMs' role may call (SigV4): its
        function URL, or with a private endpoint (private subnets) a private API reached through that endpoint."""
        if function.role is None:
            raise ValueError("the store-credentials function has no role")
        self._vendor_role_arn.value = function.role.role_arn
        if private_endpoint is not None:
            return self._private_api(function, job_role, private_endpoint)
        url = function.add_function_url(auth_type=lambda_.FunctionUrlAuthType.AWS_IAM)
        url.grant_invoke_url(job_role)
        return url.url

    def _private_api(self, function: lambda_.Function, job_role: iam.IRole, endpoint: ec2.IVpcEndpoint) -> str:
        invoke, methods = ["execute-api:Invoke"], ["execute-api:/*"]
        api = apigateway.RestApi(
            self,
            "StoreCredentialsApi",
            description="spotcr store credentials for job VMs in private subnets (AWS_IAM, VPC endpoint only)",
            endpoint_configuration=apigateway.EndpointConfiguration(
                types=[apigateway.EndpointType.PRIVATE], vpc_endpoints=[endpoint]
            ),
            policy=iam.PolicyDocument(
                statements=[
                    iam.PolicyStatement(
                        principals=[iam.ArnPrincipal(job_role.role_arn)], actions=invoke, resources=methods
                    ),
                    iam.PolicyStatement(
                        effect=iam.Effect.DENY,
                        principals=[iam.AnyPrincipal()],
                        actions=invoke,
                        resources=methods,
                        conditions={"StringNotEquals": {"aws:SourceVpce": endpoint.vpc_endpoint_id}},
                    ),
                ]
            ),
            deploy_options=apigateway.StageOptions(stage_name=API_STAGE),
            cloud_watch_role=False,
        )
        api.root.add_method(
            "GET",
            apigateway.LambdaIntegration(function, allow_test_invoke=False),
            authorization_type=apigateway.AuthorizationType.IAM,
        )
        for rule, reason in {
            "AwsSolutions-APIG1": "the function logs every request with its caller and job; API Gateway's access "
            "logs would need an account-wide CloudWatch role for API Gateway, which a stack should not set",
            "AwsSolutions-APIG6": "as APIG1: execution logs need the account-wide API Gateway CloudWatch role",
            "AwsSolutions-APIG2": "one GET with one query parameter, which the function validates and refuses by name",
            "AwsSolutions-APIG3": "private API: reachable only through the stack's VPC endpoint, from job VMs' role",
            "AwsSolutions-COG4": "callers are EC2 instance roles, authorized with AWS_IAM (SigV4), not Cognito users",
        }.items():
            acknowledge(api, rule, reason)
        return api.url
