"""The stack's AWS FIS experiment templates for `spotcr interrupt`: a real spot interruption of one job's instance.

Pure data (no CDK import), so the rehearsal's local cloud creates the very same templates. Each targets the running
spot instances tagged spotcr:interrupt=requested, which `spotcr interrupt` sets on the job's instance alone and
removes once the experiment has resolved its targets.
"""

from __future__ import annotations

from typing import Any

from spotcr_contracts import tags

ACTION_ID = "aws:ec2:send-spot-instance-interruptions"
TARGET = "SpotInstances"
# FIS sends the two-minute interruption notice durationBeforeInterruption before the interruption; a duration above
# two minutes sends the rebalance recommendation at the start of the action, that much earlier.
INTERRUPT = "interrupt"
REBALANCE_FIRST = "rebalance-first"
DURATIONS = {INTERRUPT: "PT2M", REBALANCE_FIRST: "PT4M"}
OUTPUTS = {INTERRUPT: "InterruptExperimentTemplate", REBALANCE_FIRST: "RebalanceInterruptExperimentTemplate"}


def template(kind: str, role_arn: str) -> dict[str, Any]:
    """CreateExperimentTemplate's arguments (also the CloudFormation properties, in the same camelCase)."""
    return {
        "description": f"spotcr interrupt{' --rebalance-first' if kind == REBALANCE_FIRST else ''}: the job's instance",
        "roleArn": role_arn,
        "stopConditions": [{"source": "none"}],
        "targets": {
            TARGET: {
                "resourceType": "aws:ec2:spot-instance",
                "resourceTags": {tags.INTERRUPT: tags.INTERRUPT_REQUESTED},
                "filters": [{"path": "State.Name", "values": ["running"]}],
                "selectionMode": "ALL",
            }
        },
        "actions": {
            "interrupt": {
                "actionId": ACTION_ID,
                "parameters": {"durationBeforeInterruption": DURATIONS[kind]},
                "targets": {TARGET: TARGET},
            }
        },
        "tags": {"Name": f"spotcr-{kind}"},
    }


def duration_s(value: str) -> float:
    """ISO 8601 PT<n>M / PT<n>S, as FIS writes durationBeforeInterruption."""
    text = value.upper().removeprefix("PT")
    if text.endswith("M"):
        return float(text[:-1]) * 60
    if text.endswith("S"):
        return float(text[:-1])
    raise ValueError(f"durationBeforeInterruption {value!r} is not PT<n>M or PT<n>S")
