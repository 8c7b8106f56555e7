"""What a job VM is launched with: its role and profile, the agent asset, the SSM documents, the launch template."""

from __future__ import annotations

import tempfile
from pathlib import Path

import jsii
from aws_cdk import Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_events as events
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3_assets as s3_assets
from aws_cdk import aws_ssm as ssm
from constructs import Construct
from spotcr_contracts import commands
from spotcr_contracts.settings import VmSettings
from spotcr_functions import store_access

from infra import grants
from infra.agent_bundle import BOOTSTRAP_SCRIPT, render_user_data, stage_agent_bundle
from infra.nag import acknowledge, acknowledge_wildcard_resource
from infra.network import Network
from infra.settings import GPU_IMAGE_PARAMETER, Settings
from infra.storage import Storage
from infra.store_access import Later

REPO_ROOT = Path(__file__).resolve().parent.parent
ROOT_DEVICE = "/dev/xvda"  # Debian 12 AMIs boot from xvda
GPU_IMAGE_ROOT_DEVICE = "/dev/sda1"  # Ubuntu AMIs, the Deep Learning ones included, boot from sda1


@jsii.implements(ec2.IMachineImage)
class _FixedImage:
    """An AMI id from context, used as is in every region the template is deployed to."""

    def __init__(self, image_id: str) -> None:
        self.image_id = image_id

    def get_image(self, scope: Construct) -> ec2.MachineImageConfig:
        return ec2.MachineImageConfig(
            image_id=self.image_id, os_type=ec2.OperatingSystemType.LINUX, user_data=ec2.UserData.for_linux()
        )


def job_image(settings: Settings) -> ec2.IMachineImage:
    if settings.ami_id is not None:
        return _FixedImage(settings.ami_id)
    if settings.gpu_image:
        # Resolved at deploy time too: the newest Deep Learning Base GPU AMI, NVIDIA driver r580 or later.
        return ec2.MachineImage.from_ssm_parameter(GPU_IMAGE_PARAMETER, os=ec2.OperatingSystemType.LINUX)
    # Debian publishes this public parameter; CloudFormation resolves it at deploy time, never at synth.
    return ec2.MachineImage.from_ssm_parameter(
        f"/aws/service/debian/release/12/latest/{settings.vm_architecture}", os=ec2.OperatingSystemType.LINUX
    )


