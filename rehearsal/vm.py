"""A local VM as bare as a fresh EC2 instance: its own mount, PID, network and UTS namespaces.

Each VM sees its own `/var/lib/spotcr`, `/etc/spotcr`, `/opt/spotcr` and `/dev/disk/by-id` at the
same paths as every other VM (CRIU restores need identical paths), its own empty `/tmp`, `/var/tmp`
and `/dev/shm` (tmpfs in its private mount namespace), its own `/proc`, and its own network
namespace with its own private address on a per-run bridge (`VmNetwork`): a backup has another address than
its primary's, unless it takes over a gone VM's address (`takeover=`, a node of a multi-node job: see
docs/design/multinode.md). The local cloud and the VM's IMDS listen on the bridge's host address; inside
the VM the IMDS answers at 169.254.169.254, as on EC2. Everything else is the host's read-only
system, standing in for the AMI. Killing the namespace's PID 1 ends every process of the VM (and
its network namespace), as a terminated instance does.

Using bare VMs in a test (the fixtures `vm_network` and `bare_vm` in tests/conftest.py do this):

    with VmNetwork.create() as network, bare_vm(tmp_path, network) as vm:
        result = vm.run(["sh", "-c", "ls -A /tmp; hostname -I"])  # runs inside all of the VM's namespaces

`bare_vm` boots a VM whose PID 1 runs `boot_commands` (default: `sleep infinity`), so the test
decides what runs there; pass `cloud_env=cloud.vm_env` and `network=cloud.network` of a started
`LocalCloud` for a VM that reaches the local cloud. `LocalCloud` boots the same VMs for the
instances it launches.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from spotcr_agent import nodes
from spotcr_agent.mounts import unescape

from rehearsal import vm_init
from rehearsal.imds import Imds

REPO = Path(__file__).resolve().parent.parent
# Paths every VM has, each backed by a private host directory of that VM.
PRIVATE_PATHS = {
    "state": "/var/lib/spotcr",
    "etc": "/etc/spotcr",
    "opt": "/opt/spotcr",
    "by-id": "/dev/disk/by-id",
}
STORAGE_MOUNT = "/mnt/spotcr"
EBS_LINK_PREFIX = "nvme-Amazon_Elastic_Block_Store_vol"


def ebs_link_name(volume_id: str) -> str:
    """The link a Nitro instance has for an EBS volume: vol-0abc... is nvme-Amazon_Elastic_Block_Store_vol0abc..."""
    return EBS_LINK_PREFIX + volume_id.removeprefix("vol-")


def prepare_host() -> None:
    """Create the empty mount points the VMs bind their private directories over."""
    for path in [*PRIVATE_PATHS.values(), STORAGE_MOUNT]:
        Path(path).mkdir(parents=True, exist_ok=True)


class VmError(RuntimeError):
    pass


# RFC 2544's benchmarking range: never routed on the Internet, so a VM's packets cannot leave the machine.
NETWORK_RANGE = ipaddress.IPv4Network("198.18.0.0/15")
IMDS_ADDRESS = "169.254.169.254"
VM_INTERFACE = "eth0"
_LINK_PREFIX = "scr"  # scr<pid>n<n> bridges, scr<pid>v<n> veths: the creating process's PID in hex
_ALLOCATION_LOCK = Path("/run/lock/spotcr-vm-network.lock")
_GUARD_PREFIX = "SCRGUARD-"  # + a VM link's name without _LINK_PREFIX: the link's source check (ebtables chain)
_networks = itertools.count(1)
_veths = itertools.count(1)


def _ip(*args: str, netns_pid: int | None = None) -> str:
    argv = ["ip", *args] if netns_pid is None else ["nsenter", "-t", str(netns_pid), "-n", "ip", *args]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise VmError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
    return result.stdout


def _remove_stale_links() -> None:
    """Bridges, and source checks of VM links, left by test processes that were killed before they could clean
    up."""
    for chain in _ebtables("-L").split("\nBridge chain: ")[1:]:
        name = chain.split(",")[0]
        if _of_a_dead_process(name, _GUARD_PREFIX, "v"):
            _unguard(_LINK_PREFIX + name.removeprefix(_GUARD_PREFIX))
    for line in _ip("-o", "link", "show", "type", "bridge").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if _of_a_dead_process(name, _LINK_PREFIX, "n"):
            subprocess.run(["ip", "link", "delete", name], capture_output=True, check=False)


def _of_a_dead_process(name: str, prefix: str, separator: str) -> bool:
    """Whether `name` (prefix, the PID in hex of the process that made it, separator, ...) is a gone process's."""
    owner, found, _ = name.removeprefix(prefix).partition(separator)
    try:
        return name.startswith(prefix) and bool(found) and not Path(f"/proc/{int(owner, 16)}").exists()
    except ValueError:
        return False


