"""Function settings: read once from the environment at the handler's edge, typed from then on.

infra/ sets exactly these variables on every function (ENV below is the one list).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

ENV = {
    "jobs_table": "SPOTCR_JOBS_TABLE",
    "idempotency_table": "SPOTCR_IDEMPOTENCY_TABLE",
    "recovery_state_machine_arn": "SPOTCR_RECOVERY_STATE_MACHINE_ARN",
    "event_bus_name": "SPOTCR_EVENT_BUS_NAME",
    "failure_topic_arn": "SPOTCR_FAILURE_TOPIC_ARN",
    "checkpoint_bucket": "SPOTCR_CHECKPOINT_BUCKET",
    "launch_template_id": "SPOTCR_LAUNCH_TEMPLATE_ID",
    "checkpoint_document": "SPOTCR_CHECKPOINT_DOCUMENT",
    "restore_document": "SPOTCR_RESTORE_DOCUMENT",
    "release_document": "SPOTCR_RELEASE_DOCUMENT",
    "status_document": "SPOTCR_STATUS_DOCUMENT",
}


@dataclass(frozen=True)
class Settings:
    jobs_table: str
    idempotency_table: str
    recovery_state_machine_arn: str
    event_bus_name: str
    failure_topic_arn: str
    checkpoint_bucket: str
    launch_template_id: str
    checkpoint_document: str
    restore_document: str
    release_document: str
    status_document: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        environ = os.environ if environ is None else environ
        missing = [ENV[f.name] for f in fields(cls) if ENV[f.name] not in environ]
        if missing:
            raise RuntimeError(f"missing settings: {', '.join(missing)}")
        return cls(**{f.name: environ[ENV[f.name]] for f in fields(cls)})
