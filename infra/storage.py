"""Where checkpoints live: the S3 bucket (always), EFS and FSx for Lustre (opt-in; they bill while idle)."""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_efs as efs
from aws_cdk import aws_fsx as fsx
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from infra.nag import acknowledge
from infra.network import Network
from infra.settings import CREATE_KEY, Settings

# Prefix of everything a job writes: jobs/<job_id>/chunks/... and jobs/<job_id>/checkpoints/...
JOBS_PREFIX = "jobs/"
SPECS_PREFIX = "specs/"
NFS_PORT = 2049
LUSTRE_PORT = 988
LUSTRE_PORTS = (1018, 1023)
EFS_CLIENT_ACTIONS = (
    "elasticfilesystem:ClientMount",
    "elasticfilesystem:ClientWrite",
    "elasticfilesystem:ClientRootAccess",
)


def isolating_file_system_policy() -> iam.PolicyDocument:
    """The file system policy of efs_isolation: IAM, TLS and an access point, or no mount.

    With a file system policy in effect EFS no longer applies its default policy, which "grants full access to any
    anonymous client"; this one allows nothing, so a client without IAM authorization (a plain NFS mount) is
    refused, and only identity policies allow (the store role's sessions, each narrowed to its job's access point by
    its session policy: spotcr_functions.store_access). Both denials use keys EFS enforces for NFS clients
    (aws:SecureTransport, elasticfilesystem:AccessPointArn: Amazon EFS User Guide, "Using IAM to control file
    system data access"), so even an administrator's role mounts the file system's root only after this policy is
    removed, or through an access point of its own.
    """
    everyone = [iam.AnyPrincipal()]
    return iam.PolicyDocument(
        statements=[
            iam.PolicyStatement(
                sid="DenyWithoutTls",
                effect=iam.Effect.DENY,
                principals=everyone,
                actions=list(EFS_CLIENT_ACTIONS),
                resources=["*"],
                conditions={"Bool": {"aws:SecureTransport": "false"}},
            ),
            iam.PolicyStatement(
                sid="DenyWithoutAccessPoint",
                effect=iam.Effect.DENY,
                principals=everyone,
                actions=list(EFS_CLIENT_ACTIONS),
                resources=["*"],
                conditions={"Null": {"elasticfilesystem:AccessPointArn": "true"}},
            ),
        ]
    )


