"""A backup's ready report that comes before the recovery recorded the backup (a throttled write retried for
longer than the VM takes to boot) is kept and moves the recovery on; any other instance's report moves nothing."""

from __future__ import annotations

from typing import Any

import pytest
from spotcr_contracts import events
from spotcr_contracts.settings import ENV
from spotcr_functions import rendezvous
from spotcr_functions.registry import Registry, early_ready_key

from rehearsal.controlplane import (
    ControlPlane,
    agent_event,
    ec2_event,
    finish_checkpoint,
    finish_restore,
    now_iso,
    route,
)

# The recovery's readiness wait is 30 s in the workflow tests: a report it lost would show as no restore in this time.
RESTORE_SOON_S = 10.0
OTHER_INSTANCE = "i-0f0f0f0f0f0f0f0f0"  # an instance that never becomes the backup


RECORD_BACKUP = Registry.record_backup


def _ready_before_recorded(monkeypatch: pytest.MonkeyPatch, reporter: str = "", boot_fails: bool = False) -> list[Any]:
    """The launch step's write that records the backup lands only after a ready report (the backup's own, or the
    instance `reporter` names) was handled, as when DynamoDB throttles that one write for longer than a boot; with
    `boot_fails`, a BootstrapFailed instead. Returns what the agent-events function did with each report."""
    handled: list[Any] = []

    def ready_first(self: Registry, job_id: str, generation: int, instance_id: str, *args: Any) -> Any:
        record = self.get(job_id)
        assert record is not None
        run_id = record.run_id  # as the backup's agent reads it from its tags
        report: events.AgentEvent = events.AgentReady(
            job_id, reporter or instance_id, generation, now_iso(), mode="restore", run_id=run_id
        )
        if boot_fails:
            report = events.BootstrapFailed(
                job_id, instance_id, generation, now_iso(), run_id=run_id, step="storage", reason="no volume"
            )
        handled.extend(result for _, result in route(agent_event(report)))
        return RECORD_BACKUP(self, job_id, generation, instance_id, *args)

    monkeypatch.setattr(Registry, "record_backup", ready_first)
    return handled


def _warn(plane: ControlPlane, job_id: str) -> str:
    """The job's instance is warned and its final dump fails: the recovery restores from nothing, on its backup."""
    primary = plane.start_job(job_id)
    route(ec2_event("spot-interruption-warning", primary))
    finish_checkpoint(events.CheckpointFailed(job_id, primary, 1, now_iso(), kind="final", reason="down"))
    return primary


def _restore_and_finish(plane: ControlPlane, job_id: str, backup: str) -> None:
    finish_restore(events.RestoreCompleted(job_id, backup, 1, now_iso(), checkpoint_id=""))
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    assert plane.job(job_id).instance_id == backup


