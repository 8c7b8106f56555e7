"""The job VMs' role carries what SSM Agent needs for Run Command, no more, and the asset carries the artifact."""

from __future__ import annotations

from tests.infra.conftest import Synth
from tests.infra.support import SSM_AGENT_CHANNEL_ACTIONS, child, logical_id, statements_by_role

SSM_AGENT_ACTIONS = {"ssm:UpdateInstanceInformation", *SSM_AGENT_CHANNEL_ACTIONS}


def test_job_role_has_the_run_command_part_of_the_ssm_core_policy_and_the_readiness_check(
    default_synth: Synth,
) -> None:
    role_id = logical_id(default_synth, child(default_synth, "VmLaunch", "JobRole"))
    role = default_synth.of_type("AWS::IAM::Role")[role_id]
    # No AWS managed policy: AmazonSSMManagedInstanceCore would add State Manager, inventory and patching
    assert "ManagedPolicyArns" not in role["Properties"]
    actions = {
        action
        for statement in statements_by_role(default_synth)[role_id]
        for action in ([statement["Action"]] if isinstance(statement["Action"], str) else statement["Action"])
    }
    assert actions >= SSM_AGENT_ACTIONS | {"ssm:DescribeInstanceInformation"}
    assert not {a for a in actions if a.startswith(("ssm:", "ssmmessages:")) and "Data" in a}  # no Session Manager
    assert not {"ssm:GetParameter", "ssm:PutInventory", "ssm:ListInstanceAssociations"} & actions
