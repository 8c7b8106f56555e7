"""Every condition operator the synthesized stack's policies use is one the local AWS's evaluator reads and decides.

For each operator form (set qualifier, operator, IfExists) a request the condition holds for and one it does not are
evaluated; then every policy in each synthesized template (role, bucket, key and trust policies alike) is read by the
evaluator, and its operators must all be among those examples.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rehearsal.iam.policy import ContextValue, Principal, Request, evaluate
from tests.infra.conftest import Synth

ROLE = "arn:aws:iam::111122223333:role/spotcr-fn"
ARN = "arn:aws:ec2:eu-west-1:111122223333:launch-template/lt-0123456789abcdef0"

# operator form -> (policy value, a request value it holds for, one it does not); the key is "k:key"
EXAMPLES: dict[str, tuple[Any, ContextValue | None, ContextValue]] = {
    "StringEquals": ("RunInstances", "RunInstances", "runinstances"),
    "StringNotEquals": ("a", "b", "a"),
    "StringEqualsIgnoreCase": ("RunInstances", "runinstances", "CreateVolume"),
    "StringNotEqualsIgnoreCase": ("a", "b", "A"),
    "StringLike": ("?*", "train-1", ""),
    "StringNotLike": ("aws:*", "spotcr:job", "aws:x"),
    "StringEqualsIfExists": ("a", "a", "b"),
    "NumericEquals": ("10", "10", "11"),
    "NumericLessThan": ("10", "9", "10"),
    "NumericGreaterThanEquals": ("10", "10", "9"),
    "DateLessThan": ("2027-01-01T00:00:00Z", "2026-11-26T00:00:00Z", "2027-01-02T00:00:00Z"),
    "DateGreaterThan": ("2026-01-01T00:00:00Z", "2026-11-26T00:00:00Z", "2025-01-01T00:00:00Z"),
    "Bool": ("false", False, True),
    "BinaryEquals": ("QmluYXJ5", "QmluYXJ5", "T3RoZXI="),
    "IpAddress": ("10.0.0.0/8", "10.1.2.3", "192.0.2.1"),
    "NotIpAddress": ("10.0.0.0/8", "192.0.2.1", "10.1.2.3"),
    "ArnEquals": (ARN, ARN, ARN.replace("lt-0", "lt-1")),
    "ArnLike": ("arn:aws:ec2:*:*:launch-template/lt-*", ARN, "arn:aws:ec2:eu-west-1:111122223333:instance/i-1"),
    "ArnNotEquals": (ARN.replace("lt-0", "lt-1"), ARN, ARN.replace("lt-0", "lt-1")),
    "ArnNotLike": ("arn:aws:ec2:*:*:instance/*", ARN, "arn:aws:ec2:eu-west-1:111122223333:instance/i-1"),
    "Null": ("true", None, "present"),  # None: the key is absent
    "ForAllValues:StringEquals": (["spotcr:error"], ("spotcr:error",), ("spotcr:error", "spotcr:run")),
    "ForAllValues:StringLike": (["spotcr:*"], ("spotcr:job", "spotcr:run"), ("spotcr:job", "Name")),
    "ForAnyValue:StringEquals": (["spotcr:run"], ("Name", "spotcr:run"), ("Name",)),
    "ForAnyValue:StringLike": (["spotcr:*"], ("Name", "spotcr:job"), ("Name",)),
}


def _holds(operator: str, value: Any, request_value: ContextValue | None) -> bool:
    statement = {"Effect": "Allow", "Action": "*", "Resource": "*", "Condition": {operator: {"k:key": value}}}
    context = {} if request_value is None else {"k:key": request_value}
    principal = Principal(ROLE, ({"Version": "2012-10-17", "Statement": [statement]},))
    return evaluate(principal, Request("s3:GetObject", "*", context)).allowed


@pytest.mark.parametrize("operator", sorted(EXAMPLES))
def test_the_evaluator_decides_each_operator_both_ways(operator: str) -> None:
    value, holds, fails = EXAMPLES[operator]
    assert _holds(operator, value, holds), f"{operator} {value!r} should hold for {holds!r}"
    assert not _holds(operator, value, fails), f"{operator} {value!r} should not hold for {fails!r}"


def _statements(node: Any) -> Iterator[dict[str, Any]]:
    """Every policy statement anywhere in a template (IAM, bucket, key, queue, topic and trust policies)."""
    if isinstance(node, dict):
        statements = node.get("Statement")
        if isinstance(statements, list) and all(isinstance(s, dict) and "Effect" in s for s in statements):
            yield from statements
        for child in node.values():
            yield from _statements(child)
    elif isinstance(node, list):
        for child in node:
            yield from _statements(child)


def _resolved(value: Any) -> Any:
    """A condition value as the evaluator would see it once deployed: intrinsics (Ref, Fn::Join) become text."""
    if isinstance(value, list):
        return [_resolved(v) for v in value]
    return value if isinstance(value, str | bool | int) else "resolved-at-deploy"


def _operators_used(synth: Synth) -> dict[str, list[dict[str, Any]]]:
    used: dict[str, list[dict[str, Any]]] = {}
    for statement in _statements(synth.template.to_json()["Resources"]):
        for operator, block in statement.get("Condition", {}).items():
            used.setdefault(operator, []).append({k: _resolved(v) for k, v in block.items()})
    return used


@pytest.mark.parametrize("configuration", ["default_synth", "custom_synth"])
def test_every_operator_in_the_synthesized_policies_is_decided_by_the_evaluator(
    configuration: str, request: pytest.FixtureRequest
) -> None:
    # Given every condition of every policy the stack synthesizes
    used = _operators_used(request.getfixturevalue(configuration))
    assert used, "the scan found no condition at all (are the policies where it looks?)"
    # Then each operator is one whose decision both ways is tested above
    assert not set(used) - set(EXAMPLES), f"operators without an example: {sorted(set(used) - set(EXAMPLES))}"
    # And the evaluator reads each condition as written (any operator or value it does not know raises)
    for operator, blocks in used.items():
        for block in blocks:
            statement = {"Effect": "Deny", "Action": "*", "Resource": "*", "Condition": {operator: block}}
            principal = Principal(ROLE, ({"Version": "2012-10-17", "Statement": [statement]},))
            evaluate(principal, Request("s3:GetObject", "*", {}))
