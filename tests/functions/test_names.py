"""Names and idempotency tokens the control plane gives AWS: deterministic, unique per interruption, within limits."""

from __future__ import annotations

from spotcr_contracts.names import client_token, execution_prefix
from spotcr_functions.models import JobRecord, Status
from spotcr_functions.recovery import execution_name

LONGEST_JOB = "j" * 63  # spotcr:job allows 63 characters


def _recovering(job_id: str, generation: int, instance_id: str, at: str) -> JobRecord:
    return JobRecord(
        job_id=job_id,
        status=Status.RECOVERING,
        generation=generation,
        instance_id=instance_id,
        az="eu-west-1a",
        subnet_id="subnet-1",
        vpc_id="vpc-1",
        instance_type="m5.large",
        storage="s3",
        interval_s=300,
        tags={},
        recovering_from=instance_id,
        interrupted_at=at,
    )


def test_execution_names_fit_step_functions_and_differ_per_interruption() -> None:
    first = _recovering(LONGEST_JOB, 10**9, "i-0123456789abcdef0", "2026-01-01T00:00:00Z")
    same_name_run_again = _recovering(LONGEST_JOB, 10**9, "i-0fedcba9876543210", "2026-02-01T00:00:00Z")
    assert len(execution_name(first)) <= 80
    assert execution_name(first) == execution_name(first)
    assert execution_name(first) != execution_name(same_name_run_again)
    # and `spotcr cancel` finds every recovery of the job by its prefix, never another job's
    assert execution_name(first).startswith(execution_prefix(LONGEST_JOB))
    assert not execution_name(_recovering("job-10", 1, "i-1", "t")).startswith(execution_prefix("job-1"))


def test_client_tokens_fit_ec2_and_are_stable() -> None:
    record = _recovering(LONGEST_JOB, 10**9, "i-0123456789abcdef0", "2026-01-01T00:00:00Z")
    token = client_token(execution_name(record), "39")
    assert len(token) <= 64
    assert token == client_token(execution_name(record), "39")
    assert token != client_token(execution_name(record), "volume")
    assert len(client_token(LONGEST_JOB, "i-0123456789abcdef0")) <= 64
