"""The recovery workflow: the Standard state machine from statemachines/recovery.asl.json.

Its `${...}` variables and its role come from spotcr_functions.catalog (WORKFLOW_SUBSTITUTIONS,
WORKFLOW_CAPABILITIES and the functions marked workflow_step), so the ASL and the catalog move together.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from aws_cdk import ArnFormat, RemovalPolicy, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct
from spotcr_functions import catalog

from infra import grants
from infra.nag import acknowledge
from infra.settings import Settings

REPO_ROOT = Path(__file__).resolve().parent.parent
RECOVERY_ASL = REPO_ROOT / "statemachines" / "recovery.asl.json"
VARIABLE = re.compile(r"\$\{([A-Za-z0-9_]+)\}")


def recovery_state_machine_name(settings: Settings) -> str:
    return f"{settings.stack_name}-recovery"


def state_machine_arn(stack: Stack, name: str) -> str:
    """The ARN from the fixed name: functions that start the workflow can know it before it exists (no cycle)."""
    return stack.format_arn(
        service="states", resource="stateMachine", resource_name=name, arn_format=ArnFormat.COLON_RESOURCE_NAME
    )


def dangling_transitions(definition: Mapping[str, Any], where: str = "") -> list[str]:
    """Every StartAt/Next/Default/Choices/Catch target that names no state in its scope (Parallel and Map nest)."""
    states = definition.get("States", {})
    problems: list[str] = []
    start = definition.get("StartAt")
    if start not in states:
        problems.append(f"{where or '/'}: StartAt {start!r} is not a state")
    for name, state in states.items():
        path = f"{where}/{name}"
        targets = [("Next", state.get("Next")), ("Default", state.get("Default"))]
        targets += [(f"Choices[{i}].Next", choice.get("Next")) for i, choice in enumerate(state.get("Choices", []))]
        targets += [(f"Catch[{i}].Next", catch.get("Next")) for i, catch in enumerate(state.get("Catch", []))]
        for field, target in targets:
            if target is not None and target not in states:
                problems.append(f"{path}: {field} {target!r} is not a state")
        for i, branch in enumerate(state.get("Branches", [])):
            problems += dangling_transitions(branch, f"{path}/Branches[{i}]")
        for key in ("Iterator", "ItemProcessor"):
            if key in state:
                problems += dangling_transitions(state[key], f"{path}/{key}")
    return problems


def asl_variables(path: Path) -> set[str]:
    return set(VARIABLE.findall(path.read_text()))


def resolve_substitutions(declared: Mapping[str, str], values: Callable[[str], str], asl_path: Path) -> dict[str, str]:
    """Each declared variable's value by its kind; every `${...}` in the ASL must be declared."""
    undeclared = asl_variables(asl_path) - set(declared)
    if undeclared:
        raise ValueError(
            f"{asl_path.name} uses ${{...}} variables missing from catalog.WORKFLOW_SUBSTITUTIONS: "
            f"{', '.join(sorted(undeclared))}"
        )
    problems = dangling_transitions(json.loads(asl_path.read_text()))
    if problems:
        raise ValueError(f"{asl_path.name}: {'; '.join(problems)}")
    return {variable: values(kind) for variable, kind in declared.items()}


class Workflow(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        settings: Settings,
        substitution_values: Callable[[str], str],
        step_function_arns: list[str],
        grant_targets: grants.GrantTargets,
        asl_path: Path = RECOVERY_ASL,
    ) -> None:
        super().__init__(scope, construct_id)
        self.log_group = logs.LogGroup(
            self, "Logs", retention=settings.log_retention, removal_policy=RemovalPolicy.DESTROY
        )
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("states.amazonaws.com"),
            description="spotcr recovery workflow",
        )
        if step_function_arns:
            self.role.add_to_principal_policy(
                iam.PolicyStatement(actions=["lambda:InvokeFunction"], resources=step_function_arns)
            )
        grants.apply(self.role, grants.grants_for(catalog.WORKFLOW_CAPABILITIES, grant_targets))
        substitutions = resolve_substitutions(catalog.WORKFLOW_SUBSTITUTIONS, substitution_values, asl_path)
        self.state_machine = sfn.StateMachine(
            self,
            "Recovery",
            state_machine_name=recovery_state_machine_name(settings),
            state_machine_type=sfn.StateMachineType.STANDARD,
            definition_body=sfn.DefinitionBody.from_file(str(asl_path)),
            definition_substitutions=substitutions,
            role=self.role,
            logs=sfn.LogOptions(destination=self.log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
            tracing_enabled=True,
        )
        acknowledge(
            self.role,
            "AwsSolutions-IAM5[Resource::*]",
            "CloudWatch Logs delivery (logs:CreateLogDelivery and friends) and X-Ray tracing, added for the "
            "workflow's logging and tracing, support no resource-level permissions.",
        )