def test_a_ready_report_that_comes_before_the_backup_is_recorded_is_not_lost(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a recovery whose write recording the backup lands after the backup's agent reported ready
    handled = _ready_before_recorded(monkeypatch)

    # When the job's instance is warned
    _warn(plane, "early-ready-1")

    # Then that ready report moves the recovery on: the restore is ordered on the backup at once, not after the wait
    backup = plane.wait_until(lambda: plane.job("early-ready-1").backup_instance_id, "the backup launch")
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command", RESTORE_SOON_S)
    assert restore["instances"] == [backup]
    assert handled == [{"action": "kept", "reason": "not recorded as the backup yet"}]
    _restore_and_finish(plane, "early-ready-1", backup)
    assert plane.job("early-ready-1").arrival(early_ready_key(backup)) is None  # done with once it runs the job


def test_a_boot_that_fails_before_the_backup_is_recorded_is_not_lost(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a recovery whose write recording the backup lands after the backup's agent said its boot failed
    handled = _ready_before_recorded(monkeypatch, boot_fails=True)

    # When the job's instance is warned
    _warn(plane, "early-failed-1")

    # Then that failure ends the readiness wait at once, with its cause, instead of the wait running out
    execution = plane.wait_for_execution(RESTORE_SOON_S)
    assert handled == [{"action": "kept", "reason": "not recorded as the backup yet"}]
    assert execution["status"] == "FAILED"
    assert plane.sent_commands("restore") == []
    assert "storage: no volume" in (plane.job("early-failed-1").reason or "")


def test_a_ready_report_whose_backup_is_recorded_while_it_is_kept_moves_the_recovery_on(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a ready report that read the record before the backup was recorded, and whose write keeping it lands
    # after the launch step's write recording the backup
    handled = _ready_before_recorded(monkeypatch)
    keep_early_ready = Registry.keep_early_ready

    def recorded_meanwhile(self: Registry, job_id: str, generation: int, instance_id: str, at: str) -> Any:
        RECORD_BACKUP(self, job_id, generation, instance_id, "us-east-1a", at)
        return keep_early_ready(self, job_id, generation, instance_id, at)

    monkeypatch.setattr(Registry, "keep_early_ready", recorded_meanwhile)

    # When the job's instance is warned
    _warn(plane, "early-ready-3")

    # Then the report's own write saw its instance recorded as the backup, and moved the recovery on
    backup = plane.wait_until(lambda: plane.job("early-ready-3").backup_instance_id, "the backup launch")
    plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command", RESTORE_SOON_S)
    assert handled == [{"action": "backup-ready"}]
    _restore_and_finish(plane, "early-ready-3", backup)


def test_an_early_ready_report_from_another_instance_moves_nothing(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a recovery whose write recording the backup lands after a ready report from an instance that never
    # becomes the backup (the job's run and generation, restore mode: what any VM on the bus may put)
    handled = _ready_before_recorded(monkeypatch, reporter=OTHER_INSTANCE)

    # When the job's instance is warned and the recovery waits for its backup
    _warn(plane, "early-ready-2")
    record = plane.wait_for_token("early-ready-2", "backup-ready")
    backup = str(record.backup_instance_id)

    # Then that report is kept as its instance's, and is no backup's: nothing arrived for the wait
    assert handled == [{"action": "kept", "reason": "not recorded as the backup yet"}]
    assert record.arrival(early_ready_key(OTHER_INSTANCE)) is not None
    assert record.arrival("backup-ready") is None
    assert plane.job("early-ready-2").arrival("backup-ready") is None

    # And the backup's own report moves the recovery on
    route(agent_event(events.AgentReady("early-ready-2", backup, 1, now_iso(), mode="restore")))
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command", RESTORE_SOON_S)
    assert restore["instances"] == [backup]
    arrived = plane.job("early-ready-2").arrival("backup-ready") or {}
    assert arrived["output"] == {"instance_id": backup}
    _restore_and_finish(plane, "early-ready-2", backup)


def test_a_ready_report_whose_answer_to_the_wait_was_lost_moves_the_recovery_on_when_the_wait_runs_out(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a readiness wait of 10 s, and its answer lost once the backup's report is recorded (SendTaskSuccess
    # throttled past every retry in a wave). With 5 s the wait once ran out before the report was recorded, on a
    # host loaded by the other lane's VM tests (CI of 4e7b4f0).
    monkeypatch.setenv(ENV["backup_ready_wait_s"], "10")
    complete, lost = rendezvous._complete, []

    def losing(deps: Any, token: str, arrival: Any, *, job_id: str, key: str, how: str) -> None:
        if key == "backup-ready":
            lost.append(key)
            return
        complete(deps, token, arrival, job_id=job_id, key=key, how=how)

    monkeypatch.setattr(rendezvous, "_complete", losing)

    # When the job's instance is warned and its backup reports ready
    _warn(plane, "lost-answer-1")
    backup = plane.wait_until(lambda: plane.job("lost-answer-1").backup_instance_id, "the backup launch")
    route(agent_event(events.AgentReady("lost-answer-1", backup, 1, now_iso(), mode="restore")))

    # Then once the wait runs out, the report the record keeps moves the recovery on: the restore is ordered there
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command", 20)
    assert restore["instances"] == [backup] and lost == ["backup-ready"]
    _restore_and_finish(plane, "lost-answer-1", backup)


def test_a_backup_that_never_reports_fails_the_recovery_when_the_wait_runs_out(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV["backup_ready_wait_s"], "5")
    _warn(plane, "never-ready-1")
    assert plane.wait_for_execution(30)["status"] == "FAILED"
    assert plane.sent_commands("restore") == []
    assert "reported nothing within 5 s" in (plane.job("never-ready-1").reason or "")
