"""Per-job isolation on EFS: an access point per job, created with its registration and deleted when it ends.

The access point's root is /jobs/<job> (EFS creates it, owned by root, mode 0700), where the job's checkpoints
lie without isolation too; the agent mounts it at <mount point>/jobs/<job>. A job VM mounts only
through it: the file system policy refuses a mount without an access point and without IAM (infra/storage.py),
and the store-credentials function vends a session whose policy names this job's access point ARN
(store_access.session_policy). Deleting the access point keeps the files: a finished job's checkpoints stay on
the file system, reachable from the file system's root by an administrator.
"""

from __future__ import annotations

from aws_lambda_powertools import Logger
from spotcr_contracts import tags
from spotcr_contracts.names import client_token

from spotcr_functions.deps import Deps
from spotcr_functions.models import JobRecord
from spotcr_functions.observability import SERVICE

logger = Logger(service=SERVICE, child=True)

ROOT = "/jobs"  # the store's own layout (jobs/<job>/...): an access point shows the job's directory and nothing else


def root_directory(job_id: str) -> str:
    return f"{ROOT}/{job_id}"


def open_for(deps: Deps, record: JobRecord) -> JobRecord:
    """The job's access point, once per run (ClientToken: a retried registration gets the same one)."""
    file_system_id = deps.settings.file_system_id
    if record.storage != "efs" or not file_system_id or record.access_point_arn:
        return record
    access_point_arn = deps.cloud.create_access_point(
        file_system_id,
        root_directory(record.job_id),
        tags={tags.JOB: record.job_id, tags.RUN: record.run_id},
        client_token=client_token(record.job_id, record.run_id, "efs"),
    )
    updated = deps.registry.record_access_point(record.job_id, record.run_id, access_point_arn)
    if updated is None:
        # Another registration of this run stored its own, or the run ended meanwhile (its end deleted what the
        # record held): this one is not used.
        fresh = deps.registry.get(record.job_id)
        if fresh is None or fresh.access_point_arn != access_point_arn:
            deps.cloud.delete_access_point(access_point_arn)
        return fresh or record
    logger.info("access point created", job_id=record.job_id, access_point=access_point_arn)
    return updated


def close_for(deps: Deps, record: JobRecord) -> None:
    """The job ended: its access point goes (its files stay). A missing access point counts as deleted."""
    if not record.access_point_arn:
        return
    deps.cloud.delete_access_point(record.access_point_arn)
    logger.info("access point deleted", job_id=record.job_id, access_point=record.access_point_arn)
