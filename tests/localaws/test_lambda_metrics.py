"""The local Lambda runs concurrent invocations as threads of one process; each must publish only its own metrics,
as it would from an execution environment of its own."""

from __future__ import annotations

import json
import threading

import pytest
from spotcr_functions.observability import metrics

import rehearsal.localaws.awslambda  # noqa: F401  (gives each invocation its own metric set)


def test_an_invocation_flushing_its_metrics_leaves_a_concurrent_invocations_metrics_to_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    added, flushed = threading.Event(), threading.Event()

    def slow_invocation() -> None:
        metrics.add_metric(name="CheckpointSeconds", unit="Seconds", value=1.5)
        added.set()
        flushed.wait(10)
        metrics.flush_metrics(raise_on_empty_metrics=True)  # it still holds its metric: no "at least one metric"

    slow = threading.Thread(target=slow_invocation)
    slow.start()
    added.wait(10)
    metrics.add_metric(name="RestoreSeconds", unit="Seconds", value=2.0)
    metrics.flush_metrics(raise_on_empty_metrics=True)
    flushed.set()
    slow.join(10)

    published = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"_aws"')]
    names = [[m["Name"] for m in doc["_aws"]["CloudWatchMetrics"][0]["Metrics"]] for doc in published]
    assert names == [["RestoreSeconds"], ["CheckpointSeconds"]]
    assert all(doc["service"] == "spotcr" for doc in published)
