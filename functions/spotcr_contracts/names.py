"""Names spotcr gives AWS requests and resources, shared by the functions and the CLI: deterministic where a retry
must find the same one, within AWS's limits."""

from __future__ import annotations

import hashlib

# Step Functions allows 80 characters in an execution name: the job's first 56, "-g", the generation, "-", 8 hex.
_EXECUTION_JOB_CHARS = 56


def client_token(*parts: str | None) -> str:
    """An EC2 ClientToken for these parts: the same parts give the same token, and EC2 allows 64 characters."""
    return hashlib.sha256("|".join(part or "" for part in parts).encode()).hexdigest()[:48]


def execution_prefix(job_id: str) -> str:
    """What every recovery execution of the job is named with first."""
    return f"{job_id[:_EXECUTION_JOB_CHARS]}-g"


def execution_name(job_id: str, generation: int, recovering_from: str | None, interrupted_at: str | None) -> str:
    """One name per interruption, stable for its duplicates. Step Functions keeps a name 90 days, and a job name
    registered again after it finished restarts at generation 0, so the interruption itself is in the name."""
    digest = client_token(job_id, str(generation), recovering_from, interrupted_at)
    return f"{execution_prefix(job_id)}{generation}-{digest[:8]}"
