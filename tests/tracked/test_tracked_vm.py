"""The agent's memory-tracking path with the real CRIU on Debian 12's own kernel (a QEMU VM, tests/tracked/vm.py):
periodic pre-dumps, an incremental final dump, a lost VM, a restore, and the same output as an uninterrupted run."""

import pytest

from . import run, vm

# Boot and run take about 4 minutes on 2 loaded cores; the module's first test pays for them.
pytestmark = [pytest.mark.tracked, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    try:
        vm.kernel()
        vm.qemu()
    except vm.VMUnavailable as error:
        pytest.fail(f"{error} (make test runs it)")
    share = tmp_path_factory.mktemp("tracked-vm")
    document, result = run.run_in_vm(share)
    assert "error" not in document, f"{document.get('traceback') or document['error']}\n{result.output[-4000:]}"
    assert result.rc == 0, result.serial[-3000:]
    return document


def test_the_vm_runs_debians_kernel_with_memory_tracking(tracked_run):
    assert tracked_run["kernel"].endswith("-amd64")
    assert tracked_run["criu_check"] is True  # criu check --feature mem_dirty_track passes in the guest


def test_periodic_checkpoints_pre_dump_and_build_a_chain_the_final_dump_is_incremental_on(tracked_run):
    full, first, second, final = tracked_run["checkpoints"]
    # The comparison dump took the path of kernels without tracking, and said so
    assert full["memory_tracking"].startswith("full dump:")
    # The first tracked periodic checkpoint starts a chain; the second builds on the first
    assert first["memory_tracking"].startswith("incremental: pre-dump") and "a fresh chain" in first["memory_tracking"]
    assert f"on checkpoint {first['checkpoint_id']}" in second["memory_tracking"]
    on_second = f"incremental: dump on 4 parent image dirs (on checkpoint {second['checkpoint_id']}"
    assert final["memory_tracking"].startswith(on_second)
    # Every checkpoint holds its whole chain: the final one its own images and four parent directories
    assert sorted(final["page_bytes"]) == ["images"] + [f"images{'/parent' * d}" for d in range(1, 5)]
    # The final dump wrote what changed since the second periodic checkpoint, not all of memory
    assert final["page_bytes"]["images"] < full["page_bytes"]["images"] / 3
    assert final["bytes_uploaded"] < full["bytes_uploaded"] / 3


def test_the_restored_job_ends_as_an_uninterrupted_run(tracked_run, tmp_path):
    final = tracked_run["checkpoints"][-1]
    assert tracked_run["restore"]["checkpoint_id"] == final["checkpoint_id"]
    assert tracked_run["exit_code"] == 0
    assert tracked_run["restored"] == run.reference(tmp_path / "reference")
    published = [e for e in tracked_run["events"] if e["type"] == "CheckpointCompleted"]
    assert [e["memory_tracking"] for e in published] == [c["memory_tracking"] for c in tracked_run["checkpoints"]]