_STATE_SOURCE = vm_init.STATE_SOURCE  # + the PID, in hex, of the process that booted the VM


def _remove_stale_state_mounts() -> None:
    """VM state file systems left mounted by processes that were killed before they could clean up."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        source, target = line.split()[:2]
        owner = source.removeprefix(_STATE_SOURCE)
        try:
            dead = source.startswith(_STATE_SOURCE) and not Path(f"/proc/{int(owner, 16)}").exists()
        except ValueError:
            continue
        if dead:
            subprocess.run(["umount", "--lazy", unescape(target)], capture_output=True, check=False)


class VmNetwork:
    """A private /24 from 198.18.0.0/15 on a bridge of its own: the host holds .1, each VM the next free address.

    The VMs have no default route: they reach the bridge's host address (the local cloud, their IMDS)
    and each other, nothing else. Names and subnets are unique per process and run, so concurrent
    test runs do not meet; `close()` removes the bridge, and each VM's veth goes with its namespace.
    """

    def __init__(self, bridge: str, subnet: ipaddress.IPv4Network) -> None:
        self.bridge = bridge
        self.subnet = subnet
        self.gateway = str(subnet.network_address + 1)
        self.mac = "02:5c:" + ":".join(f"{b:02x}" for b in subnet.network_address.packed)  # locally administered
        self._next_host = 2
        self._held: dict[str, str] = {}  # address -> the host end of the link of the VM that holds it
        self._reserved: set[str] = set()  # given to an instance at launch, its VM not booted yet
        self._pids: dict[str, int] = {}  # host end of a link -> the PID whose network namespace it leads to
        self.closed = False

    @classmethod
    def create(cls) -> VmNetwork:
        bridge = f"{_LINK_PREFIX}{os.getpid():x}n{next(_networks):x}"
        _ALLOCATION_LOCK.parent.mkdir(parents=True, exist_ok=True)
        with _ALLOCATION_LOCK.open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two processes must not pick the same free subnet
            _remove_stale_links()
            _remove_stale_state_mounts()
            used = {
                ipaddress.IPv4Interface(word).network
                for line in _ip("-o", "-4", "addr", "show").splitlines()
                for word in line.split()
                if "/" in word and word[0].isdigit()
            }
            subnets = list(NETWORK_RANGE.subnets(new_prefix=24))
            start = os.getpid() % len(subnets)
            free = [s for s in subnets[start:] + subnets[:start] if not any(s.overlaps(u) for u in used)]
            if not free:
                raise VmError(f"no free /24 left in {NETWORK_RANGE} for a VM network")
            network = cls(bridge, free[0])
            _ip("link", "add", bridge, "type", "bridge")
            try:
                # A bridge takes its lowest port's MAC unless given one: the VMs' ARP entries would go stale
                # each time a VM (a port) goes away.
                _ip("link", "set", bridge, "address", network.mac)
                _ip("addr", "add", f"{network.gateway}/24", "dev", bridge)
                _ip("link", "set", bridge, "up")
            except VmError:
                network.close()
                raise
        return network

    def __enter__(self) -> VmNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reserve(self) -> str:
        """The next free address, for an instance being launched: EC2 gives it its private address at launch, its
        VM boots with it (`attach(address=)`)."""
        if self.closed:
            raise VmError(f"VM network {self.bridge} is closed")
        if self._next_host > 254:
            raise VmError(f"VM network {self.bridge} is full")
        address = str(self.subnet.network_address + self._next_host)
        self._next_host += 1
        self._reserved.add(address)
        return address

    def attach(self, pid: int, imds_port: int, takeover: str = "", address: str = "") -> tuple[str, str]:
        """Give the network namespace of `pid` an address here (`address`: one reserved for it), and
        169.254.169.254:80 forwarded to its IMDS.

        takeover: a gone VM's address to take over (as a secondary private IP or a network interface moved to a
        backup in the same subnet on EC2), refused while a live VM holds it; the address comes locked against
        TCP from the other VMs (spotcr_agent.nodes) until the job's restore unlocks it. Returns the address and the
        name of the link's host end (a port of the bridge).
        """
        if self.closed:
            raise VmError(f"VM network {self.bridge} is closed")
        if takeover:
            address = self._free_for_takeover(takeover)
        elif address:
            if address not in self._reserved:
                raise VmError(f"{address} was not reserved on {self.bridge}")
            self._reserved.discard(address)
        elif self._next_host > 254:
            raise VmError(f"VM network {self.bridge} is full")
        else:
            address = str(self.subnet.network_address + self._next_host)
            self._next_host += 1
        host_end = f"{_LINK_PREFIX}{os.getpid():x}v{next(_veths):x}"
        # A MAC of the address's own, as a moved network interface keeps its MAC: the other VMs' ARP entries for
        # the address stay right when a backup takes it over.
        mac = "02:5d:" + ":".join(f"{b:02x}" for b in ipaddress.IPv4Address(address).packed)
        vm_end = ["peer", "name", VM_INTERFACE, "address", mac, "netns", str(pid)]
        _ip("link", "add", host_end, "type", "veth", *vm_end)
        _guard(host_end, address)
        _ip("link", "set", host_end, "master", self.bridge, "up")
        self._held[address] = host_end
        self._pids[host_end] = pid
        if takeover:
            for rule in nodes.lock_rules(address, str(self.subnet), unlocked=self.gateway):
                _iptables(pid, rule)
        for args in (
            ["link", "set", "lo", "up"],
            ["addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", VM_INTERFACE],
            ["link", "set", VM_INTERFACE, "up"],
            ["route", "add", f"{IMDS_ADDRESS}/32", "via", self.gateway],
        ):
            _ip(*args, netns_pid=pid)
        # The IMDS of this VM answers at its EC2 address: a DNAT in the VM's own namespace, nothing on the host.
        nat = ["-t", "nat", "-A", "OUTPUT", "-d", IMDS_ADDRESS, "-p", "tcp", "--dport", "80"]
        nat += ["-j", "DNAT", "--to-destination", f"{self.gateway}:{imds_port}"]
        _iptables(pid, nat)
        return address, host_end

    def _free_for_takeover(self, address: str) -> str:
        if ipaddress.IPv4Address(address) not in self.subnet or address == self.gateway:
            raise VmError(f"cannot take over {address}: not a VM address of {self.subnet}")
        if address in self._held:
            raise VmError(f"cannot take over {address}: a live VM holds it (its link {self._held[address]})")
        return address

    def holder(self, address: str) -> str | None:
        """The host end of the link of the VM that holds `address`, if any."""
        return self._held.get(address)

    def move(self, address: str, host_end: str) -> None:
        """EC2's AssignPrivateIpAddresses with AllowReassignment, within the subnet: `address` becomes the VM's whose
        link is `host_end` (its source check lets it through), refused while another live VM holds it (the control
        plane moves a node's address only once its VM is gone). The other VMs forget where the address was, as the
        VPC's network, which keeps no ARP cache, routes to the new holder at once. EC2 configures nothing in the VM:
        the agent puts the address on its interface."""
        holder = self._held.get(address)
        if holder == host_end:
            return
        if holder is not None:
            raise VmError(f"cannot move {address}: a live VM holds it (its link {holder})")
        if ipaddress.IPv4Address(address) not in self.subnet or address == self.gateway:
            raise VmError(f"cannot move {address}: not a VM address of {self.subnet}")
        _allow(host_end, address)
        self._held[address] = host_end
        # The host (the local cloud, the VMs' IMDS) is on the bridge too.
        subprocess.run(["ip", "neigh", "flush", "to", address, "dev", self.bridge], capture_output=True, check=False)
        for other, pid in self._pids.items():
            if other != host_end:
                flush = ["nsenter", "-t", str(pid), "-n", "ip", "neigh", "flush", "to", address]
                subprocess.run(flush, capture_output=True, check=False)  # a VM gone meanwhile: nothing to forget

    def release(self, address: str) -> None:
        """The VM that held `address` is gone: its link leaves the bridge, so that a VM taking the address (or any
        other it held) over is never a second holder. The link goes at once: a gone VM's network namespace may
        outlive its processes for a while (the kernel keeps a closed connection's socket until it times out), and
        must not answer meanwhile."""
        host_end = self._held.get(address)
        if host_end is None:
            return
        subprocess.run(["ip", "link", "delete", host_end], capture_output=True, check=False)  # gone already: fine
        if _link_exists(host_end):
            raise VmError(f"{address}: cannot remove the link {host_end} of the VM that held it")
        _unguard(host_end)
        self._pids.pop(host_end, None)
        for held in [a for a, end in self._held.items() if end == host_end]:
            del self._held[held]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True, check=False)
            for host_end in list(self._pids):
                _unguard(host_end)
            self._pids.clear()


def _iptables(pid: int, rule: list[str]) -> None:
    argv = ["nsenter", "-t", str(pid), "-n", "iptables", "-w", *rule]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise VmError(f"`{' '.join(argv)}` failed in the VM's network: {result.stderr.strip()}")


def _ebtables(*args: str, check: bool = True) -> str:
    result = subprocess.run(["ebtables-nft", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise VmError(f"`ebtables-nft {' '.join(args)}` failed: {result.stderr.strip()}")
    return result.stdout


def _guard_chain(host_end: str) -> str:
    return _GUARD_PREFIX + host_end.removeprefix(_LINK_PREFIX)


def _guard(host_end: str, address: str) -> None:
    """EC2's source check on a VM's link: what the VM sends from an address its interface was not given (ARP or
    IPv4) goes nowhere. A VM that configures a node address before EC2 moved it to its interface is not heard."""
    chain = _guard_chain(host_end)
    _ebtables("-N", chain, "-P", "RETURN")
    for kind in ("ARP", "IPv4"):
        _ebtables("-A", chain, "-p", kind, "-j", "DROP")
    _allow(host_end, address)
    for hook in ("FORWARD", "INPUT"):
        _ebtables("-A", hook, "-i", host_end, "-j", chain)


def _allow(host_end: str, address: str) -> None:
    chain = _guard_chain(host_end)
    _ebtables("-I", chain, "1", "-p", "ARP", "--arp-ip-src", address, "-j", "RETURN")
    _ebtables("-I", chain, "1", "-p", "IPv4", "--ip-src", address, "-j", "RETURN")


def _unguard(host_end: str) -> None:
    chain = _guard_chain(host_end)
    for hook in ("FORWARD", "INPUT"):
        _ebtables("-D", hook, "-i", host_end, "-j", chain, check=False)
    _ebtables("-F", chain, check=False)  # ebtables-nft deletes only an empty chain
    _ebtables("-X", chain, check=False)


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True, check=False).returncode == 0


class LocalVM:
    """One instance of the local cloud. `boot()` starts it, `terminate()` ends it."""

    def __init__(
        self,
        *,
        instance_id: str,
        instance_type: str,
        availability_zone: str,
        user_data: bytes,
        tags: Callable[[], Mapping[str, str]],
        root: Path,
        cloud_env: Mapping[str, str],
        network: VmNetwork,
        shared_storage: Path | None = None,
        boot_commands: list[list[str]] | None = None,
        agent_command: list[str] | None = None,
        takeover: str = "",
        address: str = "",
    ) -> None:
        self.instance_id = instance_id
        self.instance_type = instance_type
        self.root = root / instance_id
        self.network = network
        self.takeover = takeover  # a gone VM's address this one boots with (VmNetwork.attach)
        self.reserved = address  # the address EC2 gave the instance at launch (VmNetwork.reserve), if any
        self.address = ""  # the VM's private address, known once it has booted
        self.host_interface = ""  # the host end of its link to the network's bridge
        self.imds = Imds(instance_id, instance_type, availability_zone, user_data, tags, host=network.gateway)
        self.shared_storage = shared_storage
        self.boot_commands = boot_commands or []
        self.agent_command = agent_command or [sys.executable, "-m", "spotcr_agent"]
        self.env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "PYTHONPATH": f"{REPO / 'functions'}:{REPO / 'vm-bootstrap'}",
            "PYTHONDONTWRITEBYTECODE": "1",
            **cloud_env,
        }
        self._process: subprocess.Popen[bytes] | None = None
        self._lifeline = -1
        self.init_pid = 0
        self.terminated = False
        self.running_at: float | None = None

    def dir(self, name: str) -> Path:
        """The host directory behind one of the VM's private paths."""
        return self.root / name

    def host_path(self, vm_path: str) -> Path:
        """Where a path under the VM's /var/lib/spotcr lives on the host."""
        relative = Path(vm_path).relative_to(PRIVATE_PATHS["state"])
        return self.dir("state") / relative

    @property
    def log_path(self) -> Path:
        return self.root / "console.log"

    def boot(self) -> None:
        """Start the VM; returns once its mounts and network are up and its boot commands have started."""
        for marker in ("ready", "go", "go.new"):
            (self.root / marker).unlink(missing_ok=True)
        for name in PRIVATE_PATHS:
            self.dir(name).mkdir(parents=True, exist_ok=True)
        # A file system of its own, as an EC2 VM's disk is: bound from the host's root file system instead, a job's
        # nested mount namespace is dumped as a bind of that root at this VM's host path, which every VM can reach.
        if not os.path.ismount(self.dir("state")):
            source = f"{_STATE_SOURCE}{os.getpid():x}"  # the booting process: a sweep knows when it is gone
            subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755", source, str(self.dir("state"))], check=True)
        agent = self.dir("opt") / "bin" / "spotcr-agent"
        agent.parent.mkdir(parents=True, exist_ok=True)
        # bootstrap.sh installs the agent under /opt/spotcr; here it runs from the checkout.
        agent.write_text(f'#!/bin/sh\nexec {shlex.join(self.agent_command)} "$@"\n')
        agent.chmod(0o755)
        binds = [f"{self.dir(name)}={path}" for name, path in PRIVATE_PATHS.items()]
        if self.shared_storage is not None:
            binds.append(f"{self.shared_storage}={STORAGE_MOUNT}")
        # vm_init holds the read end: when this process dies, however it dies, the VM ends with it.
        lifeline, self._lifeline = os.pipe()
        argv = [
            "unshare",
            "--mount",
            "--pid",
            "--net",
            "--uts",
            "--fork",
            "--propagation",
            "private",
            "--mount-proc",
            sys.executable,
            "-m",
            "rehearsal.vm_init",
            str(self.root),
            str(lifeline),
            *binds,
        ]
        for command in self.boot_commands:
            argv += ["--", *command]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                argv,
                env={**self.env, "PYTHONPATH": f"{REPO}:{self.env['PYTHONPATH']}"},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd="/",
                start_new_session=True,
                pass_fds=(lifeline,),
            )
        os.close(lifeline)
        self.init_pid = self._find_init_pid()
        deadline = time.monotonic() + 10
        while not (self.root / "ready").exists():
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise VmError(f"{self.instance_id}: VM did not come up, see {self.log_path}")
            time.sleep(0.01)
        self.address, self.host_interface = self.network.attach(
            self.init_pid, self.imds.port, self.takeover, self.reserved
        )
        self.imds.local_ipv4 = self.address
        # vm_init starts the boot commands only now, as cloud-init runs once the network is up.
        go = self.root / "go.new"
        go.write_text(f"{self.address}\n")
        go.rename(self.root / "go")  # whole or absent: vm_init reads it as soon as it exists

    def _find_init_pid(self) -> int:
        assert self._process is not None
        children = Path(f"/proc/{self._process.pid}/task/{self._process.pid}/children")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                pids = children.read_text().split()
            except FileNotFoundError as error:
                raise VmError(f"{self.instance_id}: VM exited at boot, see {self.log_path}") from error
            if pids:
                return int(pids[0])
            time.sleep(0.01)
        raise VmError(f"{self.instance_id}: VM init did not start")

    def run(self, argv: list[str], timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
        """Run a command inside the VM, as SSM Run Command would."""
        if self.terminated or not self.init_pid:
            raise VmError(f"{self.instance_id} is not running")
        return subprocess.run(
            ["nsenter", "-t", str(self.init_pid), "-m", "-p", "-n", "-u", "--", *argv],
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd="/",
            check=False,
        )

    def attach_device(self, volume_id: str, device: str) -> None:
        link = self.dir("by-id") / ebs_link_name(volume_id)
        link.unlink(missing_ok=True)
        link.symlink_to(device)

    def detach_device(self, volume_id: str) -> None:
        (self.dir("by-id") / ebs_link_name(volume_id)).unlink(missing_ok=True)

    def terminate(self) -> None:
        if self.terminated:
            return
        self.terminated = True
        if self.init_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.init_pid, signal.SIGKILL)
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait(timeout=5)
        self.imds.stop()
        if self.address:
            self.network.release(self.address)
        self._release_state()

    def _release_state(self) -> None:
        """An ended VM's own file system goes with it: its files stay on the host's disk for a post-mortem, its tmpfs
        is unmounted, so a run of many VMs holds no mount per ended VM (each new VM's namespace would copy them)."""
        state = self.dir("state")
        if not os.path.ismount(state):
            return
        kept = self.root / "state.kept"
        kept.mkdir(exist_ok=True)
        subprocess.run(["cp", "-a", f"{state}/.", str(kept)], check=False)  # cp copies FIFOs and sockets as such
        subprocess.run(["umount", "--lazy", str(state)], check=False)
        subprocess.run(["cp", "-a", f"{kept}/.", str(state)], check=False)
        shutil.rmtree(kept, ignore_errors=True)

    def remove(self) -> None:
        if os.path.ismount(self.dir("state")):
            subprocess.run(["umount", "--lazy", str(self.dir("state"))], check=False)
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def bare_vm(
    root: Path,
    network: VmNetwork,
    *,
    instance_id: str = "",
    boot_commands: list[list[str]] | None = None,
    cloud_env: Mapping[str, str] | None = None,
    tags: Mapping[str, str] | None = None,
    shared_storage: Path | None = None,
    takeover: str = "",
) -> Iterator[LocalVM]:
    """A booted bare VM outside the local cloud, terminated and its files removed on exit.

    `boot_commands` run in order as the VM's boot (default `sleep infinity`: the VM idles until the
    test runs commands in it with `vm.run`). `root` holds the VM's private directories. `takeover`: the
    address of a terminated VM that this one boots with (VmNetwork.attach).
    """
    vm = LocalVM(
        instance_id=instance_id or f"i-bare{os.getpid():x}{next(_veths):x}",
        instance_type="c5.large",
        availability_zone="us-east-1a",
        user_data=b"",
        tags=lambda: dict(tags or {}),
        root=root,
        cloud_env=cloud_env or {},
        network=network,
        shared_storage=shared_storage,
        boot_commands=boot_commands or [["sleep", "infinity"]],
        takeover=takeover,
    )
    prepare_host()
    try:
        vm.boot()
        yield vm
    finally:
        vm.terminate()
        vm.remove()
