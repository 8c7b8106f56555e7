"""Ready means reachable (SSM Online before AgentReady), and a dump is refused before it could fill scratch."""

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from spotcr_agent import bootstrap as bootstrap_module
from spotcr_agent import readiness, scratch
from spotcr_agent.bootstrap import bootstrap

from tests.support import wait_for

from .conftest import FakePublisher, bootstrap_args, compute_command, imds_with_tags, kill_tree
from .vm_agent import JobVM

TAGS = {"spotcr:job": "nightly-sim", "spotcr:command": "python3 sim.py"}


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_the_agent_waits_until_its_ssm_agent_is_online():
    # Given an instance whose SSM Agent registers on the third poll
    answers = iter([None, "ConnectionLost", "Online"])
    clock = FakeClock()
    # When the bootstrap waits for it, Then it returns once SSM says Online
    waited = readiness.wait_for_ssm("i-0abc", lambda _: next(answers), poll_s=2, clock=clock, sleep=clock.sleep)
    assert waited == 4


def test_an_instance_ssm_never_reaches_is_named_with_the_last_status():
    clock = FakeClock()
    with pytest.raises(readiness.NotReachable, match=r"i-0abc is not Online after 10 s \(not registered\)"):
        readiness.wait_for_ssm("i-0abc", lambda _: None, timeout_s=10, poll_s=2, clock=clock, sleep=clock.sleep)


def test_bootstrap_fails_at_the_ssm_step_when_the_agent_never_registers(tmp_path):
    # Given a VM whose SSM Agent is not Online
    results: list[Mapping[str, Any]] = []
    publisher = FakePublisher()
    environ = {"SPOTCR_AGENT_CONFIG": str(tmp_path / "agent.json"), "SPOTCR_STATE_DIR": str(tmp_path)}
    args = bootstrap_args(ssm_wait_seconds=0.0)
    clock = FakeClock()
    # When it bootstraps, Then no readiness is claimed: BootstrapFailed names the ssm step
    code = bootstrap(
        args,
        environ,
        results.append,
        metadata=imds_with_tags(TAGS),
        publisher=publisher,
        ping_status=lambda _: None,
        scratch_warning=lambda _: None,
        sleep=clock.sleep,
    )
    assert code == 1
    assert results[0]["step"] == "ssm" and "not Online" in results[0]["error"]
    assert [event.step for event in publisher.events] == ["ssm"]
    # No spotcr:run was tagged: the failure names no run, once the bounded wait for one is over (on its own clock)
    assert publisher.events[0].run_id == "" and clock.now >= bootstrap_module.RUN_WAIT_S


def test_bootstrap_reports_scratch_smaller_than_the_instance_memory(tmp_path):
    warning = scratch.capacity_warning(tmp_path, memory=32 << 30, free=20 << 30)
    assert warning is not None
    assert "has 20.0 GiB free but this instance has 32.0 GiB of memory" in warning
    assert "more than about 18.1 GiB cannot be checkpointed" in warning
    assert scratch.capacity_warning(tmp_path, memory=8 << 30, free=20 << 30) is None
    results: list[Mapping[str, Any]] = []
    environ = {"SPOTCR_AGENT_CONFIG": str(tmp_path / "agent.json"), "SPOTCR_STATE_DIR": str(tmp_path)}
    bootstrap(
        bootstrap_args(),
        environ,
        results.append,
        metadata=imds_with_tags(TAGS),
        publisher=FakePublisher(),
        ping_status=lambda _: "Online",
        scratch_warning=lambda _: "too small",
    )
    assert results[0]["ok"] and results[0]["scratch_warning"] == "too small"