class Storage(Construct):
    def __init__(self, scope: Construct, construct_id: str, *, settings: Settings, network: Network) -> None:
        super().__init__(scope, construct_id)
        self.access_logs = s3.Bucket(
            self,
            "AccessLogs",
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            lifecycle_rules=[
                s3.LifecycleRule(id="expire-access-logs", expiration=Duration.days(settings.access_log_days))
            ],
            removal_policy=RemovalPolicy.RETAIN,
        )
        acknowledge(
            self.access_logs,
            "AwsSolutions-S1",
            "This bucket is the access-log destination of the checkpoint bucket; logging it to itself would loop.",
        )

        lifecycle = [
            s3.LifecycleRule(id="abort-incomplete-uploads", abort_incomplete_multipart_upload_after=Duration.days(1)),
            s3.LifecycleRule(
                id="expire-replaced-versions",
                noncurrent_version_expiration=Duration.days(settings.noncurrent_version_days),
                expired_object_delete_marker=True,
            ),
        ]
        if settings.checkpoint_expiry_days:
            # Chunks are shared between checkpoints, so this is only safe for jobs shorter than the expiry.
            lifecycle.append(
                s3.LifecycleRule(
                    id="expire-old-checkpoints",
                    prefix=JOBS_PREFIX,
                    expiration=Duration.days(settings.checkpoint_expiry_days),
                )
            )
        self.checkpoint_key = self._checkpoint_key(settings)
        self.bucket = s3.Bucket(
            self,
            "Checkpoints",
            encryption=s3.BucketEncryption.KMS if self.checkpoint_key else s3.BucketEncryption.S3_MANAGED,
            encryption_key=self.checkpoint_key,
            # One data key per bucket for a while, not one KMS request per object: a checkpoint writes thousands.
            bucket_key_enabled=True if self.checkpoint_key else None,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            versioned=True,
            server_access_logs_bucket=self.access_logs,
            server_access_logs_prefix="checkpoints/",
            lifecycle_rules=lifecycle,
            removal_policy=RemovalPolicy.RETAIN,
        )

        self.file_system: efs.FileSystem | None = None
        if settings.efs:
            efs_security_group = ec2.SecurityGroup(
                self,
                "EfsSecurityGroup",
                vpc=network.vpc,
                description="spotcr EFS: NFS from job VMs only",
                allow_all_outbound=False,
            )
            efs_security_group.add_ingress_rule(
                network.job_security_group, ec2.Port.tcp(NFS_PORT), "NFS from spotcr job VMs"
            )
            self.file_system = efs.FileSystem(
                self,
                "Efs",
                vpc=network.vpc,
                vpc_subnets=network.subnet_selection,
                security_group=efs_security_group,
                encrypted=True,
                throughput_mode=efs.ThroughputMode.ELASTIC,
                performance_mode=efs.PerformanceMode.GENERAL_PURPOSE,
                removal_policy=RemovalPolicy.RETAIN,
                file_system_policy=isolating_file_system_policy() if settings.efs_isolation else None,
                # True: CDK adds no Allow of its own to any IAM principal. Without efs_isolation EFS's default policy
                # stays (plain NFS mounts work); with it, the policy above allows no anonymous client.
                allow_anonymous_access=True,
            )

        self.lustre: fsx.LustreFileSystem | None = None
        if settings.fsx is not None:
            lustre_security_group = ec2.SecurityGroup(
                self,
                "FsxSecurityGroup",
                vpc=network.vpc,
                description="spotcr FSx for Lustre: Lustre from job VMs and between the file servers",
                allow_all_outbound=False,
            )
            for peer in (network.job_security_group, lustre_security_group):
                lustre_security_group.add_ingress_rule(peer, ec2.Port.tcp(LUSTRE_PORT), "Lustre")
                lustre_security_group.add_ingress_rule(peer, ec2.Port.tcp_range(*LUSTRE_PORTS), "Lustre")
            lustre_security_group.add_egress_rule(lustre_security_group, ec2.Port.tcp(LUSTRE_PORT), "Lustre")
            lustre_security_group.add_egress_rule(lustre_security_group, ec2.Port.tcp_range(*LUSTRE_PORTS), "Lustre")
            persistent = settings.fsx == "PERSISTENT_2"
            self.lustre = fsx.LustreFileSystem(
                self,
                "Fsx",
                vpc=network.vpc,
                # Lustre lives in one subnet; VMs in other zones mount it across zones.
                vpc_subnet=network.subnets[0],
                security_group=lustre_security_group,
                storage_capacity_gib=settings.fsx_storage_gib,
                file_system_type_version=fsx.FileSystemTypeVersion.V_2_15,
                lustre_configuration=fsx.LustreConfiguration(
                    deployment_type=fsx.LustreDeploymentType.PERSISTENT_2
                    if persistent
                    else fsx.LustreDeploymentType.SCRATCH_2,
                    per_unit_storage_throughput=125 if persistent else None,
                    data_compression_type=fsx.LustreDataCompressionType.LZ4,
                ),
                removal_policy=RemovalPolicy.RETAIN if persistent else RemovalPolicy.DESTROY,
            )

    def _checkpoint_key(self, settings: Settings) -> kms.IKey | None:
        """The checkpoint bucket's KMS key (setting checkpoint_key). A key the stack creates has CDK's default key
        policy, the account's root with every action, so IAM policies alone grant its use (the roles' grants in
        infra/grants.py); it is kept when the stack is deleted, as the bucket is, or its objects could not be read."""
        if settings.checkpoint_key is None:
            return None
        if settings.checkpoint_key != CREATE_KEY:
            return kms.Key.from_key_arn(self, "CheckpointKey", settings.checkpoint_key)
        return kms.Key(
            self,
            "CheckpointKey",
            description="spotcr checkpoints (S3 SSE-KMS with bucket keys)",
            enable_key_rotation=True,
            removal_policy=RemovalPolicy.RETAIN,
        )
