"""Local VMs are as bare as fresh EC2 instances: their own empty temp dirs, address, network and /proc."""

import ipaddress
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rehearsal.vm import IMDS_ADDRESS, NETWORK_RANGE, VmNetwork, bare_vm
from tests.support import wait_for

pytestmark = pytest.mark.criu  # needs root for namespaces, as the CRIU tests do


def host_addresses():
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split()[3].split("/")[0] for line in out.splitlines()}


def bridge_ports(network):
    return subprocess.run(
        ["ip", "-o", "link", "show", "master", network.bridge], capture_output=True, text=True, check=True
    ).stdout


def vm_address(vm):
    out = vm.run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
    return out.split()[3].split("/")[0]


def test_a_vm_has_empty_temp_dirs_of_its_own(bare_vm):
    # Given files in the host's /tmp, /var/tmp and /dev/shm
    marker = f"host-only-{uuid.uuid4().hex}"
    host_files = [Path(d) / marker for d in ("/tmp", "/var/tmp", "/dev/shm")]
    for path in host_files:
        path.write_text("host")
    try:
        # When two VMs boot and one writes into its temp dirs
        first, second = bare_vm(), bare_vm()
        for directory in ("/tmp", "/var/tmp", "/dev/shm"):
            listing = first.run(["ls", "-A", directory])
            # Then each VM's temp dir starts empty, is a tmpfs, and is neither the host's nor the other VM's
            assert listing.returncode == 0 and listing.stdout == "", f"{directory}: {listing.stdout!r}"
            assert first.run(["stat", "-f", "-c", "%T", directory]).stdout.strip() == "tmpfs"
            written = first.run(["sh", "-c", f"echo vm > {directory}/{marker}-vm"])
            assert written.returncode == 0, written.stderr
            assert not (Path(directory) / f"{marker}-vm").exists()
            assert second.run(["ls", "-A", directory]).stdout == ""
        assert first.run(["cat", f"/tmp/{marker}-vm"]).stdout == "vm\n"
    finally:
        for path in host_files:
            path.unlink(missing_ok=True)


def test_a_vm_has_none_of_the_mounts_the_host_made_below_tmp(bare_vm, tmp_path):
    # Given a mount of the host's below /tmp (another test's volume, say)
    host_mount = tmp_path / "host-volume"
    host_mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(host_mount)], check=True)
    try:
        # When a VM boots
        vm = bare_vm()
        # Then the VM's mount table does not have it: a backup booted after it is gone will not miss it
        assert str(host_mount) not in vm.run(["cat", "/proc/self/mountinfo"]).stdout
    finally:
        subprocess.run(["umount", str(host_mount)], check=True)


def test_a_vm_sees_only_its_own_processes(bare_vm):
    vm = bare_vm()
    pids = [int(p) for p in vm.run(["ls", "/proc"]).stdout.split() if p.isdigit()]
    assert 1 in pids and len(pids) < 10
    assert "rehearsal.vm_init" in vm.run(["cat", "/proc/1/cmdline"]).stdout


def test_each_vm_has_its_own_private_address(bare_vm, vm_network):
    # Given two VMs, as a primary and its backup
    primary, backup = bare_vm(), bare_vm()
    # Then each has an address of its own in the test range, unlike the host's and unlike each other's
    addresses = [vm_address(primary), vm_address(backup)]
    assert addresses == [primary.address, backup.address]
    assert addresses[0] != addresses[1]
    assert all(ipaddress.ip_address(a) in NETWORK_RANGE for a in addresses)
    assert not set(addresses) & host_addresses()
    assert primary.run(["hostname"]).stdout.strip() == f"ip-{primary.address.replace('.', '-')}"
    # And a VM reaches the host end of its network but nothing beyond it (no default route)
    route = primary.run(["ip", "route", "get", "192.0.2.77"])
    assert route.returncode != 0 and "unreachable" in route.stderr
    assert primary.run(["ip", "route", "get", vm_network.gateway]).returncode == 0


def test_a_vm_listener_is_not_the_hosts(bare_vm):
    # Given a VM listening on a port of its loopback
    vm = bare_vm(boot_commands=[[sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "18765"]])
    probe = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:18765/', timeout=5).status)"
    # Then the VM reaches it and the host, in its own network namespace, does not
    assert vm.run([sys.executable, "-c", f"import time; time.sleep(1); {probe}"]).stdout.strip() == "200"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, check=False).returncode != 0


IMDS_READ = f"""
import urllib.request
base = "http://{IMDS_ADDRESS}/latest"
token = urllib.request.urlopen(urllib.request.Request(base + "/api/token", method="PUT",
    headers={{"X-aws-ec2-metadata-token-ttl-seconds": "60"}}), timeout=5).read().decode()
def get(path):
    request = urllib.request.Request(base + "/meta-data/" + path, headers={{"X-aws-ec2-metadata-token": token}})
    return urllib.request.urlopen(request, timeout=5).read().decode()
print(get("instance-id"), get("local-ipv4"), get("tags/instance/spotcr:job"))
"""


