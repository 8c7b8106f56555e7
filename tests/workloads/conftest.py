import contextlib
import json
import sys
import time
from pathlib import Path

import pytest
from spotcr_agent.config import AgentConfig

from rehearsal.vm import LocalVM, VmNetwork, bare_vm

from .build import REPO, build_all

STORAGE = Path("/mnt/spotcr")  # the job's storage (EFS-like), the same host directory in every VM
AGENT_TIMEOUT_S = 240


@pytest.fixture(scope="session")
def built():
    """The Go, C and Java programs, compiled once (cached under .build/workloads while their sources are unchanged)."""
    return build_all()


class WorkloadVM:
    """A bare VM (rehearsal.vm) running the real agent, one operation at a time, as SSM runs it."""

    def __init__(self, vm: LocalVM, job_id: str):
        self.vm = vm
        self.job_id = job_id
        self.workdir = f"/var/lib/spotcr/work/{job_id}"

    def configure(self, generation, mode, command=(), env=None):
        config = AgentConfig(
            job_id=self.job_id,
            instance_id=self.vm.instance_id,
            storage="efs",
            generation=generation,
            mode=mode,
            mount_point=STORAGE,
            command=tuple(command),
            env=dict(env or {}),
        )
        config.write(self.vm.dir("etc") / "agent.json")

    def host(self, name):
        """A file of the job's work dir, seen from the host."""
        return self.vm.host_path(f"{self.workdir}/{name}")

    def python(self, module, *args, timeout=AGENT_TIMEOUT_S):
        argv = ["env", f"PYTHONPATH={REPO}/functions:{REPO}/vm-bootstrap:{REPO}", sys.executable, "-m", module]
        result = self.vm.run([*argv, *args], timeout_s=timeout)
        lines = result.stdout.strip().splitlines()
        if not lines:
            raise AssertionError(f"{module} {' '.join(args)} printed nothing: {result.stderr[-3000:]}")
        return json.loads(lines[-1]), result.stderr

    def agent(self, *op, timeout=AGENT_TIMEOUT_S):
        """One agent operation (tests/agent/vm_agent.py, reading the VM's /etc/spotcr/agent.json); its result,
        or an AssertionError saying what CRIU said."""
        answer, stderr = self.python("tests.agent.vm_agent", *op, timeout=timeout)
        if not answer.get("ok"):
            raise AssertionError(
                f"{' '.join(op)} on {self.vm.instance_id} failed: {answer.get('error')}\n"
                f"first CRIU errors: {self.criu_errors()}\nagent log: {stderr[-1500:]}"
            )
        return answer

    def mount_points(self, pid="self"):
        """Mount points of a process of this VM (the job's PID 1 by default: its own mount namespace)."""
        text = self.vm.run(["cat", f"/proc/{pid}/mountinfo"]).stdout
        return {line.split()[4] for line in text.splitlines()}

    def holds(self, checks):
        checks = [c.format(workdir=self.workdir) for c in checks]
        return self.python("tests.workloads.probe", "/var/lib/spotcr", *checks)[0]["held"]

    def progress(self):
        path = self.host("progress.log")
        return len(path.read_text().splitlines()) if path.exists() else 0

    def wait_progress(self, steps, timeout=120.0):
        deadline = time.monotonic() + timeout
        while self.progress() < steps:
            exit_code = self.host(".spotcr/exit-code")
            if exit_code.exists() or time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.job_id} reached step {self.progress()}, not {steps} "
                    f"(exit code {exit_code.read_text().strip() if exit_code.exists() else 'none'}); "
                    f"stderr: {self.stderr()}"
                )
            time.sleep(0.05)

    def stderr(self):
        path = self.host(".spotcr/stderr.log")
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def events(self, detail_type):
        path = self.vm.dir("etc") / "events.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [e for e in map(json.loads, lines) if e["type"] == detail_type]

    def criu_errors(self):
        """The Error lines of every CRIU log this VM kept, without the RLIMIT_NOFILE noise."""
        errors = []
        for log in sorted(self.vm.dir("state").rglob("*.log")):
            if log.name in ("dump.log", "restore.log"):
                lines = log.read_text(errors="replace").splitlines()
                errors += [f"{log.name}: {line}" for line in lines if "Error" in line and "RLIMIT" not in line][:3]
        return errors


@pytest.fixture
def workload_vms(tmp_path):
    """Boots bare VMs sharing one job storage: `make(job_id)`; every VM and the network go at the end."""
    storage = tmp_path / "storage"
    storage.mkdir()
    with VmNetwork.create() as network, contextlib.ExitStack() as stack:

        def make(job_id):
            vm = stack.enter_context(bare_vm(tmp_path / "vms", network, shared_storage=storage))
            return WorkloadVM(vm, job_id)

        yield make
