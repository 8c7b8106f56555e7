import argparse
import contextlib
import os
import shutil
import socket
import sys
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


def imds_with_tags(tags):
    """IMDS of a job VM whose instance carries these tags."""
    values = {
        "meta-data/instance-id": "i-0abc",
        "meta-data/placement/availability-zone": "eu-west-1b",
        "meta-data/placement/region": "eu-west-1",
        "meta-data/tags/instance": "\n".join(tags),
    }
    values.update({f"meta-data/tags/instance/{k}": v for k, v in tags.items()})
    return FakeMetadata(values)


def bootstrap_args(**overrides):
    """The flags `spotcr-agent bootstrap` gets from the user data, with these overrides."""
    values = {
        "bucket": "spotcr-checkpoints",
        "event_bus": "spotcr",
        "ebs_volume_id": "",
        "efs_id": "",
        "efs_isolation": "",
        "fsx_dns": "",
        "fsx_mount_name": "",
        "store_credentials_url": "",
        "scratch_dir": "",
        "report_failure": "",
    }
    values.update(overrides)
    return argparse.Namespace(**values)


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
        "run_id": "r-00000000000000a1",  # registered: the daemon starts the job at once
        "workdir": tmp_path / "work",
        "state_dir": tmp_path / name / "state",
        "scratch_dir": tmp_path / name / "scratch",
        "mount_point": tmp_path / "store",
        "command": compute_command(),
        # For the tests with fakes on the host, where /tmp and /dev/shm are everyone's (jobs on bare VMs carry them).
        "local_dirs": (),
    }
    values.update(overrides)
    return AgentConfig(**values)


def make_agent(config, publisher, store=None):
    if store is None:
        config.mount_point.mkdir(parents=True, exist_ok=True)
        store = CheckpointStore.for_directory(config.mount_point, config.job_id)
    return Agent(config=config, publisher=publisher, job_env=base_job_env(os.environ), store_factory=lambda _: store)


def kill_tree(pid):
    """SIGKILL the job's PID 1: the kernel then kills its whole PID namespace."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)


@pytest.fixture(scope="session")
def criu_available():
    """CRIU tests must not skip silently: fail loudly when CRIU is not usable."""
    assert os.geteuid() == 0, "CRIU tests need root"
    assert shutil.which("criu"), "criu is not installed: run `make criu`"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
