"""Where job VMs run: an existing VPC named in context, or a small one with public subnets and no NAT.

With private_subnets the job VMs' subnets have no route to the internet, so the stack adds the VPC endpoints of
every AWS service a job VM calls at boot and while it runs (VPC_ENDPOINTS); nothing else is reached.
"""

from __future__ import annotations

from aws_cdk import RemovalPolicy
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_logs as logs
from constructs import Construct

from infra.settings import Settings

# What a job VM calls, each through its own endpoint in private subnets: SSM Agent (ssm, ssmmessages, ec2messages),
# the agent's events (events), store credentials from the private API (execute-api); S3 (the SSM Agent package, the
# agent asset, checkpoints) through the gateway endpoint.
VPC_ENDPOINTS = {
    "Ssm": ec2.InterfaceVpcEndpointAwsService.SSM,
    "SsmMessages": ec2.InterfaceVpcEndpointAwsService.SSM_MESSAGES,
    "Ec2Messages": ec2.InterfaceVpcEndpointAwsService.EC2_MESSAGES,
    "Events": ec2.InterfaceVpcEndpointAwsService.EVENTBRIDGE,
    "ExecuteApi": ec2.InterfaceVpcEndpointAwsService.APIGATEWAY,
}


class Network(Construct):
    """The VPC, the subnets job VMs (and EFS/FSx mount targets) use, and the job security group."""

    def __init__(self, scope: Construct, construct_id: str, *, settings: Settings) -> None:
        super().__init__(scope, construct_id)
        self.vpc: ec2.IVpc
        self.private = settings.private_subnets
        if settings.vpc_id is not None:
            # Ids come from context so that synth never needs credentials for a lookup.
            subnet_ids, route_table_ids = list(settings.subnet_ids), list(settings.route_table_ids)
            self.vpc = ec2.Vpc.from_vpc_attributes(
                self,
                "Vpc",
                vpc_id=settings.vpc_id,
                availability_zones=list(settings.availability_zones),
                public_subnet_ids=None if self.private else subnet_ids,
                isolated_subnet_ids=subnet_ids if self.private else None,
                isolated_subnet_route_table_ids=route_table_ids if self.private else None,
            )
            self.subnets = list(self.vpc.isolated_subnets if self.private else self.vpc.public_subnets)
        else:
            # No NAT gateway: nothing bills while no job runs. Public subnets reach AWS APIs directly; private ones
            # through the endpoints below (which bill by the hour).
            vpc = ec2.Vpc(
                self,
                "Vpc",
                max_azs=settings.max_azs,
                nat_gateways=0,
                subnet_configuration=[
                    ec2.SubnetConfiguration(
                        name="jobs",
                        subnet_type=ec2.SubnetType.PRIVATE_ISOLATED if self.private else ec2.SubnetType.PUBLIC,
                        cidr_mask=20,
                    )
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
            self.subnets = list(vpc.isolated_subnets if self.private else vpc.public_subnets)

        self.job_security_group = ec2.SecurityGroup(
            self,
            "JobSecurityGroup",
            vpc=self.vpc,
            description="spotcr job VMs: no inbound traffic, outbound to AWS APIs and the job endpoints",
            allow_all_outbound=True,
        )
        self.endpoints: dict[str, ec2.InterfaceVpcEndpoint] = {}
        if self.private:
            self._add_endpoints()

    def _add_endpoints(self) -> None:
        self.vpc.add_gateway_endpoint(
            "S3Endpoint", service=ec2.GatewayVpcEndpointAwsService.S3, subnets=[self.subnet_selection]
        )
        endpoint_group = ec2.SecurityGroup(
            self,
            "EndpointSecurityGroup",
            vpc=self.vpc,
            description="spotcr VPC endpoints: HTTPS from job VMs only",
            allow_all_outbound=False,
        )
        endpoint_group.add_ingress_rule(self.job_security_group, ec2.Port.tcp(443), "HTTPS from job VMs")
        for name, service in VPC_ENDPOINTS.items():
            self.endpoints[name] = self.vpc.add_interface_endpoint(
                f"{name}Endpoint",
                service=service,
                # Private DNS: the VMs use each service's usual name, so nothing on the VM changes.
                private_dns_enabled=True,
                subnets=ec2.SubnetSelection(subnets=self.subnets, one_per_az=True),
                security_groups=[endpoint_group],
                open=False,
            )

    @property
    def subnet_selection(self) -> ec2.SubnetSelection:
        return ec2.SubnetSelection(subnets=self.subnets)
