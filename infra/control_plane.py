"""The control plane: the job registry, the agent's event bus, the failure topic, and the Lambda functions.

Functions, their rules and their grants are built from spotcr_functions.catalog.FUNCTIONS, so a function
added there is deployed, triggered and granted without touching this file.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aws_cdk import Aws, Duration, RemovalPolicy
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from aws_cdk import aws_sqs as sqs
from aws_cdk import aws_ssm as ssm
from constructs import Construct
from spotcr_contracts.settings import FunctionSettings
from spotcr_functions import catalog, registry_schema

from infra import grants
from infra.nag import acknowledge
from infra.settings import POWERTOOLS_LAYER_ACCOUNT, POWERTOOLS_LAYER_NAME, Settings

REPO_ROOT = Path(__file__).resolve().parent.parent
FUNCTIONS_DIR = REPO_ROOT / "functions"
METRICS_NAMESPACE = "spotcr"
SERVICE_NAME = "spotcr"
# The Lambda runtime is fixed by the team (catalog and the public Powertools layer both target it).
RUNTIME = lambda_.Runtime.PYTHON_3_12
EVENT_MAX_AGE = Duration.hours(1)
EVENT_RETRIES = 4

_ATTRIBUTE_TYPES = {
    "S": dynamodb.AttributeType.STRING,
    "N": dynamodb.AttributeType.NUMBER,
    "B": dynamodb.AttributeType.BINARY,
}


def _attribute(name: str) -> dynamodb.Attribute:
    return dynamodb.Attribute(name=name, type=_ATTRIBUTE_TYPES[registry_schema.ATTRIBUTE_TYPES[name]])


def event_pattern(pattern: Mapping[str, Any]) -> events.EventPattern:
    """The catalog's pattern (EventBridge JSON keys) as a CDK EventPattern, key for key."""
    allowed = {"version", "id", "detail-type", "source", "account", "time", "region", "resources", "detail"}
    unknown = set(pattern) - allowed
    if unknown:
        raise ValueError(f"event pattern has keys EventBridge does not match on: {', '.join(sorted(unknown))}")
    return events.EventPattern(**{key.replace("-", "_"): value for key, value in pattern.items()})


