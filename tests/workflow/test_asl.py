"""The ASL file and the catalog agree: what infra/ substitutes is exactly what the state machine uses."""

from __future__ import annotations

import json
import re

from spotcr_functions import catalog

from rehearsal.controlplane import ASL

KINDS = ("function:", "table:", "topic:", "document:", "launch-template", "bus", "bucket")


def test_every_substitution_is_declared_and_resolvable() -> None:
    text = ASL.read_text()
    assert set(re.findall(r"\$\{(\w+)\}", text)) == set(catalog.WORKFLOW_SUBSTITUTIONS)
    steps = {f.name for f in catalog.FUNCTIONS if f.workflow_step}
    for kind in catalog.WORKFLOW_SUBSTITUTIONS.values():
        assert kind.startswith(KINDS), kind
        if kind.startswith("function:"):
            assert kind.removeprefix("function:") in steps
    assert {f"function:{name}" for name in steps} <= set(catalog.WORKFLOW_SUBSTITUTIONS.values())


def test_standard_workflow_with_a_timeout_and_known_capabilities() -> None:
    definition = json.loads(ASL.read_text())
    assert 0 < definition["TimeoutSeconds"] <= 24 * 3600
    vocabulary = {value for name, value in vars(catalog).items() if name.isupper() and isinstance(value, str)}
    assert set(catalog.WORKFLOW_CAPABILITIES) <= vocabulary
    for function in catalog.FUNCTIONS:
        assert set(function.capabilities) <= vocabulary, function.name


def _states() -> dict[str, dict]:
    return dict(json.loads(ASL.read_text())["States"])


def test_retries_name_errors_the_integration_raises() -> None:
    # The optimized SNS integration raises SNS.<exception>; the AWS SDK integration for SSM raises Ssm.<exception>.
    prefixes = {"arn:aws:states:::sns:publish": "SNS.", "arn:aws:states:::aws-sdk:ssm:": "Ssm."}
    checked = 0
    for name, state in _states().items():
        for resource, prefix in prefixes.items():
            if str(state.get("Resource", "")).startswith(resource):
                for retry in state.get("Retry", []):
                    assert all(e.startswith(prefix) for e in retry["ErrorEquals"]), name
                    checked += 1
    assert checked >= 3


def _tasks(states: dict[str, dict]) -> dict[str, dict]:
    """Every Task state, those inside Parallel branches too."""
    tasks = {}
    for name, state in states.items():
        if state["Type"] == "Task":
            tasks[name] = state
        for branch in state.get("Branches", []):
            tasks.update(_tasks(branch["States"]))
    return tasks


def _throttle_errors(resource: str) -> set[str]:
    """The errors a Task's integration raises when its service throttles it (a Lambda step's own `Throttled`:
    a throttle that outlasted the function's SDK retries, spotcr_functions.cloud.Throttled)."""
    if resource.startswith("arn:aws:states:::aws-sdk:ssm:"):
        return {"Ssm.ThrottlingException"}
    if resource.startswith("arn:aws:states:::sns:"):
        return {"SNS.AmazonSNSException"}  # every SNS service exception, its throttle too
    return {"Lambda.TooManyRequestsException", "Throttled"}


def test_every_task_retries_its_services_throttles_with_jittered_backoff() -> None:
    tasks = _tasks(_states())
    assert len(tasks) >= 10
    for name, state in tasks.items():
        wanted = _throttle_errors(str(state["Resource"]))
        retries = [r for r in state.get("Retry", []) if wanted <= set(r["ErrorEquals"])]
        assert retries, f"{name} does not retry {sorted(wanted)}"
        [retry] = retries
        assert retry["JitterStrategy"] == "FULL" and retry["BackoffRate"] >= 2 and retry["MaxAttempts"] >= 5, name


def test_marking_the_job_failed_has_a_catch_that_ends_the_execution_failed() -> None:
    states = _states()
    [catch] = states["MarkFailed"]["Catch"]
    assert catch["ErrorEquals"] == ["States.ALL"]
    assert states[catch["Next"]]["Type"] == "Fail"


def test_only_a_reported_restore_failure_tries_the_previous_checkpoint() -> None:
    # After a timeout the first restore may still run on the backup: a second one would race it.
    catches = {c["Next"]: c["ErrorEquals"] for c in _states()["Restore"]["Catch"]}
    assert catches["RestorePrevious"] == ["RestoreFailed"]
    assert catches["MarkFailed"] == ["States.ALL"]
