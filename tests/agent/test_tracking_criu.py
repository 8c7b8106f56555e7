"""Memory tracking chosen at run time, with the real CRIU: on a kernel without soft-dirty tracking (this machine's)
the agent takes full dumps and says why; the tracked path itself runs in the Debian-kernel VM (tests/tracked)."""

import os
import subprocess

import pytest
from spotcr_agent.criu import MEM_DIRTY_TRACK, Criu

from tests.support import wait_for

from .conftest import compute_command
from .vm_agent import JobVM

pytestmark = [pytest.mark.criu, pytest.mark.usefixtures("criu_available")]


def _kernel_tracks() -> bool:
    check = subprocess.run(["criu", "check", "--feature", MEM_DIRTY_TRACK], capture_output=True, check=False)
    return check.returncode == 0


def test_the_choice_follows_crius_feature_check_and_names_the_reason():
    tracked, why = Criu().memory_tracking()
    assert tracked == _kernel_tracks()
    assert f"criu check --feature {MEM_DIRTY_TRACK}" in why
    if not tracked:
        assert os.uname().release in why and "CONFIG_MEM_SOFT_DIRTY" in why


def test_each_checkpoint_reports_how_it_was_dumped(bare_vm, storage):
    # Given a job on a VM of this machine's kernel
    job = JobVM(bare_vm(shared_storage=storage), command=compute_command(32, 200, 0.1))
    job.agent("start")
    wait_for(lambda: len(job.progress()) >= 2, what="progress")
    # When it is checkpointed, periodic then final
    periodic = job.agent("checkpoint", "periodic", "1")
    final = job.agent("checkpoint", "final", "1")
    # Then the outcome and the event say which path the agent took and why
    completed = {e["kind"]: e["memory_tracking"] for e in job.events("CheckpointCompleted")}
    assert completed == {"periodic": periodic["memory_tracking"], "final": final["memory_tracking"]}
    if _kernel_tracks():
        assert periodic["memory_tracking"].startswith("incremental: pre-dump (frozen ")
        assert final["memory_tracking"].startswith("incremental: dump on 2 parent image dirs")
    else:
        for how in completed.values():
            assert how.startswith("full dump: kernel ") and "no dirty-memory tracking" in how
