"""The AWS FIS experiment templates behind `spotcr interrupt`, and the role FIS acts with."""

from __future__ import annotations

from aws_cdk import Stack
from aws_cdk import aws_fis as fis_
from aws_cdk import aws_iam as iam
from constructs import Construct
from spotcr_contracts import fis, tags

from infra.nag import acknowledge, acknowledge_wildcard_resource
from infra.settings import Settings


class FaultInjection(Construct):
    def __init__(self, scope: Construct, construct_id: str, *, settings: Settings) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("fis.amazonaws.com"),
            description=f"FIS interrupts a {settings.stack_name} job's spot instance for `spotcr interrupt`",
        )
        instances = f"arn:{stack.partition}:ec2:{stack.region}:{stack.account}:instance/*"
        self.role.add_to_principal_policy(
            iam.PolicyStatement(
                actions=["ec2:SendSpotInstanceInterruptions"],
                resources=[instances],
                conditions={"StringEquals": {f"aws:ResourceTag/{tags.INTERRUPT}": tags.INTERRUPT_REQUESTED}},
            )
        )
        acknowledge_wildcard_resource(
            self.role,
            instances,
            f"Only instances tagged {tags.INTERRUPT}={tags.INTERRUPT_REQUESTED} (the condition), which `spotcr "
            "interrupt` sets on one job's instance for the time FIS takes to resolve its targets.",
        )
        self.role.add_to_principal_policy(iam.PolicyStatement(actions=["ec2:DescribeInstances"], resources=["*"]))
        acknowledge(
            self.role,
            "AwsSolutions-IAM5[Resource::*]",
            "ec2:DescribeInstances has no resource-level permissions; FIS resolves the tagged target with it.",
        )
        self.templates: dict[str, fis_.CfnExperimentTemplate] = {}
        for kind in fis.OUTPUTS:
            document = fis.template(kind, self.role.role_arn)
            target = document["targets"][fis.TARGET]
            action = document["actions"]["interrupt"]
            self.templates[kind] = fis_.CfnExperimentTemplate(
                self,
                f"Template-{kind}",
                description=document["description"],
                role_arn=document["roleArn"],
                stop_conditions=[fis_.CfnExperimentTemplate.ExperimentTemplateStopConditionProperty(source="none")],
                targets={
                    fis.TARGET: fis_.CfnExperimentTemplate.ExperimentTemplateTargetProperty(
                        resource_type=target["resourceType"],
                        selection_mode=target["selectionMode"],
                        resource_tags=target["resourceTags"],
                        filters=[
                            fis_.CfnExperimentTemplate.ExperimentTemplateTargetFilterProperty(
                                path=f["path"], values=f["values"]
                            )
                            for f in target["filters"]
                        ],
                    )
                },
                actions={
                    "interrupt": fis_.CfnExperimentTemplate.ExperimentTemplateActionProperty(
                        action_id=action["actionId"], parameters=action["parameters"], targets=action["targets"]
                    )
                },
                tags={**document["tags"], "Name": f"{settings.stack_name}-{kind}"},
            )
