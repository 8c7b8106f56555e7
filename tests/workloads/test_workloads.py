"""Real third-party programs through the real agent on bare VMs: started on VM A, checkpointed while running, then
moved to VM B (another address, empty /tmp, /var/tmp and /dev/shm), and ending there byte for byte as an
uninterrupted run of the same program on a VM of its own. Two ways to lose VM A: a spot warning (final dump),
and a VM that just vanishes (VM B restores the periodic checkpoint while the job had run on past it)."""

import pytest

from .workloads import REFUSED, WORKLOADS

pytestmark = [pytest.mark.workload, pytest.mark.criu, pytest.mark.claim("The result equals an uninterrupted run's")]

STEPS_BETWEEN_DUMPS = 5


def _unless_known(workload, check, *args):
    """Run `check`; a workload's known limitation fails exactly as written (an xfail), anything else as usual."""
    if not workload.known_failure:
        check(workload, *args)
        return
    try:
        check(workload, *args)
    except (AssertionError, pytest.fail.Exception) as error:
        if workload.known_failure not in str(error):
            raise
        pytest.xfail(f"known limitation: {workload.known_failure}")
    pytest.fail(f"{workload.name} now passes: remove its known_failure ({workload.known_failure!r})")


def _move(workload, built, workload_vms, interruption):
    _unless_known(workload, _move_and_compare, built, workload_vms, interruption)


def _move_and_compare(workload, built, workload_vms, interruption):
    command = workload.command(built)
    job_id = f"wl-{workload.name}"[:63]

    # Given an uninterrupted run on a VM of its own, and the same program started on VM A
    reference = workload_vms(job_id)
    reference.configure(1, "run", command, workload.env)
    reference.agent("start")
    primary = workload_vms(job_id)
    primary.configure(1, "run", command, workload.env)
    job_pid = primary.agent("start")["pid"]

    # When it is checkpointed while it holds what the workload is about, runs on, and VM A is lost
    primary.wait_progress(workload.first_dump_at)
    held = primary.holds(workload.holds)
    assert all(held.values()), f"at the periodic checkpoint the job does not hold {held}"
    job_mounts = primary.mount_points(job_pid)
    periodic = primary.agent("checkpoint", "periodic", "1")
    primary.wait_progress(workload.first_dump_at + STEPS_BETWEEN_DUMPS)
    expected = [periodic["checkpoint_id"]]
    if interruption == "final-dump":
        held = primary.holds(workload.holds)
        assert all(held.values()), f"at the final dump the job does not hold {held}"
        expected.append(primary.agent("checkpoint", "final", "1")["checkpoint_id"])
    primary.vm.terminate()

    # Then VM B, with another address and empty VM-local places, restores the newest checkpoint and the job
    # ends as the uninterrupted run did
    backup = workload_vms(job_id)
    assert backup.vm.address != primary.vm.address
    backup.configure(2, "restore")
    try:
        restored = backup.agent("restore", "2")
    except AssertionError as error:
        # CRIU's "No mapping for N:(null) mountpoint" means a mount of the job is not on the restoring VM.
        missing = sorted(job_mounts - backup.mount_points())
        raise AssertionError(f"{error}\nmount points the job had that VM B lacks: {missing}") from None
    assert restored["checkpoint_id"] == expected[-1]
    exit_code = backup.agent("wait-exit", "120")["exit_code"]
    assert exit_code == 0, f"the restored job exited with {exit_code}: {backup.stderr()}"
    assert reference.agent("wait-exit", "120")["exit_code"] == 0, reference.stderr()
    for name in workload.results:
        assert backup.host(name).read_bytes() == reference.host(name).read_bytes(), f"{name} differs"
    assert [e["checkpoint_id"] for e in primary.events("CheckpointCompleted")] == expected


@pytest.mark.parametrize("workload", WORKLOADS, ids=[w.name for w in WORKLOADS])
def test_after_a_final_dump_the_job_ends_on_another_vm_as_an_uninterrupted_run(workload, built, workload_vms, criu_bin):
    _move(workload, built, workload_vms, "final-dump")


@pytest.mark.parametrize("workload", WORKLOADS, ids=[w.name for w in WORKLOADS])
def test_from_a_periodic_checkpoint_the_job_ends_on_another_vm_as_an_uninterrupted_run(
    workload, built, workload_vms, criu_bin
):
    _move(workload, built, workload_vms, "vanished")


@pytest.mark.parametrize("workload", REFUSED, ids=[w.name for w in REFUSED])
def test_a_job_whose_state_cannot_be_carried_gets_a_checkpoint_failure_naming_the_cause(
    workload, built, workload_vms, criu_bin
):
    _unless_known(workload, _refused, built, workload_vms)


def _refused(workload, built, workload_vms):
    # Given a job holding something no restore on another VM could bring back
    vm = workload_vms(f"wl-{workload.name}"[:63])
    vm.configure(1, "run", workload.command(built), workload.env)
    vm.agent("start")
    vm.wait_progress(workload.first_dump_at)
    held = vm.holds(workload.holds)
    assert all(held.values()), f"the job does not hold {held}"

    # When a periodic checkpoint is taken
    with pytest.raises(AssertionError) as failure:
        vm.agent("checkpoint", "periodic", "1")

    # Then it fails naming the cause, none is reported complete, and the job runs on to its end
    assert workload.refused in str(failure.value)
    assert [e["reason"] for e in vm.events("CheckpointFailed") if workload.refused in e["reason"]]
    assert vm.events("CheckpointCompleted") == []
    assert vm.agent("wait-exit", "120")["exit_code"] == 0, vm.stderr()


def test_the_probe_tells_what_a_job_holds_from_what_it_does_not(built, workload_vms, criu_bin):
    # Given the Go job, which holds threads but no file in /tmp, no unlinked file and no connection
    go = next(w for w in WORKLOADS if w.name == "go-goroutines")
    vm = workload_vms("wl-probe")
    vm.configure(1, "run", go.command(built), go.env)
    vm.agent("start")
    vm.wait_progress(3)

    # When each kind of check is asked about it, then only what it holds is found
    held = vm.holds(["threads:3", "open:{workdir}/result.txt", "processes:goroutines:1"])
    not_held = vm.holds(
        ["listen-vm:", "maps:/tmp/", "open:/tmp/", "unlinked:/tmp:1", "spilled:/tmp:sort", "tcp:8088", "threads:999"]
    )
    assert all(held.values()), held
    assert not any(not_held.values()), not_held
    assert vm.agent("wait-exit", "120")["exit_code"] == 0
