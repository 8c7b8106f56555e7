"""Least privilege, derived from the code: each function's grants are exactly what its handler can call.

An AST scan follows each catalog handler through spotcr_functions (calls and references to functions, methods of
the Cloud and Registry adapters) down to the boto3 client calls the adapters make, and maps them to IAM actions.
Every call must be granted by the function's capabilities, every capability a function holds must be used by it,
and every action a capability grants must be used by some holder of it.
"""

from __future__ import annotations

import json
from functools import cache

import aws_cdk as cdk
import pytest
from spotcr_functions import catalog

from infra import grants
from tests.infra.conftest import REPO_ROOT
from tests.infra.support import IMPLIED, Use, used_by

JOBS_TABLE = "arn:aws:dynamodb:eu-west-1:111122223333:table/jobs"
IDEMPOTENCY_TABLE = "arn:aws:dynamodb:eu-west-1:111122223333:table/idem"


def _targets() -> grants.GrantTargets:
    return grants.GrantTargets(
        jobs_table_arn=JOBS_TABLE,
        jobs_index_names=("by-instance",),
        idempotency_table_arn=IDEMPOTENCY_TABLE,
        document_names={"checkpoint": "spotcr-checkpoint"},
        launch_template_id="lt-0123456789abcdef0",
        job_role_arn="arn:aws:iam::111122223333:role/job",
        state_machine_arn="arn:aws:states:eu-west-1:111122223333:stateMachine:spotcr-recovery",
        failure_topic_arn="arn:aws:sns:eu-west-1:111122223333:failures",
        failure_topic_key_arn="arn:aws:kms:eu-west-1:111122223333:key/k",
        checkpoint_bucket_name="bucket",
        job_spec_buckets=(),
        stack=cdk.Stack(cdk.App()),
        store_role_arn="arn:aws:iam::111122223333:role/store",
        file_system_arn="arn:aws:elasticfilesystem:eu-west-1:111122223333:file-system/fs-0123456789abcdef0",
    )


@cache
def granted(capability: str) -> frozenset[Use]:
    uses: set[Use] = set()
    for grant in grants.grants_for([capability], _targets()):
        resources = json.dumps(grant.statement.to_json().get("Resource", ""))
        for action in grant.statement.actions:
            service = action.split(":")[0]
            table = "idempotency" if IDEMPOTENCY_TABLE in resources else "jobs"
            uses.add((table if service == "dynamodb" else service, action))
    return frozenset(uses)


def _handler_qualified(function: catalog.Function) -> str:
    return function.handler


@pytest.mark.parametrize("function", catalog.FUNCTIONS, ids=[f.name for f in catalog.FUNCTIONS])
def test_every_call_is_granted_and_every_capability_used(function: catalog.Function) -> None:
    # Given what the handler can reach and what its capabilities grant
    used = used_by(_handler_qualified(function))
    assert used, f"{function.name}: the scan found no AWS call (is the handler path right?)"
    allowed = set().union(*(granted(c) for c in function.capabilities))
    # Then every call is granted
    assert not used - allowed, f"{function.name} calls without a grant: {sorted(used - allowed)}"
    # And every capability it holds is used by it
    unused = [c for c in function.capabilities if not granted(c) & used]
    assert not unused, f"{function.name} holds capabilities it never uses: {unused}"


def _workflow_uses() -> set[Use]:
    definition = json.loads((REPO_ROOT / "statemachines" / "recovery.asl.json").read_text())
    uses: set[Use] = set()

    def walk(states: dict[str, dict[str, object]]) -> None:
        for state in states.values():
            resource = str(state.get("Resource", ""))
            if resource.startswith("arn:aws:states:::aws-sdk:"):
                service, operation = resource.removeprefix("arn:aws:states:::aws-sdk:").split(":")
                uses.add((service, f"{service}:{operation[0].upper()}{operation[1:]}"))
            elif resource == "arn:aws:states:::sns:publish":
                uses.add(("sns", "sns:Publish"))
            for branch in state.get("Branches", []):  # type: ignore[attr-defined]
                walk(branch["States"])

    walk(definition["States"])
    for _, action in list(uses):
        uses |= {(extra.split(":")[0], extra) for extra in IMPLIED.get(action, ())}
    return uses


def test_the_workflow_role_is_granted_exactly_its_sdk_calls() -> None:
    used = _workflow_uses()
    allowed = set().union(*(granted(c) for c in catalog.WORKFLOW_CAPABILITIES))
    assert not used - allowed, sorted(used - allowed)
    assert allowed <= used, f"granted to the workflow but never called: {sorted(allowed - used)}"


def test_every_granted_action_is_used_by_some_holder() -> None:
    used_by_holders: dict[str, set[Use]] = {}
    for function in catalog.FUNCTIONS:
        for capability in function.capabilities:
            used_by_holders.setdefault(capability, set()).update(used_by(_handler_qualified(function)))
    for capability in catalog.WORKFLOW_CAPABILITIES:
        used_by_holders.setdefault(capability, set()).update(_workflow_uses())
    dead = {capability: sorted(granted(capability) - uses) for capability, uses in used_by_holders.items()}
    assert not {c: d for c, d in dead.items() if d}, "capabilities grant actions no holder calls"


def test_the_scan_sees_an_adapter_call_through_a_lambda() -> None:
    # The interruption handler reaches SendCommand only through a lambda passed to _edge.once.
    used = used_by("spotcr_functions.handlers.interruption.handler")
    assert ("ssm", "ssm:SendCommand") in used
    assert ("idempotency", "dynamodb:PutItem") in used
    assert ("ec2", "ec2:RunInstances") not in used
