"""Least privilege, derived from the code: each function's grants are exactly what its handler can call.

An AST scan follows each catalog handler through spotcr_functions (calls and references to functions, methods of
the Cloud and Registry adapters) down to the boto3 client calls the adapters make, and maps them to IAM actions.
Every call must be granted by the function's capabilities, every capability a function holds must be used by it,
and every action a capability grants must be used by some holder of it.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache

import aws_cdk as cdk
import pytest
from spotcr_functions import catalog

from infra import grants
from tests.infra.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "functions" / "spotcr_functions"
JOBS_TABLE = "arn:aws:dynamodb:eu-west-1:111122223333:table/jobs"
IDEMPOTENCY_TABLE = "arn:aws:dynamodb:eu-west-1:111122223333:table/idem"
# The adapters' boto3 clients: attribute of `self` -> (target, IAM service prefix).
CLIENTS = {
    ("Cloud", "ec2"): "ec2",
    ("Cloud", "ssm"): "ssm",
    ("Cloud", "sfn"): "states",
    ("Cloud", "sns"): "sns",
    ("Cloud", "sts"): "sts",
    ("Cloud", "efs"): "elasticfilesystem",
}
REGISTRY_TABLE = ("Registry", "table")
# Calls that need more than their own action: IAM evaluates these too (tag-on-create, PassRole, the topic's key).
# EBS under a customer managed key: EC2 uses the key as the caller (infra/grants.py _ebs_key).
EBS_KEY = {
    "kms:CreateGrant",
    "kms:Decrypt",
    "kms:DescribeKey",
    "kms:GenerateDataKeyWithoutPlaintext",
    "kms:ReEncryptFrom",
    "kms:ReEncryptTo",
}
IMPLIED = {
    "ec2:RunInstances": {"ec2:CreateTags", "iam:PassRole", *EBS_KEY},
    # An instant fleet launches with the caller's RunInstances, tags on create and passes the instance profile.
    "ec2:CreateFleet": {"ec2:RunInstances", "ec2:CreateTags", "iam:PassRole", *EBS_KEY},
    "ec2:CreateVolume": {"ec2:CreateTags", *EBS_KEY},
    "ec2:CreateSnapshot": {"ec2:CreateTags"},
    "sns:Publish": {"kms:GenerateDataKey", "kms:Decrypt"},
    "sts:AssumeRole": {"sts:TagSession"},  # store_access passes the job as a session tag
    "elasticfilesystem:CreateAccessPoint": {"elasticfilesystem:TagResource"},  # tags on create
}
# Waiters poll a Describe call.
WAITERS = {"volume_available": "DescribeVolumes"}
# Powertools' DynamoDB idempotency layer, entered through _edge.once.
IDEMPOTENCY_CALLS = {"dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:DeleteItem"}
ONCE = "spotcr_functions.handlers._edge.once"

Use = tuple[str, str]  # (target, IAM action); target is "jobs" or "idempotency" for DynamoDB, else the service


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


@dataclass
class Definition:
    qualified: str
    module: str
    cls: str | None
    node: ast.AST  # a function, or a module-level assignment (dispatch tables)


@dataclass
class Index:
    definitions: dict[str, Definition] = field(default_factory=dict)
    imports: dict[str, dict[str, str]] = field(default_factory=dict)  # module -> local name -> qualified name

    def resolve(self, module: str, cls: str | None, chain: list[str]) -> str | None:
        local = self.imports.get(module, {})
        if not chain:
            return None
        if len(chain) == 1:
            for candidate in (f"{module}.{chain[0]}", local.get(chain[0], "")):
                if candidate in self.definitions:
                    return candidate
            return None
        if chain[0] == "self" and cls and len(chain) == 2:
            return f"{module}.{cls}.{chain[1]}"
        if chain[0] in local and len(chain) == 2:
            return f"{local[chain[0]]}.{chain[1]}"
        if len(chain) >= 2 and chain[-2] == "cloud":
            return f"spotcr_functions.cloud.Cloud.{chain[-1]}"
        if len(chain) >= 2 and chain[-2] == "registry":
            return f"spotcr_functions.registry.Registry.{chain[-1]}"
        return None


def _chain(node: ast.expr) -> list[str]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return []


@cache
def _index() -> Index:
    index = Index()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        imports: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        index.imports[module] = imports
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        qualified = f"{module}.{target.id}"
                        index.definitions[qualified] = Definition(qualified, module, None, node)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                index.definitions[f"{module}.{node.name}"] = Definition(f"{module}.{node.name}", module, None, node)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        qualified = f"{module}.{node.name}.{item.name}"
                        index.definitions[qualified] = Definition(qualified, module, node.name, item)
    return index


def _aws_use(definition: Definition, node: ast.Call) -> Iterator[Use]:
    chain = _chain(node.func)
    if len(chain) != 3 or chain[0] != "self" or definition.cls is None:
        return
    owner = (definition.cls, chain[1])
    if owner == REGISTRY_TABLE:
        yield "jobs", f"dynamodb:{_camel(chain[2])}"
    elif owner in CLIENTS:
        service = CLIENTS[owner]
        if chain[2] == "get_waiter" and node.args and isinstance(node.args[0], ast.Constant):
            yield service, f"{service}:{WAITERS[str(node.args[0].value)]}"
        else:
            yield service, f"{service}:{_camel(chain[2])}"


def reachable(handler: str) -> set[str]:
    """Every definition (module.function, module.Class.method) the handler can reach."""
    seen: set[str] = set()
    used_by(handler, seen)
    return seen


def used_by(handler: str, seen: set[str] | None = None) -> set[Use]:
    """Every (target, IAM action) reachable from this handler (module.function)."""
    index = _index()
    seen = set() if seen is None else seen
    pending = [handler]
    uses: set[Use] = set()
    while pending:
        qualified = pending.pop()
        if qualified in seen or qualified not in index.definitions:
            continue
        seen.add(qualified)
        if qualified == ONCE:
            uses |= {("idempotency", action) for action in IDEMPOTENCY_CALLS}
        definition = index.definitions[qualified]
        for node in ast.walk(definition.node):
            if isinstance(node, ast.Call):
                uses |= set(_aws_use(definition, node))
            # A reference is enough (handlers are dispatched through dicts and lambdas): follow it.
            if isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Load):
                target = index.resolve(definition.module, definition.cls, _chain(node))
                if target:
                    pending.append(target)
    for _, action in list(uses):
        uses |= {(extra.split(":")[0], extra) for extra in IMPLIED.get(action, ())}
    return uses


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
