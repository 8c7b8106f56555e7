"""A local VM: a process tree in its own mount and PID namespaces, with its own IMDS.

Each VM sees its own `/var/lib/spotcr`, `/etc/spotcr`, `/opt/spotcr` and `/dev/disk/by-id` at the
same paths as every other VM (CRIU restores need identical paths), shares the host's network
(the local cloud and the IMDS listen on loopback), and runs the real agent as bootstrap.sh would.
Killing the namespace's PID 1 ends every process of the VM, as a terminated instance does.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

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
        shared_storage: Path | None = None,
        boot_commands: list[list[str]] | None = None,
        agent_command: list[str] | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.instance_type = instance_type
        self.root = root / instance_id
        self.imds = Imds(instance_id, instance_type, availability_zone, user_data, tags)
        self.shared_storage = shared_storage
        self.boot_commands = boot_commands or []
        self.agent_command = agent_command or [sys.executable, "-m", "spotcr_agent"]
        self.env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "PYTHONPATH": f"{REPO / 'functions'}:{REPO / 'vm-bootstrap'}",
            "PYTHONDONTWRITEBYTECODE": "1",
            "SPOTCR_IMDS_ENDPOINT": self.imds.endpoint,
            **cloud_env,
        }
        self._process: subprocess.Popen[bytes] | None = None
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
        (self.root / "ready").unlink(missing_ok=True)
        for name in PRIVATE_PATHS:
            self.dir(name).mkdir(parents=True, exist_ok=True)
        agent = self.dir("opt") / "bin" / "spotcr-agent"
        agent.parent.mkdir(parents=True, exist_ok=True)
        # bootstrap.sh installs the agent under /opt/spotcr; here it runs from the checkout.
        agent.write_text(f'#!/bin/sh\nexec {shlex.join(self.agent_command)} "$@"\n')
        agent.chmod(0o755)
        binds = [f"{self.dir(name)}={path}" for name, path in PRIVATE_PATHS.items()]
        if self.shared_storage is not None:
            binds.append(f"{self.shared_storage}={STORAGE_MOUNT}")
        argv = [
            "unshare",
            "--mount",
            "--pid",
            "--fork",
            "--propagation",
            "private",
            "--mount-proc",
            sys.executable,
            "-m",
            "rehearsal.vm_init",
            str(self.root / "ready"),
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
            )
        self.init_pid = self._find_init_pid()
        deadline = time.monotonic() + 10
        while not (self.root / "ready").exists():
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise VmError(f"{self.instance_id}: VM did not come up, see {self.log_path}")
            time.sleep(0.01)

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
            ["nsenter", "-t", str(self.init_pid), "-m", "-p", "--", *argv],
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
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait(timeout=5)
        self.imds.stop()

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
