"""A local VM as bare as a fresh EC2 VM, for the agent's CRIU tests until the shared bare-VM primitive lands.

Its own mount namespace with empty tmpfs /tmp, /var/tmp and /dev/shm and, given an address, its own network
namespace holding only loopback and that address. The agent runs inside it through `vm_agent.py`, as SSM runs
`spotcr-agent` on a VM; the job it starts, and CRIU, live there too.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).parents[2]
PYTHONPATH = os.pathsep.join(str(ROOT / p) for p in ("functions", "vm-bootstrap", "."))
LOCAL_MOUNTS = ("/tmp", "/var/tmp", "/dev/shm")


class LocalVM:
    def __init__(self, name, address=None):
        self.name = name
        self.address = address
        setup = [f"mount -t tmpfs -o mode=1777,size=512m spotcr-{name} {d}" for d in LOCAL_MOUNTS]
        if address:
            # No dummy interfaces on this kernel: the VM's address sits on its own loopback, reachable from inside.
            setup += ["ip link set lo up", f"ip addr add {address}/32 dev lo"]
        script = " && ".join(setup) + " && echo ready && exec sleep 100000"
        argv = ["unshare", "--mount", "--propagation", "private", *(["--net"] if address else []), "sh", "-c", script]
        self.holder = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        if self.holder.stdout.readline().strip() != "ready":
            self.holder.kill()
            raise RuntimeError(f"local VM {name} could not be set up ({argv})")

    def enter(self, cwd=ROOT):
        # Entering a mount namespace moves the working directory to its root: --wd sets it again.
        net = ["-n"] if self.address else []
        return ["nsenter", "-t", str(self.holder.pid), "-m", *net, f"--wd={cwd}", "--"]

    def run(self, argv, check=True, cwd=ROOT, **kwargs):
        return subprocess.run([*self.enter(cwd), *argv], check=check, capture_output=True, text=True, **kwargs)

    def agent(self, config_path, *op, check=True, timeout=180):
        """One agent operation inside the VM (tests/agent/vm_agent.py); its JSON result."""
        env = {**os.environ, "PYTHONPATH": PYTHONPATH}
        argv = [sys.executable, "-m", "tests.agent.vm_agent", str(config_path), *op]
        result = self.run(argv, check=False, env=env, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(op)} in {self.name} failed: {result.stdout}\n{result.stderr[-3000:]}")
        return json.loads(result.stdout.strip().splitlines()[-1]) if result.stdout.strip() else {}

    def close(self):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.holder.pid, signal.SIGKILL)
        self.holder.wait()


@contextlib.contextmanager
def local_vms():
    vms = []

    def make(name, address=None):
        vms.append(LocalVM(name, address))
        return vms[-1]

    try:
        yield make
    finally:
        for vm in vms:
            vm.close()


@contextlib.contextmanager
def outside_tmp():
    """A test's own directory outside /tmp and /var/tmp, which every local VM has empty."""
    path = Path(tempfile.mkdtemp(prefix=f"spotcr-test-{os.getpid()}-{uuid.uuid4().hex[:6]}-", dir="/var/lib"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
