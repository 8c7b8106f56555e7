"""FIS acts as the stack's fault-injection role: its calls are evaluated against that role's policy in the template.

`spotcr interrupt` and `spotcr selftest` start the stack's experiment; FIS then finds the marked spot instance and
sends it the interruption as the experiment's role. Without ec2:SendSpotInstanceInterruptions the experiment fails.
"""

from __future__ import annotations

import uuid
from typing import Any

from spotcr_contracts import fis, tags

from rehearsal.cloud import ACCOUNT, LocalCloud
from rehearsal.iam import principals
from tests.rehearsal.support import cloud, events
from tests.support import wait_for

__all__ = ["cloud", "events"]  # the rehearsal's local cloud, IAM enforced


def marked_spot_vm(cloud: LocalCloud) -> Any:
    marker = [{"Key": tags.INTERRUPT, "Value": tags.INTERRUPT_REQUESTED}]
    instance_id = cloud.client("ec2").run_instances(
        ImageId=cloud.image_id,
        MinCount=1,
        MaxCount=1,
        InstanceType="c5.large",
        InstanceMarketOptions={"MarketType": "spot"},
        TagSpecifications=[{"ResourceType": "instance", "Tags": marker}],
    )["Instances"][0]["InstanceId"]
    vm = wait_for(lambda: cloud.vms.get(instance_id))
    wait_for(lambda: vm.running_at is not None)
    return vm


def interrupt(cloud: LocalCloud) -> dict[str, Any]:
    template = cloud.stack_outputs[fis.OUTPUTS[fis.INTERRUPT]]
    client = cloud.client("fis")
    started = client.start_experiment(experimentTemplateId=template, clientToken=uuid.uuid4().hex)["experiment"]
    return dict(client.get_experiment(id=started["id"])["experiment"])


def fis_role(cloud: LocalCloud) -> str:
    return f"arn:aws:iam::{ACCOUNT}:role/{cloud.names['fis_role']}"


def test_fis_interrupts_as_the_stacks_fault_injection_role_and_fails_without_its_grant(cloud: LocalCloud) -> None:
    # Given a running spot instance carrying the interrupt marker
    enforcer = cloud.enforcer
    assert enforcer is not None
    vm = marked_spot_vm(cloud)
    # When the stack's interrupt experiment starts
    experiment = interrupt(cloud)
    # Then FIS, as the template's role, was allowed to find and interrupt it: the notice reaches the VM
    role = fis_role(cloud)
    assert experiment["roleArn"] == role and experiment["state"]["status"] != "failed"
    wait_for(lambda: vm.imds.instance_action)
    assert (role, "ec2:SendSpotInstanceInterruptions") in enforcer.evaluated
    assert enforcer.denials == []

    # Given the role without ec2:SendSpotInstanceInterruptions, and another marked spot instance
    removed = principals.without_grant(enforcer.roles[role], "ec2:SendSpotInstanceInterruptions")
    enforcer.roles = {**enforcer.roles, role: removed}
    other = marked_spot_vm(cloud)
    # Then the experiment fails as FIS fails it, naming the refused action, and that instance gets no notice
    assert interrupt(cloud)["state"]["status"] == "failed"
    (denial,) = enforcer.denials
    assert denial.principal == role and "ec2:SendSpotInstanceInterruptions" in denial.reason
    assert not other.imds.instance_action
