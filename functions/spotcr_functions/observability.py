"""Powertools Logger, Tracer and Metrics shared by every handler (one service, one metric namespace)."""

from __future__ import annotations

from enum import StrEnum

from aws_lambda_powertools import Logger, Metrics, Tracer

SERVICE = "spotcr"
NAMESPACE = "spotcr"

logger = Logger(service=SERVICE)
tracer = Tracer(service=SERVICE)
metrics = Metrics(namespace=NAMESPACE, service=SERVICE)


class Metric(StrEnum):
    """Every metric the functions emit (EMF, with Powertools' `service` dimension): the one list that
    infra/monitoring.py graphs and alarms on (tests/infra/test_metrics.py checks that each is emitted)."""

    RECOVERIES_SUCCEEDED = "RecoveriesSucceeded"
    RECOVERIES_FAILED = "RecoveriesFailed"
    RECOVERY_SECONDS = "RecoverySeconds"
    LOST_WORK_SECONDS = "LostWorkSeconds"
    INTERRUPTION_TO_DUMP_SECONDS = "InterruptionToDumpCommandSeconds"
    RESTORE_SECONDS = "RestoreSeconds"
    CHECKPOINT_SECONDS = "CheckpointSeconds"
    FINAL_DUMP_SECONDS = "FinalDumpSeconds"
    FINAL_DUMP_BYTES = "FinalDumpBytes"
    PREDICTED_FINAL_DUMP_SECONDS = "PredictedFinalDumpSeconds"
    FINAL_DUMPS_AT_RISK = "FinalDumpsAtRisk"
    CHECKPOINTS_FAILED = "CheckpointsFailed"  # a dump SSM reports failed, periodic or final
    CHECKPOINTS_OVERDUE = "CheckpointsOverdue"  # a job due again while its previous periodic dump never reported


def emit_metric(name: str, unit: str, value: float) -> None:
    metrics.add_metric(name=name, unit=unit, value=value)
