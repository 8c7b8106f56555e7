"""Function settings: read once from the environment at the handler's edge, typed from then on.

infra/ sets exactly these variables on every function (ENV below is the one list).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV = {
    "jobs_table": "SPOTCR_JOBS_TABLE",
    "idempotency_table": "SPOTCR_IDEMPOTENCY_TABLE",
    "recovery_state_machine_arn": "SPOTCR_RECOVERY_STATE_MACHINE_ARN",
    "event_bus_name": "SPOTCR_EVENT_BUS_NAME",
    "failure_topic_arn": "SPOTCR_FAILURE_TOPIC_ARN",
    "checkpoint_bucket": "SPOTCR_CHECKPOINT_BUCKET",
    "launch_template_id": "SPOTCR_LAUNCH_TEMPLATE_ID",
    # The template's latest version at deploy: CloudFormation never moves $Default off version 1 on update.
    "launch_template_version": "SPOTCR_LAUNCH_TEMPLATE_VERSION",
    "checkpoint_document": "SPOTCR_CHECKPOINT_DOCUMENT",
    "restore_document": "SPOTCR_RESTORE_DOCUMENT",
    "release_document": "SPOTCR_RELEASE_DOCUMENT",
    "status_document": "SPOTCR_STATUS_DOCUMENT",
}
# Optional tuning with defaults; the rehearsal and tests shorten the recovery workflow's waits with them.
OPTIONAL_ENV = {
    "final_dump_wait_s": "SPOTCR_FINAL_DUMP_WAIT_SECONDS",
    "backup_ready_wait_s": "SPOTCR_BACKUP_READY_WAIT_SECONDS",
    "restore_wait_s": "SPOTCR_RESTORE_WAIT_SECONDS",
    "poll_s": "SPOTCR_POLL_SECONDS",
    "ebs_volume_gib": "SPOTCR_EBS_VOLUME_GIB",
    "ebs_handover_s": "SPOTCR_EBS_HANDOVER_SECONDS",
}
# Optional text settings the stack sets: where backups may launch, and whether a completed job keeps its EBS volume.
OPTIONAL_TEXT_ENV = {
    "subnet_ids": "SPOTCR_SUBNET_IDS",  # comma list; empty: a backup may only launch in its job's own subnet
    "keep_finished_volumes": "SPOTCR_KEEP_FINISHED_VOLUMES",  # "true": a completed EBS job's volume is kept
    "store_role_arn": "SPOTCR_STORE_ROLE_ARN",  # the role store-credentials assumes for one job's prefix
    "job_role_name": "SPOTCR_JOB_ROLE_NAME",  # the job VMs' role: the only caller store-credentials answers
    "file_system_id": "SPOTCR_FILE_SYSTEM_ID",  # the stack's EFS: an access point per efs job; empty without EFS
    "pending_timeout_minutes": "SPOTCR_PENDING_TIMEOUT_MINUTES",  # a job not started this long fails; 0: never
    "stack_name": "SPOTCR_STACK_NAME",  # the spotcr:stack tag value of the volumes and snapshots spotcr creates
}
DEFAULT_PENDING_TIMEOUT_MINUTES = 20


@dataclass(frozen=True)
class Settings:
    jobs_table: str
    idempotency_table: str
    recovery_state_machine_arn: str
    event_bus_name: str
    failure_topic_arn: str
    checkpoint_bucket: str
    launch_template_id: str
    launch_template_version: str
    checkpoint_document: str
    restore_document: str
    release_document: str
    status_document: str
    final_dump_wait_s: int = 110  # the 2-minute notice, less the time to launch the final dump
    backup_ready_wait_s: int = 900
    restore_wait_s: int = 900
    poll_s: int = 5
    ebs_volume_gib: int = 100
    ebs_handover_s: int = 3600  # from the warning; a first snapshot of a large volume can take tens of minutes
    subnet_ids: tuple[str, ...] = ()
    keep_finished_volumes: bool = False
    store_role_arn: str = ""
    job_role_name: str = ""
    file_system_id: str = ""
    pending_timeout_minutes: int = DEFAULT_PENDING_TIMEOUT_MINUTES
    stack_name: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        environ = os.environ if environ is None else environ
        missing = [name for name in ENV.values() if name not in environ]
        if missing:
            raise RuntimeError(f"missing settings: {', '.join(missing)}")
        values: dict[str, str | int] = {key: environ[name] for key, name in ENV.items()}
        for key, name in OPTIONAL_ENV.items():
            if name in environ:
                raw = environ[name]
                if not raw.isdigit() or int(raw) < 1:
                    raise RuntimeError(f"{name} must be a positive whole number, got {raw[:32]!r}")
                values[key] = int(raw)
        subnets = environ.get(OPTIONAL_TEXT_ENV["subnet_ids"], "")
        keep = environ.get(OPTIONAL_TEXT_ENV["keep_finished_volumes"], "false").strip().lower()
        if keep not in ("true", "false"):
            raise RuntimeError(f"{OPTIONAL_TEXT_ENV['keep_finished_volumes']} must be true or false, got {keep[:32]!r}")
        pending = environ.get(OPTIONAL_TEXT_ENV["pending_timeout_minutes"], str(DEFAULT_PENDING_TIMEOUT_MINUTES))
        if not pending.isascii() or not pending.isdigit():
            name = OPTIONAL_TEXT_ENV["pending_timeout_minutes"]
            raise RuntimeError(f"{name} must be a whole number of minutes (0: never), got {pending[:32]!r}")
        return cls(
            **values,  # type: ignore[arg-type]
            subnet_ids=tuple(s.strip() for s in subnets.split(",") if s.strip()),
            keep_finished_volumes=keep == "true",
            store_role_arn=environ.get(OPTIONAL_TEXT_ENV["store_role_arn"], ""),
            job_role_name=environ.get(OPTIONAL_TEXT_ENV["job_role_name"], ""),
            file_system_id=environ.get(OPTIONAL_TEXT_ENV["file_system_id"], ""),
            pending_timeout_minutes=int(pending),
            stack_name=environ.get(OPTIONAL_TEXT_ENV["stack_name"], ""),
        )
