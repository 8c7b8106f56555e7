"""GPU jobs recover only on instance types with the same GPU model and count (EC2's GpuInfo, served by moto)."""

from __future__ import annotations

import boto3
import pytest
from moto import mock_aws
from spotcr_contracts import events
from spotcr_contracts import tags as tag_names
from spotcr_functions.cloud import Cloud
from spotcr_functions.gpus import Gpus, matching_fallbacks

from rehearsal.controlplane import ControlPlane, agent_event, ec2_event, now_iso, route
from tests.workflow.support import NO_CAPACITY

A10G = Gpus("NVIDIA", "A10G", 1)
TYPES = {"g5.xlarge": A10G, "g5.2xlarge": A10G, "g5.12xlarge": Gpus("NVIDIA", "A10G", 4), "m5.large": None}


def test_a_gpu_job_keeps_only_fallbacks_with_the_same_gpu_model_and_count() -> None:
    kept, dropped = matching_fallbacks(
        "g5.xlarge",
        ["g6.xlarge", "g5.2xlarge", "g5.12xlarge", "m5.large", "zz.huge"],
        {**TYPES, "g6.xlarge": Gpus("NVIDIA", "L4", 1)},
    )
    assert kept == ["g5.2xlarge"]
    assert dropped == {
        "g6.xlarge": "it has 1 x NVIDIA L4; the job's g5.xlarge has 1 x NVIDIA A10G, which its checkpoint needs",
        "g5.12xlarge": "it has 4 x NVIDIA A10G; the job's g5.xlarge has 1 x NVIDIA A10G, which its checkpoint needs",
        "m5.large": "it has no GPU; the job's g5.xlarge has 1 x NVIDIA A10G, which its checkpoint needs",
        "zz.huge": "EC2 does not know this instance type",
    }


def test_a_job_without_a_gpu_may_fall_back_on_any_known_type() -> None:
    kept, dropped = matching_fallbacks("m5.large", ["g5.xlarge", "m5.large"], TYPES)
    assert (kept, dropped) == (["g5.xlarge", "m5.large"], {})


def test_ec2_names_the_gpus_of_each_type_and_an_unknown_type_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        found = Cloud(boto3.Session(region_name="us-east-1")).instance_gpus(
            ["g5.xlarge", "g5.12xlarge", "p5.48xlarge", "m5.large", "zz.huge"]
        )
    assert found == {
        "g5.xlarge": A10G,
        "g5.12xlarge": Gpus("NVIDIA", "A10G", 4),
        "p5.48xlarge": Gpus("NVIDIA", "H100", 8),
        "m5.large": None,
    }


def test_a_gpu_job_is_never_recovered_on_a_type_with_other_gpus(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a job on a g5.xlarge (1 x A10G) whose fallbacks include other GPUs, more of them, and none
    fallbacks = "g6.xlarge,g5.12xlarge,m5.large,g5.2xlarge"
    tags = {tag_names.JOB: "llm-1", tag_names.COMMAND: "/opt/job/train", tag_names.FALLBACK_TYPES: fallbacks}
    primary = plane.launch_job_instance(tags, instance_type="g5.xlarge")
    route(ec2_event("state-change-running", primary))
    route(agent_event(events.JobStarted("llm-1", primary, 0, now_iso(), pid=4242)))
    # And no spot capacity anywhere, so the workflow goes through every candidate it planned
    launches = plane.refuse_launches(lambda _t, _s, market: NO_CAPACITY if market == "spot" else None)

    # When the warning comes
    route(ec2_event("spot-interruption-warning", primary))
    record = plane.wait_until(lambda: (r := plane.job("llm-1")).backup_instance_id and r, "the backup launch")

    # Then only the job's own type and the fallback with the same GPU were tried, and the backup is a g5.xlarge
    tried = [instance_type for instance_type, _, market in launches if market == "spot"]
    assert sorted(set(tried)) == ["g5.2xlarge", "g5.xlarge"]
    [backup] = plane.backups()
    assert backup["InstanceId"] == record.backup_instance_id
    assert backup["InstanceType"] == "g5.xlarge"
