from __future__ import annotations

from collections.abc import Iterator

import pytest

from rehearsal.cloud import LocalCloud
from rehearsal.scenario import local_cloud, reference_result
from rehearsal.timeline import Timeline
from tests.faults.harness import OPTIONS


@pytest.fixture(scope="package")
def shared_cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCloud]:
    """One local cloud for the whole suite (its start is the costly part); each scenario runs its own job on its
    own VMs, and ends with the leak check, so the next one starts from a tidy account. Stopped when the suite ends:
    its moto hooks (VMs booted by RunInstances, SSM only to registered instances) must not outlive it into the
    tests that follow in the same session."""
    cloud = local_cloud(OPTIONS, tmp_path_factory.mktemp("fault-cloud"), Timeline())
    cloud.start()
    try:
        yield cloud
    finally:
        cloud.stop()


@pytest.fixture(scope="package")
def reference(shared_cloud: LocalCloud) -> bytes:
    """The uninterrupted run's result, computed once for every scenario (the same job, on a bare VM of its own)."""
    return reference_result(shared_cloud, OPTIONS, "/var/lib/spotcr/work/fault-reference", print, lambda vm: None)


@pytest.fixture
def cloud(shared_cloud: LocalCloud) -> Iterator[LocalCloud]:
    yield shared_cloud
    shared_cloud.store_fault = None
    shared_cloud.on_command = None
