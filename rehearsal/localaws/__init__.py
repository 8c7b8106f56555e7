"""The one local AWS: moto, plus what moto does not do, done as AWS does it, split by service.

Two ways to run it share these modules: `rehearsal.cloud.LocalCloud` (moto's server, real local VMs: the rehearsal
and the fault suite) and `rehearsal.controlplane.ControlPlane` (moto in-process, no VMs: the workflow tests).
- `awslambda`: invoking a function runs its catalog handler in-process, signed as the function's role;
- `ssm`: commands go to their InstanceIds only; managed instances; SSM's command status-change event;
- `fleet`: CreateFleet tags its instances as RunInstances does, and reports refused launches in Errors;
- `ec2_tags`: a resource's tags read from its own entry, not by a scan of the account's (the same answer);
- `dynamodb`: one request at a time, so each item write is whole (moto writes in place, one action at a time);
- `stepfunctions`: SendTaskFailure keeps its cause;
- `iam`: the synthesized stack's IAM, enforced on every call (rehearsal/iam/enforce.py);
- `stack`: the stack's tables, SSM documents and recovery state machine, as `cdk deploy` creates them;
- `fis`: a spot-interruption experiment interrupts its targets, once the experiment's role may;
- `s3`: the fault suite's injected store faults.
Every patch is entered into the caller's `contextlib.ExitStack`, so closing it undoes them all, in reverse.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any
from unittest import mock

REGION = "us-east-1"
ACCOUNT = "123456789012"


def wrap(patches: contextlib.ExitStack, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    """Replace `owner.name` by `make(original)` until `patches` closes; an operation moto lacks is added (original
    None), and an inherited one is removed again on closing, so later patches of the base class still apply."""
    original = getattr(owner, name, None)
    patches.enter_context(mock.patch.object(owner, name, make(original), create=original is None))


def tags_of(ec2: Any, resource_id: str) -> dict[str, str]:
    """An EC2 resource's tags, from moto's EC2 backend."""
    return {tag["key"]: tag["value"] for tag in ec2.describe_tags(filters={"resource-id": [resource_id]})}
