"""One in-process synth per configuration, shared by the infra tests (a synth takes seconds)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Template

from infra.app import build_app
from infra.stack import SpotcrStack

REPO_ROOT = Path(__file__).resolve().parents[2]
CDK_CONTEXT: dict[str, Any] = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]

# An existing VPC with both optional file systems: the other branch of every context switch.
CUSTOM_CONTEXT = {
    "stack_name": "spotcr-custom",
    "vpc_id": "vpc-0123456789abcdef0",
    "subnet_ids": "subnet-0aaaaaaaaaaaaaaa1,subnet-0bbbbbbbbbbbbbbb2",
    "availability_zones": "eu-west-1a,eu-west-1b",
    "efs": "true",
    "efs_isolation": "true",
    "fsx": "PERSISTENT_2",
    "ami_id": "ami-0123456789abcdef0",
    "alarm_email": "ops@example.com",
    "checkpoint_expiry_days": "60",
    "job_spec_buckets": "my-job-specs",
    "powertools_layer_version": "52",
    "interruption_concurrency": "5",
    "checkpoint_key": "create",
}


@dataclass
class Synth:
    app: cdk.App
    stack: SpotcrStack
    template: Template

    @property
    def resources(self) -> dict[str, Any]:
        return self.template.to_json()["Resources"]

    def of_type(self, resource_type: str) -> dict[str, Any]:
        return {k: v for k, v in self.resources.items() if v["Type"] == resource_type}


def _synth(context: dict[str, Any], outdir: Path) -> Synth:
    app, stack = build_app(cdk.App(context={**CDK_CONTEXT, **context}, outdir=str(outdir)))
    # synth runs the cdk-nag plugin and raises ValidationFailed on any unacknowledged finding
    assembly = app.synth()
    template = Template.from_json(assembly.get_stack_by_name(stack.stack_name).template)
    return Synth(app, stack, template)


@pytest.fixture(scope="session")
def default_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    return _synth({}, tmp_path_factory.mktemp("cdk-default"))


@pytest.fixture(scope="session")
def custom_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    return _synth(CUSTOM_CONTEXT, tmp_path_factory.mktemp("cdk-custom"))


CHECKPOINT_KEY_ARN = "arn:aws:kms:eu-west-1:111122223333:key/0123abcd-0123-4567-89ab-0123456789ab"
# Private subnets (no route to the internet): the VPC spotcr creates, and an existing one with its route tables.
PRIVATE_CONTEXT = {"private_subnets": "true"}
PRIVATE_CUSTOM_CONTEXT = {
    "stack_name": "spotcr-private",
    "vpc_id": "vpc-0123456789abcdef0",
    "subnet_ids": "subnet-0aaaaaaaaaaaaaaa1,subnet-0bbbbbbbbbbbbbbb2",
    "availability_zones": "eu-west-1a,eu-west-1b",
    "route_table_ids": "rtb-0aaaaaaaaaaaaaaa1,rtb-0bbbbbbbbbbbbbbb2",
    "private_subnets": "true",
    "efs": "true",
    "checkpoint_key": CHECKPOINT_KEY_ARN,
}


@pytest.fixture(scope="session")
def private_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    return _synth(PRIVATE_CONTEXT, tmp_path_factory.mktemp("cdk-private"))


@pytest.fixture(scope="session")
def private_custom_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    return _synth(PRIVATE_CUSTOM_CONTEXT, tmp_path_factory.mktemp("cdk-private-custom"))