class Registry(Construct):
    """State the functions and the workflow share: the job table, idempotency, the bus, the topic, the DLQ."""

    def __init__(self, scope: Construct, construct_id: str, *, settings: Settings) -> None:
        super().__init__(scope, construct_id)
        self.jobs_table = dynamodb.Table(
            self,
            "Jobs",
            partition_key=_attribute(registry_schema.PARTITION_KEY),
            billing_mode=dynamodb.BillingMode.PAY_PER_REQUEST,
            point_in_time_recovery_specification=dynamodb.PointInTimeRecoverySpecification(
                point_in_time_recovery_enabled=True
            ),
            encryption=dynamodb.TableEncryption.AWS_MANAGED,
            removal_policy=RemovalPolicy.RETAIN,
        )
        for index in registry_schema.INDEXES:
            self.jobs_table.add_global_secondary_index(
                index_name=index.name,
                partition_key=_attribute(index.partition_key),
                sort_key=_attribute(index.sort_key) if index.sort_key else None,
                projection_type=dynamodb.ProjectionType.ALL,
            )
        self.jobs_index_names = tuple(index.name for index in registry_schema.INDEXES)

        self.idempotency_table = dynamodb.Table(
            self,
            "Idempotency",
            partition_key=dynamodb.Attribute(
                name=registry_schema.IDEMPOTENCY_PARTITION_KEY, type=dynamodb.AttributeType.STRING
            ),
            time_to_live_attribute=registry_schema.IDEMPOTENCY_TTL_ATTRIBUTE,
            billing_mode=dynamodb.BillingMode.PAY_PER_REQUEST,
            point_in_time_recovery_specification=dynamodb.PointInTimeRecoverySpecification(
                point_in_time_recovery_enabled=True
            ),
            encryption=dynamodb.TableEncryption.AWS_MANAGED,
            removal_policy=RemovalPolicy.DESTROY,
        )

        self.agent_bus = events.EventBus(self, "AgentBus", event_bus_name=f"{settings.stack_name}-agent-events")

        # A customer key, because CloudWatch alarms cannot publish to a topic under the AWS-managed SNS key.
        self.topic_key = kms.Key(
            self,
            "FailureTopicKey",
            description="spotcr failure topic encryption",
            enable_key_rotation=True,
            removal_policy=RemovalPolicy.DESTROY,
        )
        self.topic_key.add_to_resource_policy(
            iam.PolicyStatement(
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["kms:Decrypt", "kms:GenerateDataKey"],
                resources=["*"],
                conditions={"StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID}},
            )
        )
        self.failure_topic = sns.Topic(
            self,
            "FailureTopic",
            display_name="spotcr failures",
            master_key=self.topic_key,
            enforce_ssl=True,
        )
        if settings.alarm_email:
            self.failure_topic.add_subscription(subscriptions.EmailSubscription(settings.alarm_email))

        # Events EventBridge could not deliver and invocations that failed every retry land here.
        self.dead_letters = sqs.Queue(
            self,
            "DeadLetters",
            encryption=sqs.QueueEncryption.SQS_MANAGED,
            enforce_ssl=True,
            retention_period=Duration.days(14),
        )
        acknowledge(
            self.dead_letters,
            "AwsSolutions-SQS3",
            "This queue is itself the dead-letter queue of the EventBridge targets and the Lambda functions.",
        )


@dataclass(frozen=True)
class FunctionEnvironment:
    """The settings every function receives (spotcr_contracts.settings), and Powertools' own."""

    settings: FunctionSettings

    def variables(self, function: catalog.Function) -> dict[str, str]:
        settings = self.settings
        if function.function_url:
            # Its URL is in the launch template's user data, so its settings cannot name the template (a cycle).
            settings = replace(settings, launch_template_id="", launch_template_version="")
        return {
            **settings.to_env(),
            "POWERTOOLS_SERVICE_NAME": SERVICE_NAME,
            "POWERTOOLS_METRICS_NAMESPACE": METRICS_NAMESPACE,
        }


class Functions(Construct):
    """One Lambda function per catalog entry, each with its own role, log group, rules and grants."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        settings: Settings,
        registry: Registry,
        environment: FunctionEnvironment,
        grant_targets: grants.GrantTargets,
    ) -> None:
        super().__init__(scope, construct_id)
        self._state_machine_arn = grant_targets.state_machine_arn
        code = lambda_.Code.from_asset(
            str(FUNCTIONS_DIR),
            exclude=["**/__pycache__", "**/*.pyc", "**/.mypy_cache", "**/.pytest_cache", "**/tests", "*.txt"],
        )
        layer = lambda_.LayerVersion.from_layer_version_arn(self, "Powertools", _powertools_layer_arn(self, settings))
        self.functions: dict[str, lambda_.Function] = {}
        self.log_groups: dict[str, logs.LogGroup] = {}
        self.rules: dict[str, events.Rule] = {}
        for spec in catalog.FUNCTIONS:
            scope_ = Construct(self, spec.name)
            log_group = logs.LogGroup(
                scope_, "Logs", retention=settings.log_retention, removal_policy=RemovalPolicy.DESTROY
            )
            role = iam.Role(
                scope_,
                "Role",
                assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
                description=f"spotcr {spec.name} function: {', '.join(spec.capabilities)}",
            )
            # The log group's Arn ends in ":*", which covers the streams Lambda names at run time.
            role.add_to_principal_policy(
                iam.PolicyStatement(
                    actions=["logs:CreateLogStream", "logs:PutLogEvents"], resources=[log_group.log_group_arn]
                )
            )
            grants.apply(role, grants.grants_for(spec.capabilities, grant_targets))
            function = lambda_.Function(
                scope_,
                "Function",
                description=spec.description,
                runtime=RUNTIME,
                architecture=lambda_.Architecture.ARM_64,
                handler=spec.handler,
                code=code,
                layers=[layer],
                role=role,
                timeout=Duration.seconds(spec.timeout_s),
                memory_size=spec.memory_mb,
                environment=environment.variables(spec),
                log_group=log_group,
                logging_format=lambda_.LoggingFormat.JSON,
                application_log_level_v2=lambda_.ApplicationLogLevel.INFO,
                system_log_level_v2=lambda_.SystemLogLevel.WARN,
                tracing=lambda_.Tracing.ACTIVE,
                dead_letter_queue=registry.dead_letters,
                retry_attempts=2,
                max_event_age=EVENT_MAX_AGE,
                reserved_concurrent_executions=(
                    settings.interruption_concurrency or None if spec.reserved_concurrency else None
                ),
            )
            acknowledge(
                function,
                "AwsSolutions-L1",
                "python3.12 is the team's fixed runtime: the public Powertools layer and the tests target it.",
            )
            acknowledge(
                role,
                "AwsSolutions-IAM5[Resource::*]",
                "X-Ray PutTraceSegments and PutTelemetryRecords (added for active tracing) have no resource-level "
                "permissions.",
            )
            self.functions[spec.name] = function
            self.log_groups[spec.name] = log_group
            for rule_spec in spec.rules:
                self.rules[rule_spec.name] = self._rule(scope_, rule_spec, function, registry)

    def _rule(
        self, scope: Construct, spec: catalog.Rule, function: lambda_.Function, registry: Registry
    ) -> events.Rule:
        target = targets.LambdaFunction(
            function,
            dead_letter_queue=registry.dead_letters,
            retry_attempts=EVENT_RETRIES,
            max_event_age=EVENT_MAX_AGE,
        )
        if spec.schedule_minutes is not None:
            return events.Rule(
                scope,
                f"Rule-{spec.name}",
                description=f"spotcr {spec.name}",
                schedule=events.Schedule.rate(Duration.minutes(spec.schedule_minutes)),
                targets=[target],
            )
        if spec.pattern is None:
            raise ValueError(f"rule {spec.name}: neither a pattern nor a schedule")
        return events.Rule(
            scope,
            f"Rule-{spec.name}",
            description=f"spotcr {spec.name}",
            event_bus=registry.agent_bus if spec.agent_bus else None,
            event_pattern=event_pattern(spec.pattern_for(self._state_machine_arn) or {}),
            targets=[target],
        )


def _powertools_layer_arn(scope: Construct, settings: Settings) -> str:
    """The layer of the Powertools release the functions are pinned to (functions/requirements.txt)."""
    if settings.powertools_layer_version is not None:
        return (
            f"arn:{Aws.PARTITION}:lambda:{Aws.REGION}:{POWERTOOLS_LAYER_ACCOUNT}:layer:"
            f"{POWERTOOLS_LAYER_NAME}:{settings.powertools_layer_version}"
        )
    release = importlib.metadata.version("aws-lambda-powertools")
    return ssm.StringParameter.value_for_string_parameter(
        scope, f"/aws/service/powertools/python/arm64/python3.12/{release}"
    )
