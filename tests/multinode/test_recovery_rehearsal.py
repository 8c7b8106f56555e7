"""A job over three bare local VMs survives the loss of any node through the real handlers, workflow, agents and
CRIU (issue 25's acceptance): MPICH over TCP between the nodes, started by plain `mpiexec` in the job's command,
its checkpoints on one EBS volume per node, on EFS and on S3 (one storage per test); each run ends with the result of
the same command run on one VM, byte for byte, and the leak check.

Never two live copies of a node's share: the control plane moves a node's address to its backup only once the
interrupted instance is terminated, and the local network refuses the move while a live VM holds the address
(rehearsal.vm.VmNetwork.move); only the backup's share then runs with that address."""

import pytest

from tests.rehearsal.support import e2e_rehearsal
from tests.workloads.build import build_all

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.criu,
    pytest.mark.workload,
    pytest.mark.timeout(420),
    pytest.mark.claim("The result equals an uninterrupted run's"),
]

NODES, STEPS = 3, 1000
COMMAND = f"mpiexec -n {NODES} {{}} {STEPS} 40"
# The uninterrupted run's result, once the first test ran it: the program is deterministic, so the other tests skip
# their reference run (3 more busy-polling MPI processes on the machine while the job recovers).
REFERENCE: list[bytes] = []


def rehearsal(tmp_path, storage="efs", **changes):
    return e2e_rehearsal(
        tmp_path,
        nodes=NODES,
        storage=storage,
        command=COMMAND.format(build_all() / "mpi"),
        result_file="result.txt",
        timeout_s=150.0,
        timeline_png=False,
        reference=REFERENCE[0] if REFERENCE else None,
        **changes,
    )


def run_it(run):
    outcome = run.run()
    REFERENCE[:] = REFERENCE or [outcome.expected]
    return outcome


def test_two_nodes_warned_at_once_and_then_two_more_move_to_backups_and_the_job_ends_as_uninterrupted(tmp_path):
    # Given an MPI job over three VMs, each node's checkpoints on its own EBS volume, when a wave warns nodes 1 and 2
    # at once, and after their recovery nodes 2 and 0 (the coordinator, whose volume holds the job manifests) at once
    run, lines = rehearsal(tmp_path, storage="ebs", interruptions=2, wave=2)
    outcome = run_it(run)
    # Then each recovery moved both nodes' shares to backups with their addresses and volumes, every node restored
    # from the final dump
    assert len(outcome.recoveries_s) == 2, "\n".join(lines)
    assert all(restored.endswith("-final") for restored in outcome.restored_from), outcome.restored_from
    # And the job ended with the uninterrupted run's result
    assert outcome.identical, "\n".join(lines)


def test_a_node_lost_without_a_warning_restores_every_node_from_the_periodic_checkpoint(tmp_path):
    # Given an MPI job over three VMs, when node 1 goes with no warning (no final dump; MPI fails on the others)
    run, lines = rehearsal(tmp_path, missed_warning=True)
    outcome = run_it(run)  # checks the restore used the newest periodic checkpoint
    # Then the job ended with the uninterrupted run's result
    assert outcome.identical, "\n".join(lines)


def test_a_node_warned_while_a_coordinated_periodic_dump_runs_recovers(tmp_path):
    # Given an MPI job over three VMs storing its checkpoints in S3, when node 1 is warned while the next periodic
    # dump runs on every node. The final dump begins once that dump is in (3 s to 6 s later on a loaded 2-core host,
    # with another lane's VMs beside it) and must end before EC2 takes node 1: 8 s were sometimes too few.
    run, lines = rehearsal(tmp_path, storage="s3", during_periodic=True, notice_s=15.0)
    outcome = run_it(run)
    # Then the periodic dump ends before the final dump, and the job ends with the uninterrupted run's result
    assert outcome.restored_from and outcome.restored_from[0].endswith("-final"), "\n".join(lines)
    assert outcome.identical, "\n".join(lines)
