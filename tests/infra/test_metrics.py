"""Every metric is named once (spotcr_functions.observability.Metric): the functions emit each, and every alarm and
graph on spotcr's namespace watches one that a function emits, so no alarm waits for a metric that never comes."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spotcr_functions.observability import Metric

from infra.control_plane import METRICS_NAMESPACE
from tests.infra.conftest import Synth

FUNCTIONS = Path(__file__).resolve().parents[2] / "functions" / "spotcr_functions"


def _emitted() -> dict[str, ast.expr]:
    """What each metric call in the functions names, by its first argument (`deps.metric(...)`, `emit_metric(...)`),
    evaluated in its module: {name: the argument as written}."""
    emitted: dict[str, ast.expr] = {}
    for path in sorted(FUNCTIONS.rglob("*.py")):
        module = importlib.import_module(".".join(path.relative_to(FUNCTIONS.parent).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in ("metric", "emit_metric") and not (
                called == "emit_metric" and path.name == "observability.py"
            ):
                emitted[str(eval(ast.unparse(node.args[0]), vars(module)))] = node.args[0]
    return emitted


def _watched(template: Mapping[str, Any]) -> set[str]:
    """The metric names of spotcr's namespace that the stack's alarms and dashboard watch."""
    alarms = {
        resource["Properties"]["MetricName"]
        for resource in template["Resources"].values()
        if resource["Type"] == "AWS::CloudWatch::Alarm" and resource["Properties"].get("Namespace") == METRICS_NAMESPACE
    }
    body = str(
        [
            r["Properties"]["DashboardBody"]
            for r in template["Resources"].values()
            if r["Type"] == "AWS::CloudWatch::Dashboard"
        ]
    )
    graphed = {metric.value for metric in Metric if f'"{METRICS_NAMESPACE}","{metric.value}"' in body}
    return alarms | graphed


def test_every_alarm_watches_a_metric_that_a_function_emits(default_synth: Synth) -> None:
    watched = _watched(default_synth.template.to_json())
    assert "CheckpointsOverdue" in watched
    assert watched - set(_emitted()) == set()


def test_every_metric_is_emitted_and_named_from_the_one_list() -> None:
    emitted = _emitted()
    assert set(emitted) == {metric.value for metric in Metric}
    # Named as Metric.X, never retyped as a string at the call
    assert all(ast.unparse(argument).startswith("Metric.") for argument in emitted.values()), emitted
