"""The synthesized template: what the catalog, the contracts and the issue ask for, resource by resource."""

from __future__ import annotations

import importlib.metadata
import json
import re
from typing import Any, cast

import aws_cdk as cdk
import pytest
from aws_cdk import aws_lambda as lambda_
from aws_cdk.assertions import Match
from cdk_nag import AwsSolutionsChecks
from spotcr_contracts import commands, tags
from spotcr_functions import catalog, config, registry_schema
from spotcr_functions.cloud import VOLUME_WAIT_SECONDS
from spotcr_functions.observability import Metric

from infra import grants
from infra.settings import POWERTOOLS_LAYER_NAME, InvalidSetting, Settings
from infra.workflow import RECOVERY_ASL, asl_variables
from tests.infra.conftest import REPO_ROOT, Synth
from tests.infra.support import SSM_AGENT_CHANNEL_ACTIONS, as_list, child, logical_id, reachable, statements_by_role

WAITER = "spotcr_functions.cloud.Cloud.wait_volume_available"
POWERTOOLS_RELEASE = importlib.metadata.version("aws-lambda-powertools")

# Actions allowed on Resource "*": their services offer no resource-level permissions.
STAR_RESOURCE_ACTIONS = {
    "xray:PutTraceSegments",
    "xray:PutTelemetryRecords",
    "ssm:GetCommandInvocation",
    "ssm:ListCommandInvocations",
    "ssm:DescribeInstanceInformation",
    *SSM_AGENT_CHANNEL_ACTIONS,
    "ec2:DescribeInstances",
    "ec2:DescribeTags",
    "ec2:DescribeInstanceTypes",
    "ec2:DescribeSubnets",
    "ec2:DescribeVolumes",
    "ec2:DescribeSnapshots",
    "ec2:DescribeImages",
    "logs:CreateLogDelivery",
    "logs:GetLogDelivery",
    "logs:UpdateLogDelivery",
    "logs:DeleteLogDelivery",
    "logs:ListLogDeliveries",
    "logs:PutResourcePolicy",
    "logs:DescribeResourcePolicies",
    "logs:DescribeLogGroups",
    "xray:GetSamplingRules",
    "xray:GetSamplingTargets",
}