def test_the_imds_answers_at_its_ec2_address_inside_the_vm_also_after_its_primary_ended(bare_vm):
    # Given a primary and its backup on the same network, the backup's IMDS answering at its EC2 address
    primary = bare_vm()
    vm = bare_vm(instance_id="i-0bare0imds", tags={"spotcr:job": "j-1"})
    # (the primary's port gets the lowest MAC: a bridge without one of its own would take it, then lose it)
    subprocess.run(["ip", "link", "set", primary.host_interface, "address", "02:00:00:00:00:01"], check=True)
    before = vm.run([sys.executable, "-c", IMDS_READ])
    assert before.returncode == 0, before.stderr
    assert before.stdout.split() == ["i-0bare0imds", vm.address, "j-1"]
    # When the primary goes away
    primary.terminate()
    # Then the backup's IMDS still answers
    after = vm.run([sys.executable, "-c", IMDS_READ])
    assert after.returncode == 0, after.stderr
    assert after.stdout == before.stdout


def guard_chains():
    """The source checks of the VM links this process made (rehearsal.vm's ebtables chains, named after the link:
    its maker's PID in hex). Another test run on this machine (`make test`'s other lane) makes and removes its own
    meanwhile."""
    listed = subprocess.run(["ebtables", "-L"], capture_output=True, text=True, check=True).stdout
    mine = f"SCRGUARD-{os.getpid():x}v"
    return {line.split(",")[0] for line in listed.split("Bridge chain: ")[1:] if line.startswith(mine)}


def test_the_network_and_its_links_are_removed(tmp_path):
    # Given a network with a VM on it
    chains = guard_chains()
    with VmNetwork.create() as network:
        with bare_vm(tmp_path, network) as vm:
            assert bridge_ports(network).count("\n") == 1
            assert guard_chains() - chains  # its link's source check, found by the name guard_chains looks for
            init_pid = vm.init_pid
        # When the VM ends, its end of the link goes with its namespace
        assert not Path(f"/proc/{init_pid}").exists()
        assert bridge_ports(network) == ""
    # Then closing the network leaves nothing on the host: no bridge, no source check of the VM's link
    assert network.bridge not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert guard_chains() <= chains
    assert not list((tmp_path).glob("i-*"))


def test_concurrent_networks_get_distinct_subnets():
    with VmNetwork.create() as first, VmNetwork.create() as second:
        assert first.bridge != second.bridge
        assert not first.subnet.overlaps(second.subnet)
        assert first.gateway in host_addresses() and second.gateway in host_addresses()


def test_the_cloud_is_reachable_from_inside_a_vm(tmp_path):
    from rehearsal.cloud import LocalCloud
    from rehearsal.timeline import Timeline

    with LocalCloud(run_dir=tmp_path, timeline=Timeline(echo=None), with_workflow=False) as cloud:
        cloud.client("s3").put_object(Bucket=cloud.names["checkpoint_bucket"], Key="hello", Body=b"from the host")
        assert cloud.network is not None
        with bare_vm(tmp_path / "vms", cloud.network, cloud_env=cloud.vm_env) as vm:
            script = (
                # The rehearsal's own key: this VM is no instance, so it has no instance profile of its own.
                "import boto3, json; s3 = boto3.client('s3', aws_access_key_id='testing', aws_secret_access_key='x');"
                f"print(json.dumps(s3.get_object(Bucket='{cloud.names['checkpoint_bucket']}', Key='hello')"
                "['Body'].read().decode()))"
            )
            result = vm.run([sys.executable, "-c", script], timeout_s=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == "from the host"
    assert "127.0.0.1" not in cloud.vm_env["AWS_ENDPOINT_URL"]


OWNER = """
import sys, time
from pathlib import Path
from rehearsal.vm import VmNetwork, bare_vm
network = VmNetwork.create()
with bare_vm(Path(sys.argv[1]), network) as vm:
    print(vm.init_pid, network.bridge, flush=True)
    time.sleep(600)
"""


def test_a_vm_and_its_network_do_not_outlive_a_killed_test_process(tmp_path):
    # Given a process that booted a VM and is then killed before it can clean up
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    init_pid, bridge = owner.stdout.readline().split()
    owner.kill()
    owner.wait()
    # Then the VM ends with it, and the next network made on this machine removes its bridge
    wait_for(lambda: not Path(f"/proc/{init_pid}").exists(), "the VM to end with the process that booted it", 10)
    with VmNetwork.create():
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert f" {bridge}:" not in links


def test_a_vm_state_mount_left_by_a_killed_process_is_swept_by_the_next_network(tmp_path):
    # Given the state file system of a VM whose booting process was killed before its clean-up, and one of a live VM
    gone = subprocess.Popen(["true"])
    gone.wait()
    left, live = tmp_path / "left state", tmp_path / "live"
    for path, owner in ((left, gone.pid), (live, os.getpid())):
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", f"spotcr-state-{owner:x}", str(path)], check=True)
    try:
        # When the next VM network is set up
        with VmNetwork.create():
            pass

        # Then the left one is unmounted, the live VM's kept
        assert not os.path.ismount(left)
        assert os.path.ismount(live)
    finally:
        for path in (left, live):
            subprocess.run(["umount", "--lazy", str(path)], capture_output=True, check=False)
