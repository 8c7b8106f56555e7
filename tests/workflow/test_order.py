"""Order from the control plane: which checkpoint is the job's newest never depends on VM clocks, and the
interrupted instance's late final dump is never recorded once the restore was ordered."""

from __future__ import annotations

import pytest
from spotcr_contracts import commands, events
from spotcr_functions.config import ENV
from spotcr_functions.models import Status

from rehearsal.controlplane import (
    ControlPlane,
    agent_event,
    ec2_event,
    end_checkpoint_command,
    finish_checkpoint,
    finish_restore,
    now_iso,
    route,
)
from tests.workflow.support import order_periodic, ordered_sequence

pytestmark = pytest.mark.claim("Attempts and order")

T = 1_795_000_000_000  # the primary's clock, in unix milliseconds


# SSM's status-change event for each checkpoint's command, by checkpoint id: to deliver again.
_ANSWERS: dict[str, dict] = {}


def _commit(job_id: str, instance_id: str, generation: int, kind: str, at_ms: int, sequence: int | None = None) -> str:
    """The VM answers the dump it was ordered (SSM's result, then its status-change event delivered)."""
    checkpoint = commands.checkpoint_id(at_ms, generation, kind, sequence)
    report = events.CheckpointCompleted(job_id, instance_id, generation, now_iso(), checkpoint_id=checkpoint, kind=kind)
    ended = end_checkpoint_command(report)
    assert ended is not None, f"no {kind} dump was ordered on {instance_id}"
    _ANSWERS[checkpoint] = ended[1]
    route(ended[1])
    return checkpoint


def _recover(plane: ControlPlane, job_id: str, generation: int) -> tuple[str, dict]:
    backup = plane.wait_until(lambda: plane.job(job_id).backup_instance_id, "the backup launch")
    route(agent_event(events.AgentReady(job_id, backup, generation, now_iso(), mode="restore")))
    restore = plane.wait_until(
        lambda: [c for c in plane.sent_commands("restore") if c["instances"] == [backup]], "the restore command"
    )[-1]
    return backup, restore


def test_a_backup_whose_clock_is_behind_has_its_checkpoints_recorded_and_restored(plane: ControlPlane) -> None:
    # Given a job recovered once: the primary's final dump (its clock) is the job's newest
    primary = plane.start_job("skew-1")
    _commit("skew-1", primary, 0, "periodic", T, order_periodic(plane, "skew-1", primary))
    route(ec2_event("spot-interruption-warning", primary))
    plane.wait_for_token("skew-1", "final-dump")
    final = _commit("skew-1", primary, 1, "final", T + 10_000, ordered_sequence(plane, primary, "final"))
    backup, restore = _recover(plane, "skew-1", 1)
    assert restore["parameters"]["CheckpointId"] == final
    finish_restore(events.RestoreCompleted("skew-1", backup, 1, now_iso(), checkpoint_id=final))
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"

    # When the backup, whose clock is 120 s behind, commits a periodic checkpoint a minute later
    periodic = _commit(
        "skew-1", backup, 1, "periodic", T + 10_000 + 60_000 - 120_000, order_periodic(plane, "skew-1", backup)
    )

    # Then it is the job's newest (its id's time is older than the primary's final dump)
    assert plane.job("skew-1").checkpoint_id == periodic
    # And when the backup is lost, the next cycle restores it
    route(ec2_event("state-change-terminated", backup))
    plane.wait_until(lambda: plane.job("skew-1").generation == 2, "the second cycle")
    _, restore = _recover(plane, "skew-1", 2)
    assert restore["parameters"]["CheckpointId"] == periodic


def test_a_final_dump_that_outlives_its_wait_is_never_recorded_after_the_restore_is_ordered(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a job whose final dump does not arrive within the wait, so the backup restores the periodic one
    monkeypatch.setenv(ENV["final_dump_wait_s"], "1")
    primary = plane.start_job("late-1")
    periodic = _commit("late-1", primary, 0, "periodic", T, order_periodic(plane, "late-1", primary))
    route(ec2_event("spot-interruption-warning", primary))
    backup, restore = _recover(plane, "late-1", 1)
    assert restore["parameters"]["CheckpointId"] == periodic

    # When the primary's final dump (ordered at generation 1) commits after all, while the backup restores
    late = _commit("late-1", primary, 1, "final", T + 30_000, ordered_sequence(plane, primary, "final"))

    # Then it is not the job's newest: the backup's run continues from the periodic checkpoint
    assert plane.job("late-1").checkpoint_id == periodic
    finish_restore(events.RestoreCompleted("late-1", backup, 1, now_iso(), checkpoint_id=periodic))
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    # And SSM's event delivered again after the backup took over is not either
    route(_ANSWERS[late])
    record = plane.job("late-1")
    assert (record.status, record.instance_id, record.checkpoint_id) == (Status.RUNNING, backup, periodic)


def test_a_vm_whose_clock_jumps_backwards_has_its_newer_checkpoint_taken_as_newest(plane: ControlPlane) -> None:
    # Given a job with a periodic checkpoint ordered and committed
    primary = plane.start_job("jump-1")
    first = _commit("jump-1", primary, 0, "periodic", T, order_periodic(plane, "jump-1", primary))
    assert plane.job("jump-1").checkpoint_id == first

    # When the VM's clock jumps back 10 minutes before the next ordered dump
    second = _commit("jump-1", primary, 0, "periodic", T - 600_000, order_periodic(plane, "jump-1", primary))

    # Then the later order is the job's newest, the earlier one its fallback, and a copy of the earlier
    # checkpoint's SSM event redelivered now does not win it back
    record = plane.job("jump-1")
    assert (record.checkpoint_id, record.previous_checkpoint_id) == (second, first)
    route(_ANSWERS[first])
    assert plane.job("jump-1").checkpoint_id == second

    # And the final dump the agent took on its own notice (no order: the highest sequence its VM was given), which
    # it reports to the final-dump order the warning then sends, ranks after both, its clock still behind
    route(ec2_event("spot-interruption-warning", primary))
    plane.wait_for_token("jump-1", "final-dump")
    own_final = commands.checkpoint_id(T - 590_000, 0, "final", commands.checkpoint_order(second)[1])
    finish_checkpoint(
        events.CheckpointCompleted("jump-1", primary, 1, now_iso(), checkpoint_id=own_final, kind="final")
    )
    assert plane.job("jump-1").checkpoint_id == own_final