def _flat(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def function_role(synth: Synth, name: str) -> str:
    function = cast(lambda_.Function, child(synth, "Functions", name, "Function"))
    assert function.role is not None
    return logical_id(synth, function.role)


def statements_with(statements: list[dict[str, Any]], action: str) -> list[dict[str, Any]]:
    return [s for s in statements if action in as_list(s["Action"])]


def test_nag_reports_no_unacknowledged_finding(default_synth: Synth, custom_synth: Synth) -> None:
    # Given both configurations synthesized (synth itself fails on a finding)
    for synth in (default_synth, custom_synth):
        # When AwsSolutions checks the whole app again
        report = AwsSolutionsChecks().validate_scope(synth.app)
        # Then nothing is left unacknowledged
        assert report.success, [v.rule_name for v in report.violations]
        assert list(report.violations) == []


def catalog_functions(synth: Synth) -> dict[str, Any]:
    """The catalog's functions (CDK's AwsCustomResource provider, which runs at deploy time only, left out)."""
    handlers = {f.handler for f in catalog.FUNCTIONS}
    functions = synth.of_type("AWS::Lambda::Function").items()
    return {k: v for k, v in functions if v["Properties"]["Handler"] in handlers}


def test_a_named_powertools_layer_version_replaces_the_ssm_lookup(custom_synth: Synth) -> None:
    layers = {_flat(f["Properties"]["Layers"]) for f in catalog_functions(custom_synth).values()}
    assert len(layers) == 1
    assert f"017000801446:layer:{POWERTOOLS_LAYER_NAME}:52" in layers.pop()


def test_every_catalog_function_is_deployed_as_specified(default_synth: Synth) -> None:
    functions = default_synth.of_type("AWS::Lambda::Function")
    by_handler = {f["Properties"]["Handler"]: f["Properties"] for f in functions.values()}
    assert set(by_handler) - {"index.handler"} == {f.handler for f in catalog.FUNCTIONS}
    for spec in catalog.FUNCTIONS:
        props = by_handler[spec.handler]
        assert props["Runtime"] == "python3.12"
        assert props["Architectures"] == ["arm64"]
        assert props["Timeout"] == spec.timeout_s
        # By default nothing is reserved: Lambda keeps 100 unreserved, so a small account's quota would fail it.
        assert "ReservedConcurrentExecutions" not in props
        assert props["MemorySize"] == spec.memory_mb
        assert props["TracingConfig"] == {"Mode": "Active"}
        assert props["LoggingConfig"]["LogFormat"] == "JSON"
        assert "LogGroup" in props["LoggingConfig"]
        assert len(props["Layers"]) == 1 and "Ref" in props["Layers"][0]
        layer_parameter = default_synth.template.to_json()["Parameters"][props["Layers"][0]["Ref"]]
        assert layer_parameter["Type"] == "AWS::SSM::Parameter::Value<String>"
        assert layer_parameter["Default"] == f"/aws/service/powertools/python/arm64/python3.12/{POWERTOOLS_RELEASE}"
        variables = props["Environment"]["Variables"]
        # Every setting of the model, and nothing the model does not name (Powertools' own aside).
        assert set(variables) == set(config.ENV.values()) | {"POWERTOOLS_SERVICE_NAME", "POWERTOOLS_METRICS_NAMESPACE"}
        assert variables["POWERTOOLS_SERVICE_NAME"] == "spotcr"
        assert variables["POWERTOOLS_METRICS_NAMESPACE"] == "spotcr"


def test_interruption_concurrency_reserves_for_the_interruption_function_only(custom_synth: Synth) -> None:
    functions = custom_synth.of_type("AWS::Lambda::Function").values()
    reserved = {f["Properties"]["Handler"]: f["Properties"].get("ReservedConcurrentExecutions") for f in functions}
    assert {h: n for h, n in reserved.items() if n is not None} == {catalog.by_name("interruption").handler: 5}


def test_function_log_groups_have_retention(default_synth: Synth) -> None:
    groups = default_synth.of_type("AWS::Logs::LogGroup")
    assert groups
    assert all(group["Properties"].get("RetentionInDays") for group in groups.values())


def test_each_rule_pattern_equals_the_catalog(default_synth: Synth) -> None:
    rules = default_synth.of_type("AWS::Events::Rule")
    patterns = [r["Properties"].get("EventPattern") for r in rules.values()]
    schedules = [r["Properties"].get("ScheduleExpression") for r in rules.values()]
    bus_id = logical_id(default_synth, child(default_synth, "Registry", "AgentBus"))
    for spec in catalog.FUNCTIONS:
        for rule in spec.rules:
            if rule.schedule_minutes is not None:
                unit = "minute" if rule.schedule_minutes == 1 else "minutes"
                assert f"rate({rule.schedule_minutes} {unit})" in schedules
                continue
            # The recovery-ended rule names the stack's own state machine (spotcr-recovery), not every one.
            deployed = {
                id_: json.loads(
                    re.sub(
                        r'\{"Fn::Join": [^]]*\]\]\}',
                        lambda m: '"ARN"' if "spotcr-recovery" in m.group(0) else m.group(0),
                        json.dumps(r["Properties"].get("EventPattern")),
                    )
                )
                for id_, r in rules.items()
            }
            matching = [r for id_, r in rules.items() if deployed[id_] == rule.pattern_for("ARN")]
            assert matching, f"no rule with the pattern of {rule.name}: {patterns}"
            on_agent_bus = [r for r in matching if r["Properties"].get("EventBusName") == {"Ref": bus_id}]
            assert bool(on_agent_bus) == rule.agent_bus, rule.name
    assert len(rules) == sum(len(f.rules) for f in catalog.FUNCTIONS)


def test_rule_targets_retry_into_a_dead_letter_queue(default_synth: Synth) -> None:
    for rule in default_synth.of_type("AWS::Events::Rule").values():
        for target in rule["Properties"]["Targets"]:
            assert "DeadLetterConfig" in target
            assert target["RetryPolicy"]["MaximumRetryAttempts"] >= 1


def test_no_policy_grants_a_wildcard_action(default_synth: Synth, custom_synth: Synth) -> None:
    for synth in (default_synth, custom_synth):
        for role, statements in statements_by_role(synth).items():
            for statement in statements:
                for action in as_list(statement["Action"]):
                    assert "*" not in action, f"{role}: {action}"


def test_star_resources_only_for_actions_without_resource_permissions(default_synth: Synth) -> None:
    for role, statements in statements_by_role(default_synth).items():
        for statement in statements:
            if "*" in as_list(statement["Resource"]):
                extra = set(as_list(statement["Action"])) - STAR_RESOURCE_ACTIONS
                assert not extra, f"{role} gets {extra} on every resource"


def test_send_command_only_spotcr_documents_and_job_instances(default_synth: Synth) -> None:
    documents = {logical_id(default_synth, d) for d in default_synth.stack.node.find_all() if _is_document(d)}
    probe_id = logical_id(default_synth, default_synth.stack.node.find_child("Probe").node.find_child("Document"))
    document_ids = documents - {probe_id}  # the user's `spotcr probe` sends the probe document, no function does
    assert len(document_ids) == len(commands.COMMANDS) and probe_id in documents
    senders = [f for f in catalog.FUNCTIONS if catalog.SEND_COMMAND in f.capabilities]
    assert senders
    by_role = statements_by_role(default_synth)
    for spec in senders:
        statements = statements_with(by_role[function_role(default_synth, spec.name)], "ssm:SendCommand")
        for statement in statements:
            resources = as_list(statement["Resource"])
            if any(":instance/*" in _flat(r) for r in resources):
                assert statement["Condition"] == {"StringLike": {f"ssm:resourceTag/{tags.JOB}": "?*"}}
            else:
                refs = {"".join(re.findall(r'"Ref": "(VmLaunchDocument[^"]+)"', _flat(r))) for r in resources}
                assert refs == document_ids
                assert not any(probe_id in _flat(r) for r in resources)


def _is_document(construct: Any) -> bool:
    return getattr(construct, "cfn_resource_type", None) == "AWS::SSM::Document"


def test_run_instances_only_from_the_launch_template(default_synth: Synth) -> None:
    launchers = [f for f in catalog.FUNCTIONS if catalog.EC2_LAUNCH in f.capabilities]
    assert launchers
    job_role = logical_id(default_synth, child(default_synth, "VmLaunch", "JobRole"))
    by_role = statements_by_role(default_synth)
    for spec in launchers:
        statements = by_role[function_role(default_synth, spec.name)]
        for statement in statements_with(statements, "ec2:RunInstances"):
            resources = _flat(statement["Resource"])
            if ":launch-template/" in resources and "*" not in resources:
                continue
            assert "ec2:LaunchTemplate" in statement["Condition"]["ArnLike"]
        for statement in statements_with(statements, "ec2:CreateTags"):
            assert statement["Condition"] == {"StringEquals": {"ec2:CreateAction": ["RunInstances", "CreateFleet"]}}
        for statement in statements_with(statements, "iam:PassRole"):
            assert statement["Resource"] == {"Fn::GetAtt": [job_role, "Arn"]}
            assert statement["Condition"] == {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}


def test_tagging_instances_is_limited_to_the_tags_registering_writes(default_synth: Synth) -> None:
    taggers = [f for f in catalog.FUNCTIONS if catalog.EC2_TAG in f.capabilities]
    by_role = statements_by_role(default_synth)
    for spec in taggers:
        statements = statements_with(by_role[function_role(default_synth, spec.name)], "ec2:CreateTags")
        tag_statements = [s for s in statements if "aws:TagKeys" in _flat(s.get("Condition", {}))]
        assert tag_statements
        for statement in tag_statements:
            assert statement["Condition"]["ForAllValues:StringEquals"] == {"aws:TagKeys": [tags.RUN, tags.ERROR]}


def test_functions_that_move_volumes_may_read_volume_and_snapshot_states(default_synth: Synth) -> None:
    # move_volume and registration poll DescribeVolumes/DescribeSnapshots; without them AWS denies every step.
    by_role = statements_by_role(default_synth)
    for spec in (f for f in catalog.FUNCTIONS if catalog.EC2_VOLUMES in f.capabilities):
        statements = by_role[function_role(default_synth, spec.name)]
        for action in ("ec2:DescribeVolumes", "ec2:DescribeSnapshots"):
            assert statements_with(statements, action), (spec.name, action)


def test_workflow_starters_and_callbacks_target_the_recovery_state_machine(default_synth: Synth) -> None:
    by_role = statements_by_role(default_synth)
    for capability, action in (
        (catalog.START_RECOVERY, "states:StartExecution"),
        (catalog.TASK_CALLBACK, "states:SendTaskSuccess"),
    ):
        for spec in (f for f in catalog.FUNCTIONS if capability in f.capabilities):
            statements = statements_with(by_role[function_role(default_synth, spec.name)], action)
            assert statements, spec.name
            for statement in statements:
                assert _flat(statement["Resource"]).endswith(':stateMachine:spotcr-recovery"]]}')


def test_state_machine_substitutions_cover_the_asl(default_synth: Synth) -> None:
    machines = default_synth.of_type("AWS::StepFunctions::StateMachine")
    assert len(machines) == 1
    props = next(iter(machines.values()))["Properties"]
    assert set(props["DefinitionSubstitutions"]) >= asl_variables(RECOVERY_ASL)
    assert set(props["DefinitionSubstitutions"]) == set(catalog.WORKFLOW_SUBSTITUTIONS)
    assert props["StateMachineType"] == "STANDARD"
    assert props["LoggingConfiguration"]["Level"] == "ALL"
    assert props["TracingConfiguration"] == {"Enabled": True}
    assert "DefinitionS3Location" in props


def test_workflow_role_invokes_only_workflow_steps(default_synth: Synth) -> None:
    machine = next(iter(default_synth.of_type("AWS::StepFunctions::StateMachine").values()))
    role = machine["Properties"]["RoleArn"]["Fn::GetAtt"][0]
    invoke = statements_with(statements_by_role(default_synth)[role], "lambda:InvokeFunction")
    invoked = {r["Fn::GetAtt"][0] for s in invoke for r in as_list(s["Resource"])}
    steps = [f for f in catalog.FUNCTIONS if f.workflow_step]
    assert len(invoked) == len(steps)
    assert all(name.startswith("Functions") for name in invoked)


def test_backups_and_the_cli_launch_the_templates_latest_version(default_synth: Synth) -> None:
    # CloudFormation adds a version on each update and leaves $Default at 1: the number is passed on explicitly.
    [template_id] = default_synth.of_type("AWS::EC2::LaunchTemplate")
    latest = {"Fn::GetAtt": [template_id, "LatestVersionNumber"]}
    outputs = default_synth.template.to_json()["Outputs"]
    assert outputs["LaunchTemplateVersion"]["Value"] == latest
    launcher = logical_id(default_synth, child(default_synth, "Functions", "launch-backup", "Function"))
    variables = default_synth.resources[launcher]["Properties"]["Environment"]["Variables"]
    assert variables[config.ENV["launch_template_version"]] == latest


def test_launch_template_requires_imdsv2_with_tags_and_bootstrap(default_synth: Synth) -> None:
    templates = default_synth.of_type("AWS::EC2::LaunchTemplate")
    assert len(templates) == 1
    data = next(iter(templates.values()))["Properties"]["LaunchTemplateData"]
    assert data["MetadataOptions"]["HttpTokens"] == "required"
    assert data["MetadataOptions"]["InstanceMetadataTags"] == "enabled"
    assert data["MetadataOptions"]["HttpPutResponseHopLimit"] in (1, 2)
    user_data = _flat(data["UserData"])
    assert user_data.startswith('{"Fn::Base64"')
    assert "__SPOTCR_" not in user_data
    root = data["BlockDeviceMappings"][0]["Ebs"]
    assert root["Encrypted"] is True and root["VolumeType"] == "gp3"
    assert "IamInstanceProfile" in data and data["SecurityGroupIds"]
    # Debian's public parameter, resolved by CloudFormation at deploy time
    parameters = default_synth.template.to_json()["Parameters"]
    assert any(p.get("Default", "").startswith("/aws/service/debian/release/12/") for p in parameters.values())


def test_one_ssm_document_per_command(default_synth: Synth) -> None:
    documents = default_synth.of_type("AWS::SSM::Document")
    contents = {d["Properties"]["Content"]["mainSteps"][0]["name"]: d["Properties"] for d in documents.values()}
    assert set(contents) == {*commands.COMMANDS, commands.PROBE.name}
    for name, command in {**commands.COMMANDS, commands.PROBE.name: commands.PROBE}.items():
        assert contents[name]["DocumentType"] == "Command"
        assert contents[name]["Content"] == command.document()


def test_checkpoint_bucket_is_encrypted_private_tls_only_and_logged(default_synth: Synth) -> None:
    default_synth.template.has_resource_properties(
        "AWS::S3::Bucket",
        {
            "BucketEncryption": {
                "ServerSideEncryptionConfiguration": [{"ServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]
            },
            "PublicAccessBlockConfiguration": {
                "BlockPublicAcls": True,
                "BlockPublicPolicy": True,
                "IgnorePublicAcls": True,
                "RestrictPublicBuckets": True,
            },
            "LoggingConfiguration": Match.object_like({"LogFilePrefix": "checkpoints/"}),
            "LifecycleConfiguration": {
                "Rules": Match.array_with(
                    [Match.object_like({"AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1}})]
                )
            },
            "VersioningConfiguration": {"Status": "Enabled"},
        },
    )
    policies = default_synth.of_type("AWS::S3::BucketPolicy")
    assert len(policies) == 2
    for policy in policies.values():
        denies = [
            s
            for s in policy["Properties"]["PolicyDocument"]["Statement"]
            if s["Effect"] == "Deny" and s["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
        ]
        assert denies


def test_job_table_matches_the_registry_schema(default_synth: Synth) -> None:
    default_synth.template.has_resource_properties(
        "AWS::DynamoDB::Table",
        {
            "KeySchema": [{"AttributeName": registry_schema.PARTITION_KEY, "KeyType": "HASH"}],
            "BillingMode": "PAY_PER_REQUEST",
            "PointInTimeRecoverySpecification": {"PointInTimeRecoveryEnabled": True},
            "GlobalSecondaryIndexes": [
                Match.object_like({"IndexName": index.name}) for index in registry_schema.INDEXES
            ],
        },
    )
    default_synth.template.has_resource_properties(
        "AWS::DynamoDB::Table",
        {
            "KeySchema": [{"AttributeName": registry_schema.IDEMPOTENCY_PARTITION_KEY, "KeyType": "HASH"}],
            "TimeToLiveSpecification": {
                "AttributeName": registry_schema.IDEMPOTENCY_TTL_ATTRIBUTE,
                "Enabled": True,
            },
        },
    )


def test_failure_topic_is_encrypted_tls_only_and_alarms_publish_to_it(default_synth: Synth) -> None:
    topic_id, topic = next(iter(default_synth.of_type("AWS::SNS::Topic").items()))
    assert "KmsMasterKeyId" in topic["Properties"]
    policy = next(iter(default_synth.of_type("AWS::SNS::TopicPolicy").values()))
    assert any(
        s["Effect"] == "Deny" and s["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
        for s in policy["Properties"]["PolicyDocument"]["Statement"]
    )
    alarms = default_synth.of_type("AWS::CloudWatch::Alarm")
    names = {a["Properties"].get("MetricName") for a in alarms.values()}
    assert {"RecoveriesFailed", "CheckpointsOverdue", "ExecutionsFailed"} <= names
    assert all(a["Properties"]["AlarmActions"] == [{"Ref": topic_id}] for a in alarms.values())


def test_outputs_name_everything_a_user_needs(default_synth: Synth) -> None:
    outputs = default_synth.template.to_json()["Outputs"]
    assert {
        "CheckpointBucket",
        "JobTable",
        "AgentEventBus",
        "LaunchTemplateId",
        "RecoveryStateMachineArn",
        "JobInstanceProfile",
        "JobSubnets",
        "JobSecurityGroup",
    } <= set(outputs)


def test_default_network_is_two_public_subnets_without_nat(default_synth: Synth) -> None:
    assert len(default_synth.of_type("AWS::EC2::VPC")) == 1
    assert len(default_synth.of_type("AWS::EC2::Subnet")) == 2
    assert not default_synth.of_type("AWS::EC2::NatGateway")
    assert len(default_synth.of_type("AWS::EC2::FlowLog")) == 1
    assert not default_synth.of_type("AWS::EFS::FileSystem")
    assert not default_synth.of_type("AWS::FSx::FileSystem")
    group = next(iter(default_synth.of_type("AWS::EC2::SecurityGroup").values()))
    assert "SecurityGroupIngress" not in group["Properties"]


def test_existing_vpc_is_used_by_id_without_lookup(custom_synth: Synth) -> None:
    assert not custom_synth.of_type("AWS::EC2::VPC")
    assert not custom_synth.of_type("AWS::EC2::Subnet")
    outputs = custom_synth.template.to_json()["Outputs"]
    assert outputs["JobSubnets"]["Value"] == "subnet-0aaaaaaaaaaaaaaa1,subnet-0bbbbbbbbbbbbbbb2"
    data = next(iter(custom_synth.of_type("AWS::EC2::LaunchTemplate").values()))["Properties"]["LaunchTemplateData"]
    assert data["ImageId"] == "ami-0123456789abcdef0"


def test_efs_is_encrypted_elastic_and_open_to_job_vms_only(custom_synth: Synth) -> None:
    custom_synth.template.has_resource_properties(
        "AWS::EFS::FileSystem", {"Encrypted": True, "ThroughputMode": "elastic"}
    )
    assert len(custom_synth.of_type("AWS::EFS::MountTarget")) == 2
    ingress = custom_synth.of_type("AWS::EC2::SecurityGroupIngress")
    nfs = [i["Properties"] for i in ingress.values() if i["Properties"]["FromPort"] == 2049]
    assert len(nfs) == 1 and "SourceSecurityGroupId" in nfs[0]
    job_statements = [s for ss in statements_by_role(custom_synth).values() for s in ss]
    assert statements_with(job_statements, "elasticfilesystem:ClientMount")


def test_fsx_lustre_allows_lustre_ports_from_job_vms(custom_synth: Synth) -> None:
    custom_synth.template.has_resource_properties(
        "AWS::FSx::FileSystem",
        {"FileSystemType": "LUSTRE", "LustreConfiguration": Match.object_like({"DeploymentType": "PERSISTENT_2"})},
    )
    ports = {
        (i["Properties"]["FromPort"], i["Properties"]["ToPort"])
        for i in custom_synth.of_type("AWS::EC2::SecurityGroupIngress").values()
    }
    assert {(988, 988), (1018, 1023)} <= ports


def test_checkpoint_expiry_applies_to_job_objects_only(custom_synth: Synth) -> None:
    custom_synth.template.has_resource_properties(
        "AWS::S3::Bucket",
        {
            "LifecycleConfiguration": {
                "Rules": Match.array_with(
                    [Match.object_like({"Prefix": "jobs/", "ExpirationInDays": 60, "Status": "Enabled"})]
                )
            }
        },
    )


def test_dashboard_shows_every_metric_the_functions_emit(default_synth: Synth) -> None:
    emitted = {metric.value for metric in Metric}  # each emitted by a function: tests/infra/test_metrics.py
    dashboard = next(iter(default_synth.of_type("AWS::CloudWatch::Dashboard").values()))
    body = "".join(part for part in dashboard["Properties"]["DashboardBody"]["Fn::Join"][1] if isinstance(part, str))
    missing = {name for name in emitted if f'["spotcr","{name}","service","spotcr"' not in body}
    assert not missing, f"metrics not on the dashboard: {missing}"


def test_job_spec_buckets_are_granted_to_the_job_vms_not_to_functions(custom_synth: Synth) -> None:
    by_role = statements_by_role(custom_synth)
    job_role = logical_id(custom_synth, child(custom_synth, "VmLaunch", "JobRole"))
    reads = [_flat(s["Resource"]) for s in statements_with(by_role[job_role], "s3:GetObject")]
    assert any("my-job-specs/*" in r for r in reads)
    for spec in catalog.FUNCTIONS:
        assert not statements_with(by_role[function_role(custom_synth, spec.name)], "s3:GetObject"), spec.name


def test_only_the_launcher_may_run_instances_or_pass_the_job_role(default_synth: Synth) -> None:
    by_role = statements_by_role(default_synth)
    for spec in catalog.FUNCTIONS:
        statements = by_role[function_role(default_synth, spec.name)]
        escalating = statements_with(statements, "ec2:RunInstances") + statements_with(statements, "iam:PassRole")
        assert bool(escalating) == (spec.name == "launch-backup"), spec.name


def test_delete_snapshot_is_conditioned_on_the_snapshots_own_tag(default_synth: Synth) -> None:
    # DeleteSnapshot carries no request tags: a RequestTag condition could never match.
    deleters = [f for f in catalog.FUNCTIONS if catalog.EC2_VOLUMES in f.capabilities]
    by_role = statements_by_role(default_synth)
    for spec in deleters:
        [statement] = statements_with(by_role[function_role(default_synth, spec.name)], "ec2:DeleteSnapshot")
        assert statement["Condition"] == {"StringEquals": {f"aws:ResourceTag/{tags.STACK}": "spotcr"}}


def test_volumes_and_snapshots_are_moved_and_deleted_only_with_the_stacks_own_tag(default_synth: Synth) -> None:
    # spotcr:job is user-writable; spotcr:stack is written by the stack's roles only while creating (CreateAction)
    by_role = statements_by_role(default_synth)
    for spec in (f for f in catalog.FUNCTIONS if catalog.EC2_VOLUMES in f.capabilities):
        statements = by_role[function_role(default_synth, spec.name)]
        for action in ("ec2:AttachVolume", "ec2:DetachVolume", "ec2:DeleteVolume", "ec2:CreateSnapshot"):
            for statement in statements_with(statements, action):
                resources = _flat(statement["Resource"])
                conditions = statement["Condition"]
                if ":volume/" in resources:
                    assert conditions == {"StringEquals": {f"aws:ResourceTag/{tags.STACK}": "spotcr"}}, action
                elif ":snapshot/" in resources:
                    assert conditions["StringEquals"] == {f"aws:RequestTag/{tags.STACK}": "spotcr"}, action
                else:
                    assert ":instance/" in resources and ":volume/" not in resources, (spec.name, action)
        [create] = statements_with(statements, "ec2:CreateVolume")
        assert create["Condition"]["StringEquals"] == {f"aws:RequestTag/{tags.STACK}": "spotcr"}
        for statement in statements_with(statements, "ec2:CreateTags"):
            if ":volume/" in _flat(statement["Resource"]) or ":snapshot/" in _flat(statement["Resource"]):
                assert "ec2:CreateAction" in _flat(statement["Condition"]), spec.name


def test_functions_outlast_the_volume_waiter_they_may_run(default_synth: Synth) -> None:
    waiters = [f for f in catalog.FUNCTIONS if WAITER in reachable(f.handler)]
    assert {f.name for f in waiters} >= {"state-change", "tag-change", "agent-events"}
    timeouts = {
        p["Handler"]: p["Timeout"] for p in (f["Properties"] for f in catalog_functions(default_synth).values())
    }
    for spec in waiters:
        assert timeouts[spec.handler] >= VOLUME_WAIT_SECONDS + 10, spec.name


def test_functions_get_the_stacks_subnets(default_synth: Synth) -> None:
    subnets = {logical_id(default_synth, s) for s in default_synth.stack.node.find_all() if _is_subnet(s)}
    assert len(subnets) == 2
    for props in (f["Properties"] for f in catalog_functions(default_synth).values()):
        value = _flat(props["Environment"]["Variables"][config.ENV["subnet_ids"]])
        assert {ref for ref in subnets if ref in value} == subnets
        assert props["Environment"]["Variables"][config.ENV["keep_finished_volumes"]] == "false"


def _is_subnet(construct: Any) -> bool:
    return getattr(construct, "cfn_resource_type", None) == "AWS::EC2::Subnet"


def test_the_stack_creates_or_checks_the_spot_service_linked_role(default_synth: Synth) -> None:
    calls = [
        _flat(r["Properties"].get("Create", "")) for r in default_synth.resources.values() if r["Type"] == "Custom::AWS"
    ]
    assert any("createServiceLinkedRole" in c and "spot.amazonaws.com" in c and "InvalidInput" in c for c in calls)
    assert any("getRole" in c and "AWSServiceRoleForEC2Spot" in c for c in calls)


EBS_KEY_ACTIONS = {
    "kms:Decrypt",
    "kms:DescribeKey",
    "kms:GenerateDataKeyWithoutPlaintext",
    "kms:ReEncryptFrom",
    "kms:ReEncryptTo",
}


def _ebs_key_statements(statements: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    [use] = [s for s in statements if set(as_list(s["Action"])) == EBS_KEY_ACTIONS]
    [grant] = statements_with(statements, "kms:CreateGrant")
    return use, grant


def test_roles_that_create_ebs_volumes_may_use_a_customer_managed_key_only_through_ec2(default_synth: Synth) -> None:
    # With an account default CMK for EBS, RunInstances and CreateVolume fail without these (EBS User Guide,
    # "Requirements for Amazon EBS encryption")
    creators = [f for f in catalog.FUNCTIONS if {catalog.EC2_LAUNCH, catalog.EC2_VOLUMES} & set(f.capabilities)]
    assert {"launch-backup", "move-volume", "state-change"} <= {f.name for f in creators}
    by_role = statements_by_role(default_synth)
    for spec in creators:
        use, grant = _ebs_key_statements(by_role[function_role(default_synth, spec.name)])
        for statement in (use, grant):
            # Any key of the account (the default key is unknown at synth), only as EC2 in this region uses it
            assert _flat(statement["Resource"]) == _flat(
                {
                    "Fn::Join": [
                        "",
                        [
                            "arn:",
                            {"Ref": "AWS::Partition"},
                            ":kms:",
                            {"Ref": "AWS::Region"},
                            ":",
                            {"Ref": "AWS::AccountId"},
                            ":key/*",
                        ],
                    ]
                }
            ), spec.name
            conditions = statement["Condition"]["StringEquals"]
            assert _flat(conditions["kms:ViaService"]) == _flat(
                {"Fn::Join": ["", ["ec2.", {"Ref": "AWS::Region"}, ".amazonaws.com"]]}
            )
            assert conditions["kms:CallerAccount"] == {"Ref": "AWS::AccountId"}
        assert grant["Condition"]["Bool"] == {"kms:GrantIsForAWSResource": "true"}
    for spec in catalog.FUNCTIONS:
        if spec not in creators:
            assert not statements_with(by_role[function_role(default_synth, spec.name)], "kms:CreateGrant"), spec.name


def test_ebs_kms_key_arn_narrows_the_key_grants_to_that_key() -> None:
    key = "arn:aws:kms:eu-west-1:111122223333:key/0123abcd-4567-89ab-cdef-0123456789ab"
    settings = Settings.from_mapping({"ebs_kms_key_arn": key})
    stack = cdk.Stack(cdk.App())
    targets = grants.GrantTargets(
        jobs_table_arn="t",
        jobs_index_names=(),
        idempotency_table_arn="i",
        document_names={},
        launch_template_id="lt-0123456789abcdef0",
        job_role_arn="r",
        state_machine_arn="s",
        failure_topic_arn="f",
        failure_topic_key_arn="k",
        checkpoint_bucket_name="b",
        job_spec_buckets=(),
        stack=stack,
        ebs_kms_key_arn=settings.ebs_kms_key_arn or "",
    )
    kms = [g for g in grants.grants_for([catalog.EC2_VOLUMES], targets) if g.statement.actions[0].startswith("kms:")]
    assert len(kms) == 2
    for grant in kms:
        assert grant.statement.resources == [key] and grant.wildcard_reason is None
    with pytest.raises(InvalidSetting, match="ebs_kms_key_arn"):
        Settings.from_mapping({"ebs_kms_key_arn": "alias/aws/ebs"})


def test_every_job_vm_reads_every_spec_as_the_docs_say(default_synth: Synth) -> None:
    # IAM has no key tying an instance profile's S3 read to the instance's job (docs/deploying.md, "What the
    # isolation does not cover"): the grant stays the whole specs/ prefix, and the docs must keep saying so
    by_role = statements_by_role(default_synth)
    job_role = logical_id(default_synth, child(default_synth, "VmLaunch", "JobRole"))
    [spec_read] = [s for s in statements_with(by_role[job_role], "s3:GetObject") if "/specs/*" in _flat(s["Resource"])]
    assert "Condition" not in spec_read
    docs = " ".join((REPO_ROOT / "docs" / "deploying.md").read_text().split())
    assert "a job VM can still read every job's spec under `specs/`" in docs
    assert "IAM cannot narrow the read to the VM's own job" in docs
