"""Fixtures shared by every test area. Areas add their own in tests/<area>/conftest.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from moto.server import ThreadedMotoServer

from rehearsal.localaws import s3
from rehearsal.vm import LocalVM, VmNetwork
from rehearsal.vm import bare_vm as rehearsal_bare_vm

# The tests are a test build, as `make test` says too: the agent asset may carry the EFS helper's stand-in.
os.environ.setdefault("SPOTCR_EFS_UTILS", "stand-in")

# Tests that boot local VMs or run CRIU share the host's namespaces and bridges and wait on timed notices: they carry
# the mark `vms`, and `make test` runs them one after another in one pytest process beside another that runs the rest.
VM_MARKS = {"criu", "e2e", "faults", "workload", "tracked", "gpu"}
VM_FIXTURES = {"criu_bin", "vm_network", "bare_vm", "cloud", "shared_cloud"}


def pytest_itemcollected(item: pytest.Item) -> None:
    marks = {mark.name for mark in item.iter_markers()}
    if marks & VM_MARKS or VM_FIXTURES & set(getattr(item, "fixturenames", ())):
        item.add_marker(pytest.mark.vms)


@pytest.fixture(scope="session")
def criu_bin() -> str:
    """The CRIU that `make test` installed; a test that needs it fails loudly rather than skip."""
    path = shutil.which("criu", path=f"/usr/local/sbin:{os.environ.get('PATH', '')}")
    assert path, "criu not found: run `make criu` (vm-bootstrap/install-criu.sh)"
    assert os.geteuid() == 0, "CRIU tests need root"
    check = subprocess.run([path, "check"], capture_output=True, text=True, check=False)
    assert check.returncode == 0, f"criu check failed: {check.stdout}{check.stderr}"
    return path


@pytest.fixture
def vm_network() -> Iterator[VmNetwork]:
    """A private network for bare VMs (rehearsal.vm), removed after the test."""
    with VmNetwork.create() as network:
        yield network


@pytest.fixture
def bare_vm(tmp_path: Path, vm_network: VmNetwork) -> Iterator[Callable[..., LocalVM]]:
    """Boots bare VMs on `vm_network`: `vm = bare_vm()`, then `vm.run([...])`; all terminated after the test.

    Keyword arguments go to rehearsal.vm.bare_vm (boot_commands, cloud_env, tags, shared_storage, instance_id).
    """
    with contextlib.ExitStack() as stack:

        def boot(**options: Any) -> LocalVM:
            return stack.enter_context(rehearsal_bare_vm(tmp_path / "vms", vm_network, **options))

        yield boot


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A moto server on loopback, for code that reaches AWS over HTTP as the agent does (not moto's mock); S3 checks
    each put's checksum, as S3 does."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with contextlib.ExitStack() as patches:
        s3.verify_checksums(patches)
        yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point boto3 at the moto server the way the agent is pointed at any endpoint: plain configuration."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return moto_endpoint