class VmLaunch(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        settings: Settings,
        network: Network,
        storage: Storage,
        agent_bus: events.IEventBus,
        bootstrap_script: Path = BOOTSTRAP_SCRIPT,
    ) -> None:
        super().__init__(scope, construct_id)

        staged = stage_agent_bundle(Path(tempfile.mkdtemp(prefix="spotcr-agent-")), settings.vm_architecture)
        self.agent_asset = s3_assets.Asset(self, "AgentBundle", path=str(staged))

        self.job_role = iam.Role(
            self,
            "JobRole",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description="spotcr job VMs: SSM commands, the job's checkpoints, agent events",
        )
        self._grant_ssm_agent()
        self._grant_job_storage(storage)
        # The agent on the VM reads the job spec its spotcr:spec tag names; no function does.
        grants.apply(self.job_role, [grants.job_specs(storage.bucket.bucket_name, settings.job_spec_buckets)])
        checkpoint_key = storage.checkpoint_key.key_arn if storage.checkpoint_key else None
        grants.apply(
            self.job_role,
            grants.checkpoint_key(storage.bucket.bucket_arn, checkpoint_key, store_access.KEY_READ_ACTIONS),
        )
        self.job_role.add_to_principal_policy(
            iam.PolicyStatement(
                actions=["s3:GetObject"],
                resources=[self.agent_asset.bucket.arn_for_objects(self.agent_asset.s3_object_key)],
            )
        )
        self.job_role.add_to_principal_policy(
            iam.PolicyStatement(actions=["events:PutEvents"], resources=[agent_bus.event_bus_arn])
        )
        self.instance_profile = iam.InstanceProfile(self, "JobInstanceProfile", role=self.job_role)

        # The store-credentials function URL, set by the stack once the function exists.
        self.store_credentials_url = Later("the store-credentials function URL")

        self.documents: dict[str, ssm.CfnDocument] = {}
        for command in commands.COMMANDS.values():
            self.documents[command.name] = ssm.CfnDocument(
                self,
                f"Document-{command.name}",
                name=f"{settings.stack_name}-{command.name}",
                document_type="Command",
                document_format="JSON",
                content=command.document(),
                update_method="NewVersion",
            )

        placeholders = VmSettings(
            agent_asset_url=self.agent_asset.s3_object_url,
            bucket=storage.bucket.bucket_name,
            event_bus=agent_bus.event_bus_name,
            efs_id=storage.file_system.file_system_id if storage.file_system else "",
            efs_isolation=settings.efs and settings.efs_isolation,
            fsx_dns=storage.lustre.dns_name if storage.lustre else "",
            fsx_mount_name=storage.lustre.mount_name if storage.lustre else "",
            store_credentials_url=self.store_credentials_url.token(),
        ).placeholders()
        user_data = ec2.UserData.custom(render_user_data(bootstrap_script.read_text(), placeholders))
        self.launch_template = ec2.LaunchTemplate(
            self,
            "JobLaunchTemplate",
            launch_template_name=f"{settings.stack_name}-job",
            machine_image=job_image(settings),
            user_data=user_data,
            instance_profile=self.instance_profile,
            security_group=network.job_security_group,
            require_imdsv2=True,
            http_tokens=ec2.LaunchTemplateHttpTokens.REQUIRED,
            http_put_response_hop_limit=settings.metadata_hop_limit,
            instance_metadata_tags=True,
            block_devices=[
                ec2.BlockDevice(
                    device_name=GPU_IMAGE_ROOT_DEVICE if settings.gpu_image else ROOT_DEVICE,
                    volume=ec2.BlockDeviceVolume.ebs(
                        settings.job_root_volume_gib,
                        volume_type=ec2.EbsDeviceVolumeType.GP3,
                        encrypted=True,
                        delete_on_termination=True,
                    ),
                )
            ],
        )

    def _grant_ssm_agent(self) -> None:
        """What SSM Agent needs for Run Command (a subset of AmazonSSMManagedInstanceCore: no State Manager,
        inventory, patching or Session Manager data channels), and the agent's readiness check."""
        instances = Stack.of(self).format_arn(service="ec2", resource="instance", resource_name="*")
        self.job_role.add_to_principal_policy(
            iam.PolicyStatement(
                sid="SsmAgentRegistration", actions=["ssm:UpdateInstanceInformation"], resources=[instances]
            )
        )
        acknowledge_wildcard_resource(
            self.job_role, instances, "SSM Agent registers the instance it runs on; the role is shared by job VMs."
        )
        self.job_role.add_to_principal_policy(
            iam.PolicyStatement(
                sid="SsmAgentRunCommand",
                actions=[
                    "ec2messages:AcknowledgeMessage",
                    "ec2messages:DeleteMessage",
                    "ec2messages:FailMessage",
                    "ec2messages:GetEndpoint",
                    "ec2messages:GetMessages",
                    "ec2messages:SendReply",
                    "ssmmessages:CreateControlChannel",
                    "ssmmessages:OpenControlChannel",
                    "ssm:DescribeInstanceInformation",
                ],
                resources=["*"],
            )
        )
        acknowledge(
            self.job_role,
            "AwsSolutions-IAM5[Resource::*]",
            "SSM Agent's message calls (ec2messages, the ssmmessages control channel) and "
            "ssm:DescribeInstanceInformation support no resource-level permissions; with the registration above they "
            "are the Run Command part of AmazonSSMManagedInstanceCore.",
        )

    def _grant_job_storage(self, storage: Storage) -> None:
        # No grant on jobs/ here: the agent's store credentials come from the store-credentials function URL,
        # limited to its own job's prefix (infra/store_access.py).
        if storage.file_system is not None:
            self.job_role.add_to_principal_policy(
                iam.PolicyStatement(
                    actions=["elasticfilesystem:ClientMount", "elasticfilesystem:ClientWrite"],
                    resources=[storage.file_system.file_system_arn],
                )
            )
