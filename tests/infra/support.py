"""Helpers shared by the infra tests (and the tests that read the synthesized stack or the functions' code).

The IAM statements of a synthesized template, by role; a small evaluator of Allow statements; and the AST scan of
spotcr_functions that finds which AWS calls each handler can reach.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any, cast

import aws_cdk as cdk
from constructs import IConstruct

from tests.infra.conftest import REPO_ROOT, Synth

# What SSM Agent polls for Run Command: these services offer no resource-level permissions.
SSM_AGENT_CHANNEL_ACTIONS = {
    "ec2messages:AcknowledgeMessage",
    "ec2messages:DeleteMessage",
    "ec2messages:FailMessage",
    "ec2messages:GetEndpoint",
    "ec2messages:GetMessages",
    "ec2messages:SendReply",
    "ssmmessages:CreateControlChannel",
    "ssmmessages:OpenControlChannel",
}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def statements_by_role(synth: Synth) -> dict[str, list[dict[str, Any]]]:
    by_role: dict[str, list[dict[str, Any]]] = {}
    for policy in synth.of_type("AWS::IAM::Policy").values():
        for role in policy["Properties"]["Roles"]:
            by_role.setdefault(role["Ref"], []).extend(policy["Properties"]["PolicyDocument"]["Statement"])
    for logical_id, role in synth.of_type("AWS::IAM::Role").items():
        for inline in role["Properties"].get("Policies", []):
            by_role.setdefault(logical_id, []).extend(inline["PolicyDocument"]["Statement"])
    return by_role


def logical_id(synth: Synth, construct: IConstruct) -> str:
    element = construct if isinstance(construct, cdk.CfnElement) else construct.node.default_child
    return synth.stack.get_logical_id(cast(cdk.CfnElement, element))


def child(synth: Synth, *path: str) -> IConstruct:
    construct: IConstruct = synth.stack
    for name in path:
        construct = construct.node.find_child(name)
    return construct


VARIABLE = re.compile(r"\$\{([^}]+)\}")


def _like(pattern: str, value: str, context: Mapping[str, str]) -> bool:
    missing = [name for name in VARIABLE.findall(pattern) if name not in context]
    if missing:
        return False
    resolved = VARIABLE.sub(lambda m: context[m.group(1)].replace("*", "[*]").replace("?", "[?]"), pattern)
    return fnmatch.fnmatchcase(value, resolved)


def _conditions_hold(conditions: Mapping[str, Mapping[str, Any]], context: Mapping[str, str]) -> bool:
    for operator, tests in conditions.items():
        for key, expected in tests.items():
            if key not in context:
                return False
            value = context[key]
            if operator == "StringLike" and not any(_like(str(p), value, context) for p in as_list(expected)):
                return False
            if operator == "StringEquals" and value not in [str(e) for e in as_list(expected)]:
                return False
            if operator == "Bool" and value.lower() not in [str(e).lower() for e in as_list(expected)]:
                return False
            if operator not in ("StringLike", "StringEquals", "Bool"):
                raise AssertionError(f"the evaluator does not know {operator}")
    return True


def allows(statements: Iterable[Mapping[str, Any]], action: str, resource: str, context: Mapping[str, str]) -> bool:
    """Whether an Allow statement grants it: `*`/`?` wildcards, policy variables, StringLike/StringEquals/Bool; a
    missing key or variable matches nothing, as IAM evaluates them."""
    for statement in statements:
        assert statement["Effect"] == "Allow", "these policies have no Deny"
        if not any(fnmatch.fnmatchcase(action, a) for a in as_list(statement["Action"])):
            continue
        if not any(_like(r, resource, context) for r in as_list(statement["Resource"])):
            continue
        if _conditions_hold(statement.get("Condition", {}), context):
            return True
    return False


PACKAGE = REPO_ROOT / "functions" / "spotcr_functions"
# The adapters' boto3 clients: attribute of `self` -> (target, IAM service prefix).
CLIENTS = {
    ("Cloud", "ec2"): "ec2",
    ("Cloud", "ssm"): "ssm",
    ("Cloud", "ssm_once"): "ssm",  # the same service, tried once (the final-dump command: final_dumps)
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


def _callees(node: ast.Call) -> list[list[str]]:
    """The call's attribute chains: both, where the receiver is chosen by a conditional (`(a if p else b).m()`)."""
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.IfExp):
        return [[*_chain(branch), func.attr] for branch in (func.value.body, func.value.orelse)]
    return [_chain(func)]


def _aws_use(definition: Definition, node: ast.Call) -> Iterator[Use]:
    for chain in _callees(node):
        if len(chain) != 3 or chain[0] != "self" or definition.cls is None:
            continue
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
