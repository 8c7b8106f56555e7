"""The recovery workflow end to end: real ASL on moto's Step Functions engine, real handlers in-process."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from moto.ec2.models.elastic_block_store import EBSBackend
from spotcr_contracts import events
from spotcr_contracts import tags as tag_names
from spotcr_functions.config import ENV
from spotcr_functions.models import Status
from spotcr_functions.registry import Registry

from rehearsal.controlplane import (
    ControlPlane,
    agent_event,
    ec2_event,
    finish_exit,
    finish_restore,
    now_iso,
    route,
)
from tests.workflow.support import NO_CAPACITY, commit, order_periodic, recover


def _no_capacity_in(plane: ControlPlane, subnet_id: str) -> list[tuple[str, str, str]]:
    """No launch in this subnet: EC2 refuses it as AWS does when a zone has no capacity left."""
    return plane.refuse_launches(lambda _type, subnet, _market: NO_CAPACITY if subnet == subnet_id else None)


# The final dump reaches the store at generation 1 when the SSM command ordered it, at 0 when the agent's own
# IMDS poll saw the notice before the bumped command arrived (the agent reports it to that command).
@pytest.mark.parametrize("final_generation", [1, 0])
def test_happy_path_final_dump_backup_restore(plane: ControlPlane, final_generation: int) -> None:
    # Given a running job with one periodic checkpoint
    primary = plane.start_job("render-1")
    periodic = commit(plane, "render-1", primary, 0, "periodic")
    assert plane.job("render-1").status == Status.RUNNING

    # When the spot interruption warning arrives
    route(ec2_event("spot-interruption-warning", primary))

    # Then the final dump is ordered at generation 1 and the workflow launches a backup for generation 1
    [dump] = plane.sent_commands("final-dump")
    assert dump["instances"] == [primary]
    assert dump["parameters"] == {
        "JobId": "render-1",
        "Generation": "1",
        "Kind": "final",
        "RunId": plane.job("render-1").run_id,
        "Sequence": "1",  # the job's first dump order, minted by the fencing write
    }
    record = plane.wait_until(lambda: (r := plane.job("render-1")).backup_instance_id and r, "the backup launch")
    backup = record.backup_instance_id
    assert plane.instance_tags(backup)[tag_names.MODE] == "restore"
    assert plane.instance_tags(backup)[tag_names.GENERATION] == "1"

    # When the old VM commits its final dump and the backup's agent is ready
    plane.wait_for_token("render-1", "final-dump")
    final = commit(plane, "render-1", primary, final_generation, "final")
    route(agent_event(events.AgentReady("render-1", backup, 1, now_iso(), mode="restore")))

    # Then the restore of the final dump is ordered on the backup
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    assert restore["instances"] == [backup]
    assert restore["parameters"] == {
        "JobId": "render-1",
        "Generation": "1",
        "CheckpointId": final,
        "RunId": plane.job("render-1").run_id,
        "Attempt": "newest",
        "Sequence": "2",  # minted when the restore is ordered: the backup's dumps rank after the primary's final
    }
    finish_restore(events.RestoreCompleted("render-1", backup, 1, now_iso(), checkpoint_id=final, seconds=2.0, pid=99))

    # Then the job runs on the backup at generation 1
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    job = plane.job("render-1")
    assert (job.status, job.instance_id, job.generation) == (Status.RUNNING, backup, 1)
    assert (job.checkpoint_id, job.previous_checkpoint_id) == (final, periodic)
    assert len(plane.backups()) == 1


@pytest.mark.claim("Duplicated and reordered events recover once")
@pytest.mark.parametrize("copies", [2, 5, 20])
def test_duplicated_and_reordered_events_recover_once(plane: ControlPlane, copies: int) -> None:
    # Given a running job
    primary = plane.start_job("sim-7")
    periodic = commit(plane, "sim-7", primary, 0, "periodic")

    # When the warning arrives many times, shuffled with the state changes that follow it
    deliveries = [ec2_event("spot-interruption-warning", primary) for _ in range(copies)]
    deliveries[1:1] = [ec2_event(f"state-change-{s}", primary) for s in ("stopping", "shutting-down", "terminated")]
    deliveries += [deliveries[0], deliveries[2]]  # EventBridge redelivers the very same event too
    random.Random(copies).shuffle(deliveries)
    for event in deliveries:
        route(event)

    # Then there is one workflow, one backup, one generation bump (and one final dump if the warning came first)
    dumps = plane.sent_commands("final-dump")
    backup = recover(plane, "sim-7", periodic, final_from=primary if dumps else None)
    assert len(plane.executions()) == 1
    assert len(plane.backups()) == 1
    job = plane.job("sim-7")
    assert (job.status, job.instance_id, job.generation) == (Status.RUNNING, backup, 1)
    assert len(plane.sent_commands("final-dump")) <= 1


def test_capacity_errors_on_every_spot_option_end_on_demand(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given no spot capacity anywhere, for the job's type or its fallback
    primary = plane.start_job("cfd-3", **{tag_names.FALLBACK_TYPES: "m6i.large"})
    periodic = commit(plane, "cfd-3", primary, 0, "periodic")
    tried = plane.refuse_launches(lambda _type, _subnet, market: NO_CAPACITY if market == "spot" else None)

    # When the warning comes
    route(ec2_event("spot-interruption-warning", primary))
    backup = recover(plane, "cfd-3", periodic, final_from=primary)

    # Then every spot candidate was tried (2 types x 2 subnets) and the backup is on-demand
    assert [market for _, _, market in tried] == ["spot"] * 4 + ["on-demand"]
    [instance] = plane.backups()
    assert instance["InstanceId"] == backup
    assert instance.get("InstanceLifecycle") != "spot"
    assert plane.job("cfd-3").status == Status.RUNNING


def test_ebs_volume_moves_to_another_az_through_a_snapshot(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an EBS job in AZ a, and no capacity left in AZ a
    primary = plane.start_job("fem-1", **{tag_names.STORAGE: "ebs"})
    volume_id = plane.job("fem-1").volume_id
    assert volume_id
    periodic = commit(plane, "fem-1", primary, 0, "periodic")
    _no_capacity_in(plane, plane.subnets["us-east-1a"])

    # When the job is interrupted and recovered on a backup in AZ b
    route(ec2_event("spot-interruption-warning", primary))
    backup = recover(plane, "fem-1", periodic, final_from=primary)

    # Then the old VM was asked to release the volume, and the job's data reached AZ b through a snapshot
    [release] = plane.sent_commands("release")
    assert release == {
        "document": "spotcr-release",
        "instances": [primary],
        "parameters": {"JobId": "fem-1", "Generation": "1"},
    }
    job = plane.job("fem-1")
    assert job.volume_id != volume_id
    [volume] = plane.ec2.describe_volumes(VolumeIds=[str(job.volume_id)])["Volumes"]
    assert volume["AvailabilityZone"] == "us-east-1b"
    assert volume["Encrypted"] is True
    assert volume["SnapshotId"]
    assert [a["InstanceId"] for a in volume["Attachments"]] == [backup]
    # And the volume the move made carries the stack's own tag, which its roles need to attach, move and delete it
    stack_tag = {t["Key"]: t["Value"] for t in volume["Tags"]}[tag_names.STACK]
    assert stack_tag == os.environ[ENV["stack_name"]]


def test_an_ebs_hand_over_that_never_finishes_ends_failed_and_notified(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an EBS job whose backup lands in another AZ, and a snapshot that never completes
    monkeypatch.setenv(ENV["ebs_handover_s"], "2")
    primary = plane.start_job("fem-9", **{tag_names.STORAGE: "ebs"})
    periodic = commit(plane, "fem-9", primary, 0, "periodic")
    _no_capacity_in(plane, plane.subnets["us-east-1a"])
    original_snapshot = EBSBackend.create_snapshot

    def create_snapshot(self: Any, *args: Any, **kwargs: Any) -> Any:
        snapshot = original_snapshot(self, *args, **kwargs)
        snapshot.status = "pending"
        return snapshot

    monkeypatch.setattr(EBSBackend, "create_snapshot", create_snapshot)

    # When the job is interrupted and its final dump comes in
    route(ec2_event("spot-interruption-warning", primary))
    record = plane.wait_until(lambda: (r := plane.job("fem-9")).backup_instance_id and r, "the backup launch")
    plane.wait_for_token("fem-9", "final-dump")
    commit(plane, "fem-9", primary, 1, "final")
    route(agent_event(events.AgentReady("fem-9", str(record.backup_instance_id), 1, now_iso(), mode="restore")))

    # Then the hand-over gives up at its deadline: the job is FAILED, says why, and nothing is restored
    assert plane.wait_for_execution()["status"] == "FAILED"
    job = plane.job("fem-9")
    assert job.status == Status.FAILED
    assert "has not reached backup" in str(job.reason)
    assert plane.sent_commands("restore") == []
    assert periodic
    [notice] = plane.notifications()
    assert "fem-9" in notice and "has not reached backup" in notice


def test_an_aborted_recovery_fails_the_job_and_notifies(plane: ControlPlane) -> None:
    # Given a job whose recovery is under way
    primary = plane.start_job("abort-1")
    commit(plane, "abort-1", primary, 0, "periodic")
    route(ec2_event("spot-interruption-warning", primary))
    plane.wait_for_token("abort-1", "final-dump")
    plane.wait_until(lambda: plane.job("abort-1").backup_instance_id, "the backup launch")
    [execution] = plane.executions()
    assert plane.job("abort-1").status == Status.RECOVERING

    # When the execution is aborted (or times out), which runs no Catch, and Step Functions says so
    plane.sfn.stop_execution(executionArn=execution["executionArn"])
    described = plane.sfn.describe_execution(executionArn=execution["executionArn"])
    status_change = {
        "version": "0",
        "id": "5b5a3f8e-0d0e-4a8e-9a53-6d1f3e0c9a11",
        "detail-type": "Step Functions Execution Status Change",
        "source": "aws.states",
        "account": "123456789012",
        "time": now_iso(),
        "region": "us-east-1",
        "resources": [execution["executionArn"]],
        "detail": {
            "executionArn": execution["executionArn"],
            "stateMachineArn": plane.state_machine_arn,
            "name": execution["name"],
            "status": "ABORTED",
            "input": described["input"],
        },
    }
    [(name, result)] = route(status_change)

    # Then the job is FAILED with the reason, the topic is told, and a repeat of the event does nothing more
    assert (name, result["action"]) == ("recovery-ended", "failed")
    job = plane.job("abort-1")
    assert job.status == Status.FAILED and "ABORTED" in str(job.reason)
    [notice] = plane.notifications()
    assert "abort-1" in notice
    [(_, again)] = route(status_change)
    assert again["action"] == "ignored"


def test_a_step_told_the_job_moved_on_when_it_had_not_fails_the_job_and_notifies(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a job whose recovery's backup launch finds its write refused although the job is still RECOVERING this
    # generation (as a wave once saw, from a condition two writes shared: tests/functions/test_registry_transitions)
    primary = plane.start_job("moved-1")
    commit(plane, "moved-1", primary, 0, "periodic")
    monkeypatch.setattr(Registry, "record_backup", lambda *args, **kwargs: None)

    # When the warning comes and the launch step leaves as StaleGeneration
    route(ec2_event("spot-interruption-warning", primary))
    execution = plane.wait_for_execution()

    # Then the job is not left RECOVERING with no workflow: it is FAILED with the reason, and the topic is told
    job = plane.job("moved-1")
    assert (job.status, execution["status"]) == (Status.FAILED, "FAILED")
    assert "StaleGeneration" in str(job.reason) and "moved on while its backup launched" in str(job.reason)
    [notice] = plane.notifications()
    assert "moved-1" in notice


def test_ebs_volume_in_the_same_az_is_detached_and_attached(plane: ControlPlane) -> None:
    primary = plane.start_job("fem-2", **{tag_names.STORAGE: "ebs"})
    volume_id = plane.job("fem-2").volume_id
    periodic = commit(plane, "fem-2", primary, 0, "periodic")

    route(ec2_event("spot-interruption-warning", primary))
    backup = recover(plane, "fem-2", periodic, final_from=primary)

    job = plane.job("fem-2")
    assert job.volume_id == volume_id
    [volume] = plane.ec2.describe_volumes(VolumeIds=[str(volume_id)])["Volumes"]
    assert [a["InstanceId"] for a in volume["Attachments"]] == [backup]
    assert plane.ec2.describe_snapshots(Filters=[{"Name": "tag:spotcr:job", "Values": ["fem-2"]}])["Snapshots"] == []


def test_missed_warning_recovers_from_the_newest_committed_checkpoint(plane: ControlPlane) -> None:
    # Given a job with two periodic checkpoints
    primary = plane.start_job("etl-9")
    commit(plane, "etl-9", primary, 0, "periodic", at_ms=1_795_000_000_000)
    newest = commit(plane, "etl-9", primary, 0, "periodic", at_ms=1_795_000_060_000)

    # When only "terminated" arrives (the warning was lost), and the warning shows up late
    route(ec2_event("state-change-terminated", primary))
    route(ec2_event("spot-interruption-warning", primary))

    # Then no final dump is ordered, and the job restores the newest periodic checkpoint on a backup
    assert plane.sent_commands("final-dump") == []
    backup = recover(plane, "etl-9", newest)
    job = plane.job("etl-9")
    assert (job.status, job.instance_id, job.generation, job.checkpoint_id) == (Status.RUNNING, backup, 1, newest)
    assert len(plane.executions()) == 1


def test_terminated_old_instance_after_recovery_does_nothing(plane: ControlPlane) -> None:
    primary = plane.start_job("old-1")
    periodic = commit(plane, "old-1", primary, 0, "periodic")
    route(ec2_event("spot-interruption-warning", primary))
    backup = recover(plane, "old-1", periodic, final_from=primary)
    final = plane.job("old-1").checkpoint_id

    # When the replaced VM's late events arrive: termination, a zombie checkpoint at the old generation
    route(ec2_event("state-change-terminated", primary))
    route(ec2_event("spot-interruption-warning", primary))
    commit(plane, "old-1", primary, 0, "periodic")

    # Then the job is untouched on its backup
    job = plane.job("old-1")
    assert (job.status, job.instance_id, job.generation, job.checkpoint_id) == (Status.RUNNING, backup, 1, final)
    assert len(plane.executions()) == 1


def test_backup_interrupted_later_starts_the_same_cycle(plane: ControlPlane) -> None:
    primary = plane.start_job("long-1")
    periodic = commit(plane, "long-1", primary, 0, "periodic")
    route(ec2_event("spot-interruption-warning", primary))
    backup = recover(plane, "long-1", periodic, final_from=primary)
    second = commit(plane, "long-1", backup, 1, "periodic", sequence=order_periodic(plane, "long-1", backup))

    route(ec2_event("spot-interruption-warning", backup))

    finals = plane.sent_commands("final-dump")
    [first_dump, second_dump] = sorted(finals, key=lambda c: c["parameters"]["Generation"])
    assert second_dump["instances"] == [backup]
    assert second_dump["parameters"]["Generation"] == "2"
    assert first_dump["parameters"]["Generation"] == "1"
    record = plane.wait_until(lambda: (r := plane.job("long-1")).backup_instance_id and r, "the second backup")
    assert record.generation == 2
    assert record.checkpoint_id == second
    names = sorted(e["name"] for e in plane.executions())
    assert [name.rsplit("-", 1)[0] for name in names] == ["long-1-g1", "long-1-g2"]


def test_a_job_name_run_again_after_it_completed_still_recovers(plane: ControlPlane) -> None:
    # Given a job that was recovered once (generation 1), then completed on its backup
    primary = plane.start_job("again-1")
    periodic = commit(plane, "again-1", primary, 0, "periodic")
    route(ec2_event("spot-interruption-warning", primary))
    backup = recover(plane, "again-1", periodic, final_from=primary)
    finish_exit(events.JobExited("again-1", backup, 1, now_iso(), exit_code=0))
    assert plane.job("again-1").status == Status.COMPLETED

    # When the user runs the same job name again (generation 0 on a new VM) and that VM is interrupted
    rerun = plane.start_job("again-1")
    commit(plane, "again-1", rerun, 0, "periodic")
    route(ec2_event("spot-interruption-warning", rerun))

    # Then a second recovery starts and launches a backup for the rerun (the first one's name is not reused)
    record = plane.wait_until(lambda: (r := plane.job("again-1")).backup_instance_id and r, "the rerun's backup")
    assert (record.generation, record.recovering_from) == (1, rerun)
    assert record.backup_instance_id != backup
    assert len(plane.executions()) == 2


def test_a_restore_that_never_answers_is_not_followed_by_a_second_one(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given short waits, and a job with two periodic checkpoints
    monkeypatch.setenv(ENV["final_dump_wait_s"], "1")
    monkeypatch.setenv(ENV["restore_wait_s"], "1")
    primary = plane.start_job("quiet-1")
    older = commit(plane, "quiet-1", primary, 0, "periodic", at_ms=1_795_000_000_000)
    newest = commit(plane, "quiet-1", primary, 0, "periodic", at_ms=1_795_000_060_000)

    # When the old VM never reports its final dump and the backup never reports its restores
    route(ec2_event("spot-interruption-warning", primary))
    record = plane.wait_until(lambda: (r := plane.job("quiet-1")).backup_instance_id and r, "the backup launch")
    route(agent_event(events.AgentReady("quiet-1", str(record.backup_instance_id), 1, now_iso(), mode="restore")))

    # Then the newest checkpoint is tried; SSM says its command still runs, so no second one is sent; once it has
    # run twice the restore wait the job is FAILED and the backup (where that restore runs) terminated
    assert plane.wait_for_execution()["status"] == "FAILED"
    restores = [c["parameters"]["CheckpointId"] for c in plane.sent_commands("restore")]
    assert restores == [newest]
    assert older != newest
    job = plane.job("quiet-1")
    assert job.status == Status.FAILED
    assert "RestoreTimedOut" in str(job.reason)
    [backup] = plane.backups()
    assert backup["State"]["Name"] in ("shutting-down", "terminated")


def test_restore_failure_retries_the_previous_checkpoint(plane: ControlPlane) -> None:
    primary = plane.start_job("retry-1")
    older = commit(plane, "retry-1", primary, 0, "periodic", at_ms=1_795_000_000_000)
    newest = commit(plane, "retry-1", primary, 0, "periodic", at_ms=1_795_000_060_000)
    route(ec2_event("state-change-terminated", primary))
    record = plane.wait_until(lambda: (r := plane.job("retry-1")).backup_instance_id and r, "the backup launch")
    backup = str(record.backup_instance_id)
    route(agent_event(events.AgentReady("retry-1", backup, 1, now_iso(), mode="restore")))

    # When restoring the newest checkpoint fails on the backup
    plane.wait_until(lambda: plane.sent_commands("restore"), "the first restore")
    finish_restore(events.RestoreFailed("retry-1", backup, 1, now_iso(), checkpoint_id=newest, reason="corrupt"))

    # Then the previous checkpoint is restored and the job runs again
    plane.wait_until(lambda: len(plane.sent_commands("restore")) == 2, "the second restore")
    assert {c["parameters"]["CheckpointId"] for c in plane.sent_commands("restore")} == {newest, older}
    finish_restore(events.RestoreCompleted("retry-1", backup, 1, now_iso(), checkpoint_id=older, seconds=1.0))
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    assert plane.job("retry-1").status == Status.RUNNING
