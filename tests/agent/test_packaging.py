"""What ships to the VM agrees with itself: user data, launcher, unit, and the contracts' agent path."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from spotcr_agent import cli
from spotcr_agent.config import LAUNCHER
from spotcr_contracts.commands import AGENT_BIN
from spotcr_contracts.settings import AGENT_FLAGS, VmSettings

from infra.agent_bundle import render_user_data

VM = Path(__file__).parents[2] / "vm-bootstrap"
PLACEHOLDERS = set(VmSettings().placeholders())


def test_bootstrap_script_is_valid_bash_and_uses_every_vm_setting():
    script = (VM / "bootstrap.sh").read_text()
    subprocess.run(["bash", "-n", str(VM / "bootstrap.sh")], check=True)
    assert "set -eEuo pipefail" in script
    used = set(re.findall(r'"(__SPOTCR_[A-Z_]+__)"', script))
    assert used == PLACEHOLDERS
    header = script.split("set -eEuo pipefail")[0]
    assert "spotcr_contracts.settings.VmSettings" in header


def test_bootstrap_script_passes_the_agent_each_vm_setting_as_the_agent_reads_it():
    script = (VM / "bootstrap.sh").read_text().replace("\\\n", " ")
    line = next(line for line in script.splitlines() if '/bin/spotcr-agent" bootstrap --bucket' in line)
    argv = shlex.split(line.replace('"$PREFIX/bin/spotcr-agent"', "agent"))[1:]
    assert [a for a in argv if a.startswith("--")] == list(AGENT_FLAGS.values())
    # The user data's values: "x" for names and ids, "true" or "false" for efs_isolation
    values = {"$EFS_ISOLATION": "true"}
    args = cli.parser().parse_args([values.get(a, "x") if a.startswith("$") else a for a in argv])
    assert args.command == "bootstrap" and args.bucket == "x" and args.efs_isolation == "true"


def test_launcher_and_unit_run_the_agent_where_the_ssm_documents_expect_it():
    assert AGENT_BIN == "/opt/spotcr/bin/spotcr-agent"
    launcher = (VM / "bin" / "spotcr-agent").read_text()
    assert "exec /usr/bin/python3 -m spotcr_agent" in launcher  # Debian 12's own python: nothing to install
    assert "PYTHONPATH=/opt/spotcr/lib:/opt/spotcr/lib/python" in launcher
    assert "PATH=/opt/spotcr/criu/bin:" in launcher  # the prebuilt CRIU
    # spotcr-launch, which node 0's mpiexec runs as its ssh, installed where the agent tells the job it is
    assert LAUNCHER == "/opt/spotcr/bin/spotcr-launch"
    assert (
        'install -m 0755 "$ASSET/bin/spotcr-launch" "$PREFIX/bin/spotcr-launch"'
        in (VM / "install-artifact.sh").read_text()
    )
    mpi_launcher = (VM / "bin" / "spotcr-launch").read_text()
    assert (
        "PYTHONPATH=/opt/spotcr/lib:/opt/spotcr/lib/python exec /usr/bin/python3 -m spotcr_agent.launch" in mpi_launcher
    )
    unit = (VM / "spotcr-agent.service").read_text()
    assert f"ExecStart={AGENT_BIN} daemon" in unit
    assert "KillMode=process" in unit  # restarting the agent must never kill the job


def test_bootstrap_installs_prebuilt_parts_and_the_ssm_agent_without_compiling():
    script = (VM / "bootstrap.sh").read_text()
    # AWS's documented SSM Agent install for Debian, from the instance's own region, started before the agent
    assert "https://s3.$region.amazonaws.com/amazon-ssm-$region/latest/debian_$arch/amazon-ssm-agent.deb" in script
    assert script.index('install_ssm_agent "$region"') < script.index('"$PREFIX/bin/spotcr-agent" bootstrap --bucket')
    # CRIU and the agent's packages arrive prebuilt: no source build, pip, venv or build dependencies at boot
    assert 'install-artifact.sh" "$PREFIX/lib" "$PREFIX" --system' in script
    for compiling in ("install-criu.sh", "pip install", "venv", "build-essential", "make "):
        assert compiling not in script


@pytest.mark.parametrize(
    ("efs_id", "isolation", "wanted"),
    [("", "", set()), ("fs-0123", "", {"nfs-common"}), ("fs-0123", "true", {"nfs-common", "stunnel4"})],
)
def test_bootstrap_installs_what_the_jobs_storage_mounts_with(tmp_path, efs_id, isolation, wanted):
    # Given a VM with none of the mount tools (and iptables present), When bootstrap asks what to install
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "iptables-restore").write_text("#!/bin/sh\n")
    (bin_dir / "iptables-restore").chmod(0o755)
    script = f"source {VM / 'bootstrap.sh'}; EFS_ID={efs_id!r}; EFS_ISOLATION={isolation!r}; missing_packages"
    ran = subprocess.run(
        ["/bin/bash", "-c", script], capture_output=True, text=True, check=True, env={"PATH": str(bin_dir)}
    )
    # Then NFS for EFS, and stunnel (mount.efs's TLS tunnel) only for an isolated EFS mount
    assert set(ran.stdout.split()) == wanted


def _check_build_host(tmp_path, os_release: str, target: str | None = None) -> subprocess.CompletedProcess[str]:
    release = tmp_path / "os-release"
    release.write_text(os_release)
    host = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
    env = {"PATH": "/usr/bin:/bin", "SPOTCR_OS_RELEASE": str(release), "SPOTCR_VM_ARCHITECTURE": target or host}
    return subprocess.run(
        ["bash", str(VM / "build-artifact.sh"), "--check-host"], env=env, capture_output=True, text=True, check=False
    )


DEBIAN_12 = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_ID="12"\n'


def test_the_artifact_builds_on_debian_12_of_the_vms_architecture(tmp_path):
    assert _check_build_host(tmp_path, DEBIAN_12).returncode == 0


@pytest.mark.parametrize(
    "os_release",
    [
        'PRETTY_NAME="Ubuntu 24.04 LTS"\nID=ubuntu\nVERSION_ID="24.04"\n',
        'PRETTY_NAME="Debian GNU/Linux 13 (trixie)"\nID=debian\nVERSION_ID="13"\n',
    ],
)
def test_the_artifact_is_refused_on_another_system_than_debian_12(tmp_path, os_release):
    # Its CRIU and Python parts would link against a glibc the VMs may not have
    checked = _check_build_host(tmp_path, os_release)
    assert checked.returncode != 0
    assert "must be built on Debian 12" in checked.stderr


def test_the_artifact_is_refused_on_another_architecture_than_the_vms(tmp_path):
    host = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
    other = "arm64" if host == "amd64" else "amd64"
    checked = _check_build_host(tmp_path, DEBIAN_12, target=other)
    assert checked.returncode != 0
    assert f"this machine is {host}, the job VMs are {other}" in checked.stderr


def test_user_data_is_refused_when_the_script_and_the_vm_settings_disagree():
    script = (VM / "bootstrap.sh").read_text()
    values = VmSettings(bucket="checkpoints", efs_isolation=True).placeholders()
    rendered = render_user_data(script, values)
    assert 'BUCKET="checkpoints"' in rendered and 'EFS_ISOLATION="true"' in rendered
    with pytest.raises(ValueError, match="does not use the placeholders __SPOTCR_REGION__"):
        render_user_data(script, {**values, "__SPOTCR_REGION__": "eu-west-1"})
    del values["__SPOTCR_BUCKET__"]
    with pytest.raises(ValueError, match="infra does not provide: __SPOTCR_BUCKET__"):
        render_user_data(script, values)
