"""Each transition of the job record's data-access layer refuses the interleaving its guard is for.

Every test reads a record, lets another writer move it (the interleaving, forced), then makes the write from the
record as first read: the guard must refuse it and leave the record as the other writer left it.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import boto3
import pytest
from boto3.dynamodb.conditions import ConditionExpressionBuilder
from moto import mock_aws
from spotcr_contracts import protocol
from spotcr_contracts.nodes import NodeRecord
from spotcr_functions import registry_schema
from spotcr_functions.models import JobRecord, Status
from spotcr_functions.registry import Registry, StaleGeneration, early_ready_key

REPO = Path(__file__).resolve().parents[2]
AT = "2026-11-26T10:00:00Z"


@pytest.fixture(scope="module")
def table() -> Iterator[Registry]:
    """One moto table for the module (creating it costs about a second); each test starts with no job in it."""
    with pytest.MonkeyPatch.context() as patch, mock_aws():
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            patch.setenv(name, "testing")
        boto3.client("dynamodb").create_table(**registry_schema.create_table_arguments("jobs"))
        yield Registry("jobs")


@pytest.fixture
def registry(table: Registry) -> Registry:
    table.table.delete_item(Key={registry_schema.PARTITION_KEY: "job-1"})
    return table


def job(registry: Registry, **values: Any) -> JobRecord:
    """A registered job (RUNNING at generation 2 on i-1 unless told otherwise)."""
    item = {
        "job_id": "job-1",
        "status": Status.RUNNING,
        "generation": 2,
        "instance_id": "i-1",
        "az": "us-east-1a",
        "subnet_id": "subnet-1",
        "vpc_id": "vpc-1",
        "instance_type": "m7i.large",
        "storage": "s3",
        "interval_s": 600,
        "tags": {},
        "run_id": "run-1",
        **values,
    }
    registry.table.put_item(Item={k: str(v) if isinstance(v, Status) else v for k, v in item.items()})
    return JobRecord.from_item(item)


def now(registry: Registry) -> JobRecord:
    record = registry.get("job-1")
    assert record is not None
    return record


def recovering(registry: Registry, **values: Any) -> JobRecord:
    return job(registry, status=Status.RECOVERING, recovering_from="i-1", backup_instance_id="i-2", **values)


def test_a_registration_never_replaces_a_job_that_has_not_ended(registry: Registry) -> None:
    live = job(registry)
    assert registry.register(replace(live, run_id="run-2", status=Status.PENDING)) == live
    ended = job(registry, status=Status.FAILED)
    again = replace(ended, run_id="run-2", generation=0, status=Status.PENDING)
    assert registry.register(again) == again
    assert now(registry).run_id == "run-2"


def test_a_volume_is_recorded_only_for_the_instance_that_registered_the_job(registry: Registry) -> None:
    job(registry, instance_id="i-other")
    assert registry.record_volume("job-1", "i-1", "vol-1") is None
    assert now(registry).volume_id is None


def test_an_access_point_is_not_recorded_once_the_run_ended_or_another_was_stored(registry: Registry) -> None:
    job(registry, access_point_arn="arn:ap/other")
    assert registry.record_access_point("job-1", "run-1", "arn:ap/mine") is None
    job(registry, status=Status.COMPLETED)
    assert registry.record_access_point("job-1", "run-1", "arn:ap/mine") is None
    assert registry.record_access_point("job-1", "run-0", "arn:ap/mine") is None


def test_a_node_joins_only_its_runs_pending_record_and_only_a_free_index(registry: Registry) -> None:
    first = NodeRecord(2, "i-2", "10.0.0.12")
    record = registry.register(
        replace(
            job(registry, status=Status.FAILED),
            status=Status.PENDING,
            generation=0,
            instance_id="i-2",
            node_count=3,
            nodes=(first,),
            launch_key="ab" * 32,
        )
    )
    assert now(registry).nodes == (first,)
    taken = registry.join_node(record, NodeRecord(2, "i-9", "10.0.0.19"), AT)
    assert taken is None, "an index another instance holds"
    zero = registry.join_node(record, NodeRecord(0, "i-0", "10.0.0.10"), AT, {"instance_type": "c7i.large"})
    assert zero is not None and zero.instance_id == "i-0" and zero.instance_type == "c7i.large"
    again = registry.join_node(record, NodeRecord(0, "i-0", "10.0.0.10"), AT)
    assert again == zero, "the same instance joining again (a duplicate event) writes the same"
    assert registry.join_node(replace(record, node_count=4), NodeRecord(1, "i-1", "10.0.0.11"), AT) is None
    assert registry.join_node(replace(record, run_id="run-0"), NodeRecord(1, "i-1", "10.0.0.11"), AT) is None
    joined = registry.join_node(record, NodeRecord(1, "i-1", "10.0.0.11"), AT)
    assert joined is not None and [n.instance_id for n in joined.nodes] == ["i-0", "i-1", "i-2"]
    assert joined.launch_key == "ab" * 32 and joined.node_of("i-1") == NodeRecord(1, "i-1", "10.0.0.11")
    registry.mark_started(joined, 0, AT)
    assert registry.join_node(joined, NodeRecord(1, "i-7", "10.0.0.17"), AT) is None, "the job started"
    assert now(registry).node_of("i-1") is not None


def test_a_start_moves_only_a_pending_job(registry: Registry) -> None:
    seen = job(registry, status=Status.PENDING)
    assert registry.mark_started(seen, 100, AT) is not None
    assert registry.mark_started(seen, 200, AT) is None  # a duplicate JobStarted
    assert now(registry).next_checkpoint_at == 100


def test_two_schedulers_due_at_the_same_time_order_one_periodic_dump(registry: Registry) -> None:
    seen = job(registry, next_checkpoint_at=50, dump_sequence=3)
    first = registry.claim_periodic_dump(seen, 50, 650, AT)
    assert first is not None and first.dump_sequence == 4 and first.status == Status.CHECKPOINTING
    assert registry.claim_periodic_dump(seen, 50, 650, AT) is None
    assert now(registry).dump_sequence == 4


def test_no_periodic_dump_is_ordered_from_an_instance_the_job_left(registry: Registry) -> None:
    seen = job(registry)
    job(registry, instance_id="i-2")  # Finish moved the job to its backup
    assert registry.claim_periodic_dump(seen, None, 650, AT) is None


def test_a_dump_settles_only_a_checkpointing_job(registry: Registry) -> None:
    seen = job(registry, status=Status.CHECKPOINTING)
    recovering(registry)
    assert registry.settle_periodic_dump(seen, AT) is None
    assert now(registry).status == Status.RECOVERING


def test_a_plan_comes_only_from_the_instance_that_runs_the_job(registry: Registry) -> None:
    seen = job(registry, final_dump_risk="too big")
    assert registry.record_plan(seen, "i-zombie", {"planned_interval_s": 60}, at_risk=False) is None
    planned = registry.record_plan(seen, "i-1", {"planned_interval_s": 60}, at_risk=False)
    assert planned is not None and planned.planned_interval_s == 60 and planned.final_dump_risk is None


def test_a_checkpoint_read_before_another_was_recorded_is_not_recorded_over_it(registry: Registry) -> None:
    seen = job(registry, checkpoint_id="a")
    assert registry.record_checkpoint(seen, "b", "i-1", AT) is not None
    assert registry.record_checkpoint(seen, "c", "i-1", AT) is None
    assert (now(registry).checkpoint_id, now(registry).previous_checkpoint_id) == ("b", "a")


def test_no_checkpoint_is_recorded_once_the_restore_is_ordered(registry: Registry) -> None:
    seen = recovering(registry)
    registry.close_generation("job-1", 2, AT)
    assert registry.record_checkpoint(seen, "late-final", "i-1", AT) is None
    assert now(registry).checkpoint_id is None


def test_an_exit_claim_of_an_older_generation_is_not_kept(registry: Registry) -> None:
    seen = job(registry)
    job(registry, generation=3)
    assert registry.record_exit_claim(seen, {"command_id": "c"}, AT) is None


def test_a_job_ends_exactly_once(registry: Registry) -> None:
    seen = job(registry)
    assert registry.end(seen, Status.COMPLETED, {"exit_code": 0}) is not None
    assert registry.end(seen, Status.FAILED, {"exit_code": 1}) is None
    assert (now(registry).status, now(registry).exit_code) == (Status.COMPLETED, 0)


def test_a_record_read_after_its_end_is_never_ended_again(registry: Registry) -> None:
    ended = registry.end(job(registry), Status.COMPLETED, {"exit_code": 0})
    assert ended is not None
    with pytest.raises(ValueError, match="already ended COMPLETED"):
        registry.end(ended, Status.FAILED, {"exit_code": 1})
    assert (now(registry).status, now(registry).exit_code) == (Status.COMPLETED, 0)


def test_an_end_read_before_a_backup_was_launched_is_refused(registry: Registry) -> None:
    seen = job(registry, status=Status.RECOVERING, recovering_from="i-1")
    recovering(registry)
    assert registry.end(seen, Status.CANCELLED, {}) is None


def test_an_end_must_be_an_ended_status(registry: Registry) -> None:
    with pytest.raises(ValueError, match="RUNNING is not an end"):
        registry.end(job(registry), Status.RUNNING, {})


def test_an_interrupted_instance_fences_the_job_once(registry: Registry) -> None:
    job(registry, dump_sequence=5, next_checkpoint_at=9, restore_ordered_at=AT, token_final_dump={"token": "t"})
    bumped = registry.bump_generation("job-1", "i-1", 2, AT)
    assert bumped is not None and (bumped.generation, bumped.status, bumped.dump_sequence) == (3, "RECOVERING", 6)
    assert bumped.next_checkpoint_at is None and bumped.restore_ordered_at is None and not bumped.token("final-dump")
    assert registry.bump_generation("job-1", "i-1", 2, AT) is None  # the duplicate warning
    assert registry.bump_generation("job-1", "i-1", 3, AT) is None  # already recovering from i-1
    assert now(registry).generation == 3


def test_a_fence_keeps_an_early_final_dump_at_the_new_generation(registry: Registry) -> None:
    arrival = {"generation": 2, "output": {"instance_id": "i-1", "checkpoint_id": "final"}}
    job(registry, event_final_dump=arrival)
    bumped = registry.bump_generation("job-1", "i-1", 2, AT)
    assert bumped is not None and bumped.arrival("final-dump") == {**arrival, "generation": 3}


def test_a_fence_from_a_record_read_before_an_early_final_dump_re_reads_and_keeps_it(registry: Registry) -> None:
    # Given the record as the warning's handler read it, then the agent's early final dump recorded
    read = job(registry)
    arrival = {"generation": 2, "output": {"instance_id": "i-1", "checkpoint_id": "final"}}
    registry.update("job-1", {"event_final_dump": arrival})
    # When the fence writes from what it read, its condition fails; it re-reads and keeps the dump
    bumped = registry.bump_generation("job-1", "i-1", 2, AT, read=read)
    assert bumped is not None and bumped.arrival("final-dump") == {**arrival, "generation": 3}


def test_a_lost_backup_fences_the_job_only_while_it_is_the_backup(registry: Registry) -> None:
    seen = recovering(registry, handover_volume_id="vol-2")
    bumped = registry.bump_backup(seen, AT)
    assert bumped is not None and (bumped.generation, bumped.recovering_from) == (3, "i-2")
    assert bumped.backup_instance_id is None and bumped.handover_volume_id == "vol-2"
    assert registry.bump_backup(seen, AT) is None


def test_a_users_restore_fences_only_the_job_as_read_and_clears_what_every_fence_clears(registry: Registry) -> None:
    seen = job(registry, status=Status.FAILED, restore_ordered_at=AT, previous_checkpoint_id="x")
    job(registry, status=Status.FAILED, generation=3, restore_ordered_at=AT, previous_checkpoint_id="x")
    assert registry.fence_for_restore(seen, "chosen", None, AT) is None
    fenced = registry.fence_for_restore(now(registry), "chosen", None, AT)
    assert fenced is not None and (fenced.generation, fenced.status) == (4, Status.RECOVERING)
    assert fenced.checkpoint_id == "chosen"
    assert fenced.restore_ordered_at is None and fenced.previous_checkpoint_id is None


def test_the_restore_order_closes_the_generation_and_ranks_after_every_dump_of_it(registry: Registry) -> None:
    recovering(registry, dump_sequence=7)
    closed = registry.close_generation("job-1", 2, AT)
    assert closed is not None and closed.dump_sequence == 8 and closed.restore_ordered_at == AT
    assert registry.close_generation("job-1", 1, AT) is None


def test_a_backup_launched_for_a_generation_that_moved_on_is_not_recorded(registry: Registry) -> None:
    job(registry)  # Finish ran: no longer recovering
    assert registry.record_backup("job-1", 2, "i-3", "us-east-1b", AT) is None


def test_an_early_ready_report_is_kept_only_until_another_backup_is_recorded(registry: Registry) -> None:
    job(registry, status=Status.RECOVERING, recovering_from="i-1")  # no backup recorded yet
    kept = registry.keep_early_ready("job-1", 2, "i-2", AT)
    assert kept is not None and (kept.arrival(early_ready_key("i-2")) or {}).get("generation") == 2
    registry.record_backup("job-1", 2, "i-2", "us-east-1b", AT)
    assert registry.keep_early_ready("job-1", 2, "i-2", AT) is not None  # the backup's own, recorded meanwhile
    assert registry.keep_early_ready("job-1", 2, "i-3", AT) is None  # another instance once a backup is recorded
    assert registry.keep_early_ready("job-1", 1, "i-2", AT) is None  # another generation
    assert now(registry).arrival(early_ready_key("i-3")) is None
    finished = registry.finish_recovery("job-1", 2, {"instance_id": "i-2"})
    assert finished is not None and finished.arrival(early_ready_key("i-2")) is None
    assert registry.keep_early_ready("job-1", 2, "i-4", AT) is None  # the generation no longer recovers


def test_a_recovery_finishes_once(registry: Registry) -> None:
    recovering(registry, restore_ordered_at=AT)
    finished = registry.finish_recovery("job-1", 2, {"instance_id": "i-2"})
    assert finished is not None and finished.status == Status.RUNNING and finished.backup_instance_id is None
    assert registry.finish_recovery("job-1", 2, {"instance_id": "i-3"}) is None


def test_a_recovery_that_gives_up_keeps_an_end_made_meanwhile(registry: Registry) -> None:
    job(registry, status=Status.COMPLETED)
    assert registry.fail_recovery("job-1", 2, "gave up", AT) is None
    assert now(registry).status == Status.COMPLETED


def test_a_wait_is_stored_only_while_the_generation_recovers(registry: Registry) -> None:
    job(registry)
    with pytest.raises(StaleGeneration):
        registry.store_token("job-1", "final-dump", 2, "token")


WRITES_AT_A_GENERATION: dict[str, Callable[[Registry, int], JobRecord | None]] = {
    "forget_volume": lambda r, g: r.forget_volume("job-1", g, AT),
    "record_final_dump_order": lambda r, g: r.record_final_dump_order("job-1", g, {"command_id": "c"}),
    "record_image_warning": lambda r, g: r.record_image_warning("job-1", g, "gone"),
    "record_handover": lambda r, g: r.record_handover("job-1", g, snapshot_id="snap-1"),
    "record_restore_order": lambda r, g: r.record_restore_order("job-1", g, "command_restore", {"command_id": "c"}),
    "record_arrival": lambda r, g: r.record_arrival("job-1", "final-dump", g, {"output": {}}),
}


@pytest.mark.parametrize("write", WRITES_AT_A_GENERATION.values(), ids=WRITES_AT_A_GENERATION.keys())
def test_a_recovery_step_of_an_older_generation_writes_nothing(
    registry: Registry, write: Callable[[Registry, int], JobRecord | None]
) -> None:
    before = recovering(registry, generation=3)
    assert write(registry, 2) is None
    assert now(registry) == before
    assert write(registry, 3) is not None


def test_no_module_but_the_registry_writes_the_job_record_with_a_condition() -> None:
    written = re.compile(r"ConditionExpression|update_item|put_item|transact_write|condition=|\._write\(")
    sources = [*(REPO / "functions").rglob("*.py"), *(REPO / "cli").rglob("*.py"), *(REPO / "rehearsal").rglob("*.py")]
    registry = REPO / "functions" / "spotcr_functions" / "registry.py"
    offenders = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sources
        if path != registry
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if written.search(line)
    ]
    assert offenders == []


def test_the_protocol_page_is_the_protocol_modules_docstring() -> None:
    page = (REPO / "docs" / "design" / "protocol.md").read_text()
    assert page == protocol.page(), "run: python -m spotcr_contracts.protocol > docs/design/protocol.md"


# Conditional writes from several threads through one Registry. boto3's Table builds a condition expression with one
# ConditionExpressionBuilder per resource, reset at each call: two threads building at once take each other's
# placeholders, and a write is then refused (or allowed) on a condition nobody wrote. Lambda runs one invocation at a
# time per execution environment, but the local AWS runs concurrent invocations in one process, sharing the handlers'
# cached Registry: a wave of 100 recoveries saw a backup's launch refused as "moved on" while its job had not moved.
THREADS, WRITES = 8, 20


def test_writes_from_many_threads_through_one_registry_are_each_judged_on_their_own_condition(
    table: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given jobs recovering at generations of their own (job n at generation n + 1, RECOVERING)
    for n in range(THREADS):
        job(table, job_id=f"thread-{n}", status=Status.RECOVERING, generation=n + 1, instance_id=f"i-{n}")

    # When each job's thread records a backup again and again, each write conditional on its own generation
    refused: list[str] = []

    def record_backups(n: int) -> None:
        for write in range(WRITES):
            if (
                table.record_backup(f"thread-{n}", n + 1, f"i-b{n}-{write}", "us-east-1a", "2026-11-27T10:00:00Z")
                is None
            ):
                refused.append(f"thread-{n} write {write}")

    # (the interleaving forced: a thread that takes a value placeholder lets the others run, as a loaded process may)
    placeholder = ConditionExpressionBuilder._get_value_placeholder

    def yielding(builder: ConditionExpressionBuilder) -> str:
        time.sleep(0.001)
        return placeholder(builder)

    monkeypatch.setattr(ConditionExpressionBuilder, "_get_value_placeholder", yielding)
    threads = [threading.Thread(target=record_backups, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # Then none was refused: every job stayed at its generation, RECOVERING, with its last backup recorded
    assert refused == []
    for n in range(THREADS):
        record = table.get(f"thread-{n}")
        assert record is not None
        assert (record.generation, record.status, record.backup_instance_id) == (
            n + 1,
            Status.RECOVERING,
            f"i-b{n}-{WRITES - 1}",
        )
