"""Where a job's objects live in its storage (an S3 bucket, or the root of a mounted file system).

The agent writes them (spotcr_agent.store, .result, .checkpoint), the functions scope each VM's store credentials to
them (spotcr_functions.store_access), and the CLI reads and deletes them:
  jobs/<job>/                           the job name's: its kept logs, shared by its runs
  jobs/<job>/criu-logs/, agent-logs/    CRIU's log of a failed dump or restore, and the agent's own lines then
  jobs/<job>/runs/<run>/                one run's checkpoints (spotcr_agent.store.store has their layout)
  jobs/<job>/runs/<run>/result/         that run's result (spotcr_agent.result)
A store used without runs keeps a run's objects under jobs/<job>/ itself.
"""

from __future__ import annotations

JOBS_PREFIX = "jobs/"
CRIU_LOGS = "criu-logs"  # jobs/<job>/criu-logs/<ms>-<action>-<checkpoint>.log
AGENT_LOGS = "agent-logs"  # jobs/<job>/agent-logs/<ms>-<action>-<checkpoint>.log: the agent's own lines then
RESULT = "result"


def job_prefix(job_id: str) -> str:
    """Everything of the job name, every run's."""
    return f"{JOBS_PREFIX}{job_id}/"


def run_prefix(job_id: str, run_id: str = "") -> str:
    """Where one run of a job keeps its checkpoints, chunks and markers (a store used without runs: the job's)."""
    return f"{job_prefix(job_id)}runs/{run_id}/" if run_id else job_prefix(job_id)


def result_prefix(job_id: str, run_id: str = "") -> str:
    """Where one run's result lives: next to that run's checkpoints."""
    return f"{run_prefix(job_id, run_id)}{RESULT}/"


def is_result_key(job_id: str, key: str) -> bool:
    """Whether a store key belongs to a stored result of the job (any run's, or one stored before runs had ids)."""
    parts = key.removeprefix(job_prefix(job_id)).split("/")
    return parts[0] == RESULT or (len(parts) > 3 and parts[0] == "runs" and parts[2] == RESULT)