def test_the_dump_estimate_counts_the_job_trees_anonymous_memory():
    # Given a process tree whose child holds 64 MiB of touched memory
    holder = (
        "import sys,time; b=bytearray(64<<20); b[::4096]=b'x'*len(b[::4096]); print('ok', flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess,sys; subprocess.run([sys.executable,'-c',{holder!r}])"],
        stdout=subprocess.PIPE,
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"ok\n"
        # Then the estimate for the parent covers the child's pages, with the margin
        tree = scratch.job_tree(parent.pid)
        assert len(tree) == 2
        assert scratch.dump_estimate(parent.pid) >= (64 << 20) * scratch.MARGIN
    finally:
        kill_tree(parent.pid)
        parent.wait()


@pytest.mark.criu
@pytest.mark.usefixtures("criu_available")
def test_a_dump_that_cannot_fit_on_scratch_is_refused_before_the_freeze(bare_vm, storage):
    # Given a job of 48 MiB on a bare VM whose scratch disk is 16 MiB (a real tmpfs, mounted in the VM only)
    vm = bare_vm(shared_storage=storage)
    small = "/var/lib/spotcr/small-scratch"
    vm.host_path(small).mkdir(parents=True)
    mount = vm.run(["mount", "-t", "tmpfs", "-o", "size=16m", "spotcr-test-scratch", small])
    assert mount.returncode == 0, mount.stderr
    job = JobVM(vm, scratch_dir=Path(small), command=compute_command(megabytes=48, steps=300))
    job.agent("start")
    wait_for(job.progress, what="the job to touch its memory")  # compute.py fills its memory before its first step
    # When a periodic checkpoint is asked for, Then it is refused with both figures and an event
    failed = job.agent("checkpoint", "periodic", "1", check=False)
    assert "not enough local scratch for the dump" in failed["error"], failed
    reason = job.events("CheckpointFailed")[0]["reason"]
    assert "GiB free" in reason and small in reason
    # And the job was never frozen or killed: it still runs
    assert job.agent("status")["job_alive"]


EVENTS = Path(__file__).parents[1] / "events" / "ssm"


def _stubbed_ssm():
    client = boto3.client("ssm", region_name="us-east-2", aws_access_key_id="x", aws_secret_access_key="x")
    return client, Stubber(client)


def test_the_readiness_check_reads_ssms_published_describe_instance_information_sample():
    # Given SSM's documented response for one managed instance (botocore's Stubber checks it against the model)
    sample = json.loads((EVENTS / "describe-instance-information.json").read_text())
    sample.pop("_source")
    client, stubber = _stubbed_ssm()
    instance_id = sample["InstanceInformationList"][0]["InstanceId"]
    expected = {"Filters": [{"Key": "InstanceIds", "Values": [instance_id]}]}
    stubber.add_response("describe_instance_information", sample, expected)
    stubber.add_response("describe_instance_information", {"InstanceInformationList": []}, expected)
    with stubber:
        ping_status = readiness.ssm_ping_status("us-east-2", client)
        # Then the instance is Online, and an instance not (yet) registered is not
        assert ping_status(instance_id) == "Online"
        assert ping_status(instance_id) is None


def test_a_documented_ssm_error_while_waiting_is_retried_then_named():
    # Given SSM answering with its documented InvalidInstanceId until the agent registers
    sample = json.loads((EVENTS / "send-command-invalid-instance-id.json").read_text())["Error"]
    client, stubber = _stubbed_ssm()
    stubber.add_client_error("describe_instance_information", sample["Code"], sample["Message"])
    stubber.add_response(
        "describe_instance_information", {"InstanceInformationList": [{"InstanceId": "i-0abc", "PingStatus": "Online"}]}
    )
    clock = FakeClock()
    with stubber:
        waited = readiness.wait_for_ssm(
            "i-0abc", readiness.ssm_ping_status("us-east-2", client), clock=clock, sleep=clock.sleep
        )
    assert waited == readiness.POLL_S
    stubber.add_client_error("describe_instance_information", sample["Code"], sample["Message"])
    with stubber, pytest.raises(readiness.NotReachable, match=r"\(error: .*InvalidInstanceId"):
        readiness.wait_for_ssm(
            "i-0abc", readiness.ssm_ping_status("us-east-2", client), timeout_s=0, clock=clock, sleep=clock.sleep
        )
