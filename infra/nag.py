"""cdk-nag acknowledgments, each with its written reason, attached where the finding is."""

from __future__ import annotations

import json
from typing import Any

import aws_cdk as cdk
from constructs import IConstruct


def acknowledge(scope: IConstruct, rule: str, reason: str) -> None:
    """Acknowledge one AwsSolutions finding on `scope` (and its children)."""
    cdk.Validations.of(scope).acknowledge(cdk.Acknowledgment(id=rule, reason=reason))


def flatten_reference(value: Any) -> str:
    """A resolved CloudFormation value as cdk-nag prints it in a finding id (`<Logical.Attr>`, `<Ref>`)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value.replace("${", "<").replace("}", ">")
    flat = json.dumps(value, separators=(",", ":"))
    if isinstance(value, dict):
        if "Fn::Join" in value:
            delimiter, items = value["Fn::Join"]
            flat = str(delimiter).join(flatten_reference(item) for item in items)
        elif "Fn::Sub" in value or "Fn::ImportValue" in value:
            flat = flatten_reference(value.get("Fn::Sub", value.get("Fn::ImportValue")))
        elif "Fn::GetAtt" in value:
            resource, attribute = value["Fn::GetAtt"]
            flat = f"<{flatten_reference(resource)}.{flatten_reference(attribute)}>"
        elif "Ref" in value:
            flat = f"<{flatten_reference(value['Ref'])}>"
    return flat


def acknowledge_wildcard_resource(scope: IConstruct, resource: str, reason: str) -> None:
    """Acknowledge IAM5 for one wildcard resource of a policy under `scope`."""
    flat = flatten_reference(cdk.Stack.of(scope).resolve(resource))
    if "*" not in flat:
        return  # a token such as a log group's Arn hides its wildcard from cdk-nag too
    acknowledge(scope, f"AwsSolutions-IAM5[Resource::{flat}]", reason)
