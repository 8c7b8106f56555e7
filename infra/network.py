"""Where job VMs run: an existing VPC named in context, or a small one with public subnets and no NAT."""

from __future__ import annotations

from aws_cdk import RemovalPolicy
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_logs as logs
from constructs import Construct

from infra.settings import Settings


class Network(Construct):
    """The VPC, the subnets job VMs (and EFS/FSx mount targets) use, and the job security group."""

    def __init__(self, scope: Construct, construct_id: str, *, settings: Settings) -> None:
        super().__init__(scope, construct_id)
        self.vpc: ec2.IVpc
        if settings.vpc_id is not None:
            # Ids come from context so that synth never needs credentials for a lookup.
            self.vpc = ec2.Vpc.from_vpc_attributes(
                self,
                "Vpc",
                vpc_id=settings.vpc_id,
                availability_zones=list(settings.availability_zones),
                public_subnet_ids=list(settings.subnet_ids),
            )
            self.subnets = list(self.vpc.public_subnets)
        else:
            # Public subnets and no NAT gateway: nothing bills while no job runs; VMs reach AWS APIs directly.
            vpc = ec2.Vpc(
                self,
                "Vpc",
                max_azs=settings.max_azs,
                nat_gateways=0,
                subnet_configuration=[
                    ec2.SubnetConfiguration(name="jobs", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=20)
                ],
                restrict_default_security_group=False,
            )
            flow_logs = logs.LogGroup(
                self,
                "FlowLogs",
                retention=settings.log_retention,
                removal_policy=RemovalPolicy.DESTROY,
            )
            vpc.add_flow_log("FlowLog", destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_logs))
            self.vpc = vpc
            self.subnets = list(vpc.public_subnets)

        self.job_security_group = ec2.SecurityGroup(
            self,
            "JobSecurityGroup",
            vpc=self.vpc,
            description="spotcr job VMs: no inbound traffic, outbound to AWS APIs and the job endpoints",
            allow_all_outbound=True,
        )

    @property
    def subnet_selection(self) -> ec2.SubnetSelection:
        return ec2.SubnetSelection(subnets=self.subnets)
