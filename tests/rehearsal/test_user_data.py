"""The job VM's user data, run whole in a local VM: SSM Agent first, the prebuilt artifact, the agent, the service.

systemctl, dpkg -i and the SSM Agent download are recorded by stand-ins (a local VM has no systemd and no route
to AWS); everything else is bootstrap.sh as the launch template renders it: IMDS, the signed S3 fetch of the
asset, install-artifact.sh --system, `spotcr-agent bootstrap` with its SSM readiness check against the local cloud.
"""

import shlex
import sys
from pathlib import Path

import pytest
from spotcr_contracts.settings import VmSettings

from infra.vm_launch import BOOTSTRAP_SCRIPT, render_user_data
from rehearsal import asset, ssm_agent
from rehearsal.cloud import REGION, LocalCloud
from rehearsal.timeline import Timeline
from tests.support import wait_for

SHIMS = {
    # Records what would change the system outside the VM's private paths, and answers as a fresh VM would.
    "systemctl": 'echo "systemctl $*" >> "$SHIM_LOG"; [ "$1" = is-active ] && exit 3; exit 0',
    "dpkg": 'if [ "$1" = -i ]; then echo "dpkg $*" >> "$SHIM_LOG"; exit 0; fi; exec /usr/bin/dpkg "$@"',
    "apt-get": 'echo "apt-get $*" >> "$SHIM_LOG"',
    "curl": 'for a in "$@"; do case "$a" in https:*amazon-ssm-agent.deb) echo "curl $a" >> "$SHIM_LOG";'
    ' while [ "$1" != -o ]; do shift; done; echo deb > "$2"; exit 0;; esac; done; exec /usr/bin/curl "$@"',
}


def _launch_registered(cloud):
    """A VM launched with a job's tags, once its SSM agent stand-in has registered."""
    tags = {"spotcr:job": "user-data", "spotcr:command": "sleep 1000"}
    spec = [{"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}]
    reservation = cloud.client("ec2").run_instances(
        ImageId=cloud.image_id, MinCount=1, MaxCount=1, TagSpecifications=spec
    )
    instance_id = reservation["Instances"][0]["InstanceId"]
    wait_for(lambda: cloud.managed_instances.online(instance_id), "the VM's SSM agent stand-in to register")
    return cloud.vms[instance_id]


@pytest.fixture
def cloud(tmp_path):
    local = LocalCloud(
        run_dir=tmp_path / "run",
        timeline=Timeline(echo=None),
        boot_commands=[[sys.executable, "-m", ssm_agent.__name__], ["sleep", "infinity"]],
        with_workflow=False,
    )
    local.start()
    yield local
    local.stop()


@pytest.mark.criu
@pytest.mark.timeout(240)
def test_the_user_data_installs_the_ssm_agent_and_the_prebuilt_agent_then_starts_it(cloud):
    # Given the user data as the launch template renders it, and a VM launched with a job's tags
    vm = _launch_registered(cloud)
    # What the VM reads lives in its private /var/lib/spotcr (a VM does not share the host's /tmp)
    private, inside = vm.dir("state") / "user-data-test", Path("/var/lib/spotcr/user-data-test")
    private.mkdir()
    # Where the stack publishes its agent asset: the only object of CDK's assets bucket the job role may read.
    bucket, key = cloud.agent_asset
    url = asset.publish(cloud.client("s3"), bucket, key=key)
    user_data = private / "user-data.sh"
    user_data.write_text(
        render_user_data(
            BOOTSTRAP_SCRIPT.read_text(),
            VmSettings(
                agent_asset_url=url,
                bucket=cloud.names["checkpoint_bucket"],
                event_bus=cloud.names["event_bus_name"],
                store_credentials_url=cloud.store_credentials_url,
            ).placeholders(),
        )
    )
    shims = private / "shims"
    shims.mkdir()
    for name, body in SHIMS.items():
        (shims / name).write_text(f"#!/bin/sh\n{body}\n")
        (shims / name).chmod(0o755)
    log = private / "system.log"
    # System paths the user data writes are overlays inside the VM: the host's own CRIU stays untouched.
    overlays = []
    for number, path in enumerate(("/usr/local/sbin", "/usr/lib", "/etc/systemd/system")):
        (private / f"upper{number}").mkdir()
        (private / f"work{number}").mkdir()
        upper, work = inside / f"upper{number}", inside / f"work{number}"
        overlays.append(f"mount -t overlay overlay -o lowerdir={path},upperdir={upper},workdir={work} {path}")
    user_data_in_vm = shlex.quote(str(inside / "user-data.sh"))
    run = f"SHIM_LOG={inside / 'system.log'} PATH={inside / 'shims'}:$PATH bash {user_data_in_vm}"
    script = " && ".join([*overlays, run])
    # When it runs
    ran = vm.run(["bash", "-c", script], timeout_s=180)
    # Then every step ran, in order, and the agent was started only after SSM could reach the instance
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    steps = [
        line.split(" took ")[0].removeprefix("spotcr-bootstrap: ")
        for line in ran.stdout.splitlines()
        if " took " in line
    ]
    assert steps == ["ssm-agent", "asset", "packages", "install", "agent-bootstrap"]
    recorded = log.read_text().splitlines()
    region_url = f"https://s3.{REGION}.amazonaws.com/amazon-ssm-{REGION}/latest/debian_amd64/amazon-ssm-agent.deb"
    order = [
        f"curl {region_url}",
        "dpkg -i /tmp/amazon-ssm-agent.deb",
        "systemctl enable --now amazon-ssm-agent",
        "systemctl enable --now spotcr-agent.service",
    ]
    assert [recorded.index(line) for line in order] == sorted(recorded.index(line) for line in order)
    assert not [line for line in recorded if line.startswith("apt-get")]  # nothing missing, nothing installed
    assert vm.run(["readlink", "/usr/local/sbin/criu"]).stdout.strip() == "/opt/spotcr/criu/bin/criu"
    assert vm.run(["/usr/local/sbin/criu", "--version"]).stdout.startswith("Version: 4.1.1")
    assert Path("/usr/local/sbin/criu").is_file() and not Path("/usr/local/sbin/criu").is_symlink()
    assert (vm.dir("etc") / "agent.json").is_file()
    assert '"ssm_wait_s"' in ran.stdout


@pytest.mark.criu
@pytest.mark.timeout(120)
def test_a_failing_step_is_named_and_fails_the_user_data(cloud):
    # Given user data whose asset cannot be fetched (no such object)
    vm = _launch_registered(cloud)
    private = vm.dir("state") / "user-data-test"
    private.mkdir(parents=True)
    values = VmSettings(agent_asset_url="s3://no-such-bucket/agent.zip").placeholders()
    (private / "user-data.sh").write_text(render_user_data(BOOTSTRAP_SCRIPT.read_text(), values))
    (private / "shims").mkdir()
    for name, body in SHIMS.items():
        (private / "shims" / name).write_text(f"#!/bin/sh\n{body}\n")
        (private / "shims" / name).chmod(0o755)
    inside = "/var/lib/spotcr/user-data-test"
    # When it runs, Then it stops at that step, says so, and fails
    ran = vm.run(["bash", "-c", f"SHIM_LOG={inside}/log PATH={inside}/shims:$PATH bash {inside}/user-data.sh"], 60)
    assert ran.returncode != 0
    assert "FAILED at step 'asset'" in ran.stdout
    assert "spotcr-agent.service" not in (private / "log").read_text()
