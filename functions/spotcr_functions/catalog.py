"""The one list of spotcr's Lambda functions: what triggers each and what each may call.

infra/ builds functions, rules and least-privilege grants from it; the local rehearsal routes
events with the same patterns. Add a function here and both follow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spotcr_contracts import events, tags

# What a function may call; infra/ turns each into the narrowest IAM grant it can.
JOBS_READ = "jobs:read"
JOBS_WRITE = "jobs:write"
IDEMPOTENCY = "idempotency"
SEND_COMMAND = "ssm:send-command"  # only spotcr's documents, only to instances tagged spotcr:job
COMMAND_RESULTS = "ssm:command-results"
EC2_DESCRIBE = "ec2:describe"
EC2_TAG = "ec2:tag"  # spotcr:error on job instances
EC2_LAUNCH = "ec2:launch"  # RunInstances from the launch template, PassRole for the job profile
EC2_VOLUMES = "ec2:volumes"  # attach, detach, snapshot, create volume
START_RECOVERY = "states:start-recovery"
TASK_CALLBACK = "states:callback"
PUBLISH_FAILURE = "sns:publish"
READ_JOB_SPECS = "s3:read-job-specs"

SCHEDULE_EVERY_MINUTES = 1


@dataclass(frozen=True)
class Rule:
    """An EventBridge rule: on the default bus unless `agent_bus`, or a schedule."""

    name: str
    pattern: Mapping[str, Any] | None = None
    schedule_minutes: int | None = None
    agent_bus: bool = False


@dataclass(frozen=True)
class Function:
    name: str
    handler: str  # module path under functions/, e.g. "spotcr_functions.handlers.interruption.handler"
    description: str
    capabilities: tuple[str, ...]
    rules: tuple[Rule, ...] = ()
    workflow_step: bool = False  # invoked by the recovery state machine
    timeout_s: int = 30
    memory_mb: int = 256
    extra: Mapping[str, str] = field(default_factory=dict)


def _ec2(detail_type: str, detail: Mapping[str, Any] | None = None) -> dict[str, Any]:
    pattern: dict[str, Any] = {"source": ["aws.ec2"], "detail-type": [detail_type]}
    if detail:
        pattern["detail"] = dict(detail)
    return pattern


INTERRUPTION_WARNING = "EC2 Spot Instance Interruption Warning"
REBALANCE_RECOMMENDATION = "EC2 Instance Rebalance Recommendation"
STATE_CHANGE = "EC2 Instance State-change Notification"
TAG_CHANGE = "Tag Change on Resource"

FUNCTIONS: tuple[Function, ...] = (
    Function(
        name="interruption",
        handler="spotcr_functions.handlers.interruption.handler",
        description="Spot interruption warning: fence the generation, order the final dump, start recovery.",
        capabilities=(JOBS_READ, JOBS_WRITE, IDEMPOTENCY, SEND_COMMAND, START_RECOVERY),
        rules=(Rule("spot-interruption-warning", _ec2(INTERRUPTION_WARNING)),),
    ),
    Function(
        name="rebalance",
        handler="spotcr_functions.handlers.rebalance.handler",
        description="Rebalance recommendation: take a periodic checkpoint now.",
        capabilities=(JOBS_READ, JOBS_WRITE, IDEMPOTENCY, SEND_COMMAND),
        rules=(Rule("rebalance-recommendation", _ec2(REBALANCE_RECOMMENDATION)),),
    ),
    Function(
        name="state-change",
        handler="spotcr_functions.handlers.state_change.handler",
        description="Instance state changes: register tagged jobs on running, recover on a missed warning.",
        capabilities=(
            JOBS_READ,
            JOBS_WRITE,
            IDEMPOTENCY,
            EC2_DESCRIBE,
            EC2_TAG,
            START_RECOVERY,
            READ_JOB_SPECS,
        ),
        rules=(
            Rule(
                "instance-state-change",
                _ec2(STATE_CHANGE, {"state": ["running", "stopping", "stopped", "shutting-down", "terminated"]}),
            ),
        ),
    ),
    Function(
        name="tag-change",
        handler="spotcr_functions.handlers.tag_change.handler",
        description="spotcr:job added to a running instance: register the job.",
        capabilities=(JOBS_READ, JOBS_WRITE, IDEMPOTENCY, EC2_DESCRIBE, EC2_TAG, READ_JOB_SPECS),
        rules=(
            Rule(
                "job-tag-added",
                {
                    "source": ["aws.tag"],
                    "detail-type": [TAG_CHANGE],
                    "detail": {
                        "service": ["ec2"],
                        "resource-type": ["instance"],
                        "changed-tag-keys": [tags.JOB],
                    },
                },
            ),
        ),
    ),
    Function(
        name="scheduler",
        handler="spotcr_functions.handlers.scheduler.handler",
        description="Every minute: a periodic checkpoint for each running job whose interval is due.",
        capabilities=(JOBS_READ, JOBS_WRITE, SEND_COMMAND),
        rules=(Rule("periodic-checkpoints", schedule_minutes=SCHEDULE_EVERY_MINUTES),),
        timeout_s=60,
    ),
    Function(
        name="agent-events",
        handler="spotcr_functions.handlers.agent_events.handler",
        description="Agent lifecycle events: update the job registry and resume waiting workflows.",
        capabilities=(JOBS_READ, JOBS_WRITE, IDEMPOTENCY, TASK_CALLBACK),
        rules=(Rule("agent-events", {"source": [events.SOURCE]}, agent_bus=True),),
    ),
)


def by_name(name: str) -> Function:
    for function in FUNCTIONS:
        if function.name == name:
            return function
    raise KeyError(f"no function named {name!r} in the catalog")
