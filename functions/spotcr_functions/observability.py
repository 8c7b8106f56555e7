"""Powertools Logger, Tracer and Metrics shared by every handler (one service, one metric namespace)."""

from __future__ import annotations

from aws_lambda_powertools import Logger, Metrics, Tracer

SERVICE = "spotcr"
NAMESPACE = "spotcr"

logger = Logger(service=SERVICE)
tracer = Tracer(service=SERVICE)
metrics = Metrics(namespace=NAMESPACE, service=SERVICE)


def emit_metric(name: str, unit: str, value: float) -> None:
    metrics.add_metric(name=name, unit=unit, value=value)
