"""The recovery protocol's invariants under forced interleavings: exactly one end, no lost exit, no lost final dump,
no stack trace in a notification. Real ASL on moto's engine, real handlers in-process, the agents played."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from moto import mock_aws
from spotcr_contracts import events
from spotcr_functions import recovery
from spotcr_functions.config import ENV
from spotcr_functions.models import Status
from spotcr_functions.registry import Registry

from rehearsal.controlplane import (
    EVENTS,
    MOTO_CONFIG,
    ControlPlane,
    agent_event,
    answer_exit,
    checkpoint_id,
    ec2_event,
    end_dump_order_with_exit,
    finish_checkpoint,
    finish_exit,
    finish_restore,
    invoke_function,
    now_iso,
    route,
)
from tests.workflow.support import commit

pytestmark = pytest.mark.claim("Exactly one end")


def _before_next_read(monkeypatch: pytest.MonkeyPatch, interleaved: Callable[[], Any]) -> None:
    """Run `interleaved` right after the next registry read returns: the handler then holds a stale record."""
    original = Registry.get
    armed = [True]

    def get(self: Registry, job_id: str) -> Any:
        record = original(self, job_id)
        if armed[0]:
            armed[0] = False
            interleaved()
        return record

    monkeypatch.setattr(Registry, "get", get)


def _scheduler() -> dict[str, Any]:
    return invoke_function("scheduler", json.loads((EVENTS / "scheduled-event.json").read_text()))


def _backup(plane: ControlPlane, job_id: str) -> str:
    record = plane.wait_until(lambda: (r := plane.job(job_id)).backup_instance_id and r, "the backup launch")
    return str(record.backup_instance_id)


def test_an_exit_racing_a_periodic_dump_order_is_recorded_once(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a running job
    primary = plane.start_job("race-1")

    # When the job exits and, between the read and the write of the handler that takes SSM's answer, a periodic
    # dump is claimed (rebalance)
    [ended] = answer_exit(events.JobExited("race-1", primary, 0, now_iso(), exit_code=0))
    _before_next_read(monkeypatch, lambda: route(ec2_event("rebalance-recommendation", primary)))
    route(ended)

    # Then the exit is recorded against the fresh record: COMPLETED, and the scheduler orders nothing more
    job = plane.job("race-1")
    assert (job.status, job.exit_code, job.next_checkpoint_at) == (Status.COMPLETED, 0, None)
    ordered = len(plane.sent_commands("checkpoint"))
    assert _scheduler() == {"ordered": [], "exits_asked": [], "timed_out": []}
    assert len(plane.sent_commands("checkpoint")) == ordered

    # And a duplicated or late exit (another code) does not end it a second time
    finish_exit(events.JobExited("race-1", primary, 0, now_iso(), exit_code=9))
    assert (plane.job("race-1").status, plane.job("race-1").exit_code) == (Status.COMPLETED, 0)


@pytest.mark.parametrize(("exit_code", "status"), [(0, Status.COMPLETED), (137, Status.FAILED)])
def test_an_exit_right_after_the_restore_ends_the_job_and_the_recovery(
    plane: ControlPlane, exit_code: int, status: Status
) -> None:
    # Given a job restored on its backup, whose RestoreCompleted has not been handled yet
    primary = plane.start_job("quick-1")
    periodic = commit(plane, "quick-1", primary, 0, "periodic")
    route(ec2_event("state-change-terminated", primary))
    backup = _backup(plane, "quick-1")
    route(agent_event(events.AgentReady("quick-1", backup, 1, now_iso(), mode="restore")))
    plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")

    # When the restored job exits at once, and its exit is handled before the RestoreCompleted
    finish_exit(events.JobExited("quick-1", backup, 1, now_iso(), exit_code=exit_code))
    finish_restore(events.RestoreCompleted("quick-1", backup, 1, now_iso(), checkpoint_id=periodic, seconds=1.0))

    # Then the job ends exactly once, with its code, and the recovery does not make it RUNNING again
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    job = plane.job("quick-1")
    assert (job.status, job.exit_code) == (status, exit_code)
    assert _scheduler() == {"ordered": [], "exits_asked": [], "timed_out": []}


@pytest.mark.parametrize("exit_generation", [0, 1])
@pytest.mark.parametrize(("exit_code", "status"), [(0, Status.COMPLETED), (137, Status.FAILED)])
def test_an_exit_just_before_the_warning_ends_the_job_and_stops_recovery(
    plane: ControlPlane, exit_generation: int, exit_code: int, status: Status
) -> None:
    # Given a running job with a periodic checkpoint
    primary = plane.start_job("tail-1")
    commit(plane, "tail-1", primary, 0, "periodic")

    # When the warning is handled first, then the primary's exit (generation 0 from the daemon's own watch, or 1
    # once the final-dump command was admitted), after the backup was launched
    route(ec2_event("spot-interruption-warning", primary))
    backup = _backup(plane, "tail-1")
    finish_exit(events.JobExited("tail-1", primary, exit_generation, now_iso(), exit_code=exit_code))

    # Then the job ends with the exit code (a crash, 137 from the OOM killer, is never recovered)
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    job = plane.job("tail-1")
    assert (job.status, job.exit_code) == (status, exit_code)
    # And the tail is not re-run: no restore was ordered, the backup that never ran the job is terminated
    assert plane.sent_commands("restore") == []
    [instance] = [b for b in plane.backups() if b["InstanceId"] == backup]
    assert instance["State"]["Name"] in ("shutting-down", "terminated")


@pytest.mark.parametrize("event", ["delivered", "lost"])
def test_a_job_that_exited_at_the_warning_ends_from_its_final_dump_answer(
    plane: ControlPlane, event: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a running job with a periodic checkpoint, warned just as it exits with code 3; with the answer's event
    # lost, a short final-dump wait (the Restore step reads the answer once it is over: the plane's 30 s raced the
    # 30 s this test waits for the workflow)
    if event == "lost":
        monkeypatch.setenv(ENV["final_dump_wait_s"], "1")
    primary = plane.start_job("exit-1")
    commit(plane, "exit-1", primary, 0, "periodic")
    route(ec2_event("spot-interruption-warning", primary))
    backup = _backup(plane, "exit-1")
    plane.wait_until(lambda: plane.sent_commands("final-dump"), "the final-dump order")

    # When the final-dump order finds the job ended and answers with its exit, and no status command ever answers
    # (the primary is retired first: the fault suite's race); SSM's event for that answer delivered, or lost (the
    # Restore step reads it once the backup is ready)
    exited = events.JobExited("exit-1", primary, 1, now_iso(), exit_code=3, result="s3://b/exit-1")
    _, answered = end_dump_order_with_exit(dataclasses.replace(exited, run_id=plane.job("exit-1").run_id))
    if event == "delivered":
        route(answered)
    else:
        route(agent_event(events.AgentReady("exit-1", backup, 1, now_iso(), mode="restore")))

    # Then the job ends once with its code, from that answer: no status command, no restore, the backup goes
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    job = plane.job("exit-1")
    assert (job.status, job.exit_code, job.result) == (Status.FAILED, 3, "s3://b/exit-1")
    assert plane.sent_commands("status") == [] and plane.sent_commands("restore") == []
    [instance] = [b for b in plane.backups() if b["InstanceId"] == backup]
    assert instance["State"]["Name"] in ("shutting-down", "terminated")


def test_a_vm_that_stopped_under_the_job_is_recovered_not_ended(plane: ControlPlane) -> None:
    # Given a job recovering from its primary
    primary = plane.start_job("stop-1")
    commit(plane, "stop-1", primary, 0, "periodic")
    route(ec2_event("spot-interruption-warning", primary))
    _backup(plane, "stop-1")

    # When the restarted primary's agent finds the job gone with no exit code recorded
    finish_exit(events.JobExited("stop-1", primary, 0, now_iso(), exit_code=events.UNKNOWN_EXIT_CODE))

    # Then the recovery goes on
    assert plane.job("stop-1").status == Status.RECOVERING


@pytest.fixture
def slow_final_dump_plane(aws_env: None) -> Iterator[ControlPlane]:
    """Final-dump wait far longer than any test: a workflow that waits for it never gets to restore in time."""
    with mock_aws(config=MOTO_CONFIG), ControlPlane(final_dump_wait_s=600) as control_plane:
        yield control_plane


def test_an_early_final_dump_is_kept_by_the_bump_and_restored_at_once(slow_final_dump_plane: ControlPlane) -> None:
    plane = slow_final_dump_plane
    # Given a job whose agent took its final dump on its own IMDS notice, committed before the warning's bump
    primary = plane.start_job("early-1")
    commit(plane, "early-1", primary, 0, "periodic", at_ms=1_795_000_000_000)
    final = checkpoint_id("final", 0, 1_795_000_060_000)

    # When the warning bumps the generation and orders the final dump, which the agent answers at once with the one
    # it took (Agent.checkpoint reports a final dump already taken)
    route(ec2_event("spot-interruption-warning", primary))
    finish_checkpoint(events.CheckpointCompleted("early-1", primary, 1, now_iso(), checkpoint_id=final, kind="final"))
    backup = _backup(plane, "early-1")
    route(agent_event(events.AgentReady("early-1", backup, 1, now_iso(), mode="restore")))

    # Then recovery uses that final dump at once (the final-dump wait is 600 s here)
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command", timeout=15)
    assert restore["parameters"]["CheckpointId"] == final
    finish_restore(events.RestoreCompleted("early-1", backup, 1, now_iso(), checkpoint_id=final, seconds=1.0))
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"


def test_an_earlier_recoverys_final_dump_is_not_carried_into_the_next(plane: ControlPlane) -> None:
    # Given a job recovered once from its primary's final dump
    primary = plane.start_job("twice-1")
    commit(plane, "twice-1", primary, 0, "periodic", at_ms=1_795_000_000_000)
    route(ec2_event("spot-interruption-warning", primary))
    backup = _backup(plane, "twice-1")
    plane.wait_for_token("twice-1", "final-dump")
    commit(plane, "twice-1", primary, 1, "final", at_ms=1_795_000_060_000)
    route(agent_event(events.AgentReady("twice-1", backup, 1, now_iso(), mode="restore")))
    plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    finish_restore(
        events.RestoreCompleted("twice-1", backup, 1, now_iso(), checkpoint_id="1795000060000-g1-final", seconds=1.0)
    )
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"

    # When the backup is interrupted in turn
    route(ec2_event("spot-interruption-warning", backup))

    # Then the new recovery waits for the backup's own final dump (the primary's is not its arrival)
    record = plane.wait_for_token("twice-1", "final-dump")
    assert record.generation == 2
    assert record.arrival("final-dump") is None


def test_no_checkpoint_restarts_from_the_beginning_and_tells_the_user(plane: ControlPlane) -> None:
    # Given a job that never committed a checkpoint, whose VM is terminated
    primary = plane.start_job("fresh-1")
    route(ec2_event("state-change-terminated", primary))
    backup = _backup(plane, "fresh-1")
    route(agent_event(events.AgentReady("fresh-1", backup, 1, now_iso(), mode="restore")))

    # When the backup's agent finds nothing to restore and starts the job from the beginning
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    assert restore["parameters"]["CheckpointId"] == ""
    skipped = "job fresh-1 has no committed checkpoint: started from the beginning"
    completed = events.RestoreCompleted("fresh-1", backup, 1, now_iso(), checkpoint_id="", pid=7, skipped=skipped)
    finish_restore(completed)

    # Then the job runs on the backup and the user is told why it started over
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    assert plane.job("fresh-1").status == Status.RUNNING
    [message] = plane.wait_until(plane.notifications, "the notification")
    assert "restarted from the beginning" in message
    assert skipped in message


def test_a_failed_walk_notifies_the_agents_reason_without_a_stack_trace(plane: ControlPlane) -> None:
    # Given a job with one checkpoint, recovering on a backup
    primary = plane.start_job("walk-1")
    only = commit(plane, "walk-1", primary, 0, "periodic")
    route(ec2_event("state-change-terminated", primary))
    backup = _backup(plane, "walk-1")
    route(agent_event(events.AgentReady("walk-1", backup, 1, now_iso(), mode="restore")))

    # When both restore attempts fail on the backup, the second with no earlier checkpoint to start from
    reason = f"{only}: checkpoint {only} is corrupt: chunk ab of images/pages-1.img is missing from the store"
    plane.wait_until(lambda: plane.sent_commands("restore"), "the first restore")
    finish_restore(events.RestoreFailed("walk-1", backup, 1, now_iso(), checkpoint_id=only, reason=reason))
    plane.wait_until(lambda: len(plane.sent_commands("restore")) == 2, "the second restore")
    finish_restore(events.RestoreFailed("walk-1", backup, 1, now_iso(), checkpoint_id="", reason=reason))

    # Then the job is FAILED and the notification names the agent's reason, not a function's stack trace
    assert plane.wait_for_execution()["status"] == "FAILED"
    [message] = plane.wait_until(plane.notifications, "the notification")
    assert reason in message
    assert "Traceback" not in message
    assert "stackTrace" not in message


def test_a_lambda_error_cause_is_read_without_its_stack_trace() -> None:
    cause = json.dumps(
        {
            "errorMessage": "job j has no backup instance to restore on",
            "errorType": "ValueError",
            "requestId": "r",
            "stackTrace": ['  File "/var/task/spotcr_functions/recovery.py", line 1, in restore\n'],
        }
    )
    assert recovery.readable_cause(cause) == "ValueError: job j has no backup instance to restore on"
    assert recovery.readable_cause("RestoreFailed on the backup") == "RestoreFailed on the backup"


@pytest.mark.claim("Backups are first-class")
@pytest.mark.parametrize("event", ["spot-interruption-warning", "state-change-terminated"])
def test_a_backup_lost_while_it_restores_starts_a_new_cycle(plane: ControlPlane, event: str) -> None:
    # Given a recovery whose backup was ordered to restore the newest checkpoint
    primary = plane.start_job("second-1")
    periodic = commit(plane, "second-1", primary, 0, "periodic")
    route(ec2_event("state-change-terminated", primary))
    backup = _backup(plane, "second-1")
    route(agent_event(events.AgentReady("second-1", backup, 1, now_iso(), mode="restore")))
    plane.wait_until(lambda: plane.sent_commands("restore"), "the first restore")

    # When that backup is warned (or terminated) before its restore completes
    route(ec2_event(event, backup))

    # Then a new cycle starts from it at the next generation; a warning orders the backup's own final dump
    record = plane.wait_until(lambda: (r := plane.job("second-1")).generation == 2 and r, "the new generation")
    assert (record.status, record.recovering_from) == (Status.RECOVERING, backup)
    dumps = [c for c in plane.sent_commands("final-dump") if c["instances"] == [backup]]
    if event == "spot-interruption-warning":
        assert [d["parameters"] for d in dumps] == [
            {
                "JobId": "second-1",
                "Generation": "2",
                "Kind": "final",
                "RunId": record.run_id,
                "Sequence": str(record.dump_sequence),  # minted by the backup's fencing write, after the first's
            }
        ]
        assert record.dump_sequence == 3  # after the first dump order and the first restore order
        plane.wait_for_token("second-1", "final-dump")
        restored = commit(plane, "second-1", backup, 2, "final")
    else:
        assert dumps == []
        restored = periodic
    second = plane.wait_until(
        lambda: (b := plane.job("second-1").backup_instance_id) and b != backup and b, "the second backup"
    )
    route(agent_event(events.AgentReady("second-1", second, 2, now_iso(), mode="restore")))
    plane.wait_until(lambda: len(plane.sent_commands("restore")) == 2, "the second restore")
    [again] = [c for c in plane.sent_commands("restore") if c["instances"] == [second]]
    assert again["parameters"]["CheckpointId"] == restored
    finish_restore(events.RestoreCompleted("second-1", second, 2, now_iso(), checkpoint_id=restored))
    plane.wait_until(lambda: plane.job("second-1").status == Status.RUNNING, "the job to run again")
    job = plane.job("second-1")
    assert (job.instance_id, job.generation) == (second, 2)
    assert len(plane.executions()) == 2


def test_a_failed_early_final_dump_does_not_stop_the_warning_from_recovering(plane: ControlPlane) -> None:
    # Given a primary whose own final dump (IMDS notice) failed and was reported before the warning
    primary = plane.start_job("failed-early-1")
    periodic = commit(plane, "failed-early-1", primary, 0, "periodic")
    failed = events.CheckpointFailed("failed-early-1", primary, 0, now_iso(), kind="final", reason="CRIU: dump failed")
    route(agent_event(failed))

    # When the warning comes
    route(ec2_event("spot-interruption-warning", primary))

    # Then recovery starts at the next generation and restores the newest periodic checkpoint
    assert plane.job("failed-early-1").generation == 1
    backup = _backup(plane, "failed-early-1")
    route(agent_event(events.AgentReady("failed-early-1", backup, 1, now_iso(), mode="restore")))
    plane.wait_for_token("failed-early-1", "final-dump")
    finish_checkpoint(events.CheckpointFailed("failed-early-1", primary, 1, now_iso(), kind="final", reason="x"))
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    assert restore["parameters"]["CheckpointId"] == periodic
