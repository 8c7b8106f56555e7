"""The functions read the agent's result lines (the shared vectors of tests/events/results/) into the facts that
move a job, and take nothing from a line of another job or run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from spotcr_contracts import events
from spotcr_functions import checkpoints, exits, recovery
from spotcr_functions.models import JobRecord, Status

pytestmark = pytest.mark.claim("Facts come from authenticated sources")
VECTORS = Path(__file__).parents[1] / "events" / "results"
INSTANCE = "i-0123456789abcdef0"
AT = "2026-11-26T10:00:00.000Z"


def _invocation(vector: str, status: str = "Success", **change: Any) -> dict[str, Any]:
    """What SSM's GetCommandInvocation reports of a command whose agent printed the vector's line."""
    line = {**json.loads((VECTORS / f"{vector}.json").read_text())["line"], **change}
    return {"Status": status, "StandardOutputContent": f"a log line\n{json.dumps(line)}\n"}


def _record(generation: int = 2) -> JobRecord:
    return JobRecord(
        job_id="job-1",
        status=Status.RUNNING,
        generation=generation,
        instance_id=INSTANCE,
        az="eu-west-1a",
        subnet_id="subnet-1",
        vpc_id="vpc-1",
        instance_type="m5.large",
        storage="efs",
        interval_s=300,
        tags={},
        run_id="r-00000000000000a1",
    )


def test_a_committed_checkpoint_is_read_with_its_figures() -> None:
    report = checkpoints.reported_dump(_record(), "c-1", INSTANCE, _invocation("checkpoint-committed"), AT)
    assert report == events.CheckpointCompleted(
        "job-1",
        INSTANCE,
        2,
        AT,
        run_id="r-00000000000000a1",
        checkpoint_id="1795293235815-g2-s5-periodic",
        kind="periodic",
        seconds=3.52,
        frozen_seconds=1.25,
        bytes_total=211812352,
        bytes_uploaded=104857600,
        memory_tracking="incremental: dump on 4 parent image dirs",
        predicted_final_seconds=42.5,
        next_interval_s=180,
    )


def test_a_failed_final_dump_is_read_with_whether_it_stopped_the_job() -> None:
    report = checkpoints.reported_dump(_record(3), "c-1", INSTANCE, _invocation("checkpoint-failed", "Failed"), AT)
    assert isinstance(report, events.CheckpointFailed)
    assert (report.kind, report.generation, report.job_stopped) == ("final", 3, True)
    assert report.reason == "storage efs: /mnt/spotcr is not mounted"


def test_a_line_of_another_run_or_a_partial_line_reports_no_dump() -> None:
    other_run = _invocation("checkpoint-committed", run_id="r-00000000000000b2")
    partial = _invocation("checkpoint-committed", generation="2")
    refused = _invocation("command-failed", "Failed")
    for invocation in (other_run, partial, refused):
        assert checkpoints.reported_dump(_record(), "c-1", INSTANCE, invocation, AT) is None


def test_an_exit_is_read_from_the_status_once_its_result_is_settled() -> None:
    exited = exits.reported_exit(_record(), INSTANCE, _invocation("status-exited"), AT)
    assert exited is not None and (exited.exit_code, exited.generation) == (0, 2)
    assert exited.result.endswith("/result/manifest.json") and exited.run_id == "r-00000000000000a1"
    # A job still committing its result, or another run's answer, ends nothing yet
    assert exits.reported_exit(_record(), INSTANCE, _invocation("status-exited", result=""), AT) is None
    other = _invocation("status-exited", run_id="r-00000000000000b2")
    assert exits.reported_exit(_record(), INSTANCE, other, AT) is None


def test_an_order_that_found_the_job_ended_reports_its_exit_once_its_result_is_settled() -> None:
    invocation = _invocation("checkpoint-exited", "Failed")
    exited = checkpoints.reported_dump(_record(3), "c-1", INSTANCE, invocation, AT)
    assert isinstance(exited, events.JobExited)
    assert (exited.exit_code, exited.generation, exited.instance_id) == (3, 3, INSTANCE)
    assert exited.run_id == "r-00000000000000a1"
    assert exited.result.endswith("/result/manifest.json")
    # A result still being committed ends nothing yet: the agent's JobExited asks the status command
    unsettled = _invocation("checkpoint-exited", "Failed", result="")
    assert checkpoints.reported_dump(_record(3), "c-1", INSTANCE, unsettled, AT) is None
    # A result given up is settled: the job ends, its VM kept with the work dir
    given_up = _invocation("checkpoint-exited", "Failed", result="", result_error="S3 answered 403")
    assert isinstance(checkpoints.reported_dump(_record(3), "c-1", INSTANCE, given_up, AT), events.JobExited)


def test_a_restore_answer_names_its_attempt_only_for_this_run_and_generation() -> None:
    record = dataclasses.replace(_record(3), status=Status.RECOVERING, backup_instance_id=INSTANCE)
    assert recovery._attempt_of(record, "c-1", INSTANCE, _invocation("restore-restored")) == "previous"
    assert recovery._attempt_of(record, "c-1", INSTANCE, _invocation("restore-failed", "Failed")) == "newest"
    assert recovery._attempt_of(_record(4), "c-1", INSTANCE, _invocation("restore-restored")) is None
