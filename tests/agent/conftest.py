import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from spotcr_agent.agent import Agent, base_job_env
from spotcr_agent.config import AgentConfig
from spotcr_agent.store import CheckpointStore

JOBS = Path(__file__).parent / "jobs"
COMPUTE = JOBS / "compute.py"


class FakePublisher:
    def __init__(self):
        self.events = []

    def publish(self, event):
        self.events.append(event)
        return True

    def of(self, detail_type):
        return [e for e in self.events if detail_type == e.DETAIL_TYPE]


class FakeMetadata:
    """IMDS as a dict of paths; a missing path reads as 404."""

    def __init__(self, values=None):
        self.values = dict(values or {})

    def get(self, path):
        return self.values.get(path.rstrip("/"))


@pytest.fixture
def storage(tmp_path):
    """The job's storage, shared by the bare VMs of a test (each sees it at its mount point)."""
    path = tmp_path / "storage"
    path.mkdir()
    return path


@pytest.fixture
def publisher():
    return FakePublisher()


def compute_command(megabytes=200, steps=30, step_seconds=0.1):
    return (sys.executable, str(COMPUTE), str(megabytes), str(steps), str(step_seconds))


def make_config(tmp_path, name="vm1", **overrides):
    values = {
        "job_id": "job-1",
        "instance_id": f"i-{name}",
        "storage": "efs",
        "generation": 1,
        "workdir": tmp_path / "work",
        "state_dir": tmp_path / name / "state",
        "scratch_dir": tmp_path / name / "scratch",
        "mount_point": tmp_path / "store",
        "command": compute_command(),
        # On the host, /tmp and /dev/shm are everyone's: only tests on a LocalVM carry VM-local places whole.
        "local_dirs": (),
    }
    values.update(overrides)
    return AgentConfig(**values)


def make_agent(config, publisher, store=None):
    if store is None:
        config.mount_point.mkdir(parents=True, exist_ok=True)
        store = CheckpointStore.for_directory(config.mount_point, config.job_id)
    return Agent(config=config, publisher=publisher, job_env=base_job_env(os.environ), store_factory=lambda _: store)


def wait_for(predicate, timeout=30.0, interval=0.05, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_for_exit(agent, timeout=60.0):
    """Watch the job as the daemon does until it ends; its exit code."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = agent.watch_job()
        if code is not None:
            return code
        time.sleep(0.05)
    raise AssertionError(f"the job did not end within {timeout} s")


def progress_lines(workdir):
    path = Path(workdir) / "progress.log"
    return path.read_text().splitlines() if path.exists() else []


def kill_tree(pid):
    """SIGKILL the job's PID 1: the kernel then kills its whole PID namespace."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)


@pytest.fixture(scope="session")
def reference_output(tmp_path_factory):
    """What an uninterrupted run of the compute job writes, per (megabytes, steps)."""
    cache = {}

    def run(megabytes=200, steps=30):
        key = (megabytes, steps)
        if key not in cache:
            workdir = tmp_path_factory.mktemp("reference")
            result = subprocess.run(
                compute_command(megabytes, steps, 0), cwd=workdir, capture_output=True, text=True, check=True
            )
            cache[key] = ((workdir / "progress.log").read_text(), result.stdout)
        return cache[key]

    return run


@pytest.fixture(scope="session")
def criu_available():
    """CRIU tests must not skip silently: fail loudly when CRIU is not usable."""
    assert os.geteuid() == 0, "CRIU tests need root"
    assert shutil.which("criu"), "criu is not installed: run `make criu`"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def moto_s3():
    """A moto S3 server on loopback; yields the environment that points boto3 at it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()
