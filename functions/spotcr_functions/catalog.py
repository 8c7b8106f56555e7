"""The one list of spotcr's Lambda functions: what triggers each and what each may call.

infra/ builds functions, rules and least-privilege grants from it; the local rehearsal routes
events with the same patterns. Add a function here and both follow.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spotcr_contracts import events, tags

from spotcr_functions.cloud import VOLUME_WAIT_SECONDS

# What a function may call; infra/ turns each into the narrowest IAM grant it can.
JOBS_READ = "jobs:read"
JOBS_WRITE = "jobs:write"
IDEMPOTENCY = "idempotency"
SEND_COMMAND = "ssm:send-command"  # only spotcr's documents, only to instances tagged spotcr:job
COMMAND_RESULTS = "ssm:command-results"
EC2_DESCRIBE = "ec2:describe"
EC2_TAG = "ec2:tag"  # spotcr:run and spotcr:error on job instances (registering)
EC2_LAUNCH = "ec2:launch"  # RunInstances from the launch template, PassRole for the job profile
EC2_TERMINATE = "ec2:terminate"  # terminate job instances of the launch template, cancel their spot requests
EC2_VOLUMES = "ec2:volumes"  # attach, detach, snapshot, create and delete job volumes and snapshots
EC2_ADDRESSES = "ec2:addresses"  # move a node's private address to its backup (a job over several VMs)
START_RECOVERY = "states:start-recovery"
TASK_CALLBACK = "states:callback"
PUBLISH_FAILURE = "sns:publish"
STORE_CREDENTIALS = "sts:store-credentials"  # assume the store role for one job's prefix (session policy and tag)
EFS_ACCESS_POINTS = "efs:access-points"  # create a job's EFS access point at registration (and drop a duplicate)
EFS_ACCESS_POINT_DELETE = "efs:delete-access-point"  # delete an ended job's EFS access point

SCHEDULE_EVERY_MINUTES = 1


# In a rule pattern, stands for the ARN of the stack's own recovery state machine; pattern_for() puts it in.
RECOVERY_STATE_MACHINE = "${RecoveryStateMachineArn}"


@dataclass(frozen=True)
class Rule:
    """An EventBridge rule: on the default bus unless `agent_bus`, or a schedule."""

    name: str
    pattern: Mapping[str, Any] | None = None
    schedule_minutes: int | None = None
    agent_bus: bool = False

    def pattern_for(self, recovery_state_machine_arn: str) -> dict[str, Any] | None:
        """The pattern as deployed: RECOVERY_STATE_MACHINE replaced by the stack's state machine ARN."""
        if self.pattern is None:
            return None
        text = json.dumps(self.pattern).replace(RECOVERY_STATE_MACHINE, recovery_state_machine_arn)
        return dict(json.loads(text))


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
    reserved_concurrency: bool = False  # the stack reserves some (a setting): a burst elsewhere cannot starve it
    function_url: bool = False  # called by job VMs at its function URL (AuthType AWS_IAM), not by rules


def _ec2(detail_type: str, detail: Mapping[str, Any] | None = None) -> dict[str, Any]:
    pattern: dict[str, Any] = {"source": ["aws.ec2"], "detail-type": [detail_type]}
    if detail:
        pattern["detail"] = dict(detail)
    return pattern


INTERRUPTION_WARNING = "EC2 Spot Instance Interruption Warning"
CAPACITY_RESERVATION_WARNING = "EC2 Capacity Reservation Instance Interruption Warning"
REBALANCE_RECOMMENDATION = "EC2 Instance Rebalance Recommendation"
STATE_CHANGE = "EC2 Instance State-change Notification"
TAG_CHANGE = "Tag Change on Resource"
EXECUTION_STATUS_CHANGE = "Step Functions Execution Status Change"
COMMAND_INVOCATION_STATUS_CHANGE = "EC2 Command Invocation Status-change Notification"
# An invocation's final statuses as the status-change event names them (GetCommandInvocation says the same).
COMMAND_ENDED = ("Success", "Failed", "Cancelled", "TimedOut", "Undeliverable", "Terminated")

# Registering a job (or failing a hand-over) may wait for an EBS volume (cloud.VOLUME_WAIT_SECONDS): outlast it.
INTERRUPTION_TIMEOUT_S = 100
REGISTERING_TIMEOUT_S = VOLUME_WAIT_SECONDS + 30
# Final states whose execution may have left the job RECOVERING (no Catch ran, or the Catch itself failed).
ENDED_STATUSES = ("FAILED", "TIMED_OUT", "ABORTED")

# What failing a recovery (recovery.fail) calls: the record, the backup and the hand-over's volume, the access
# point; for a job over several VMs its other nodes are marked, and terminated if spotcr launched them (jobs.retire).
FAILING_A_RECOVERY = (
    JOBS_READ,
    JOBS_WRITE,
    EC2_DESCRIBE,
    EC2_TAG,
    EC2_TERMINATE,
    EC2_VOLUMES,
    EFS_ACCESS_POINT_DELETE,
)

FUNCTIONS: tuple[Function, ...] = (
    Function(
        name="interruption",
        handler="spotcr_functions.handlers.interruption.handler",
        description="Spot or capacity-reservation interruption warning: fence, order the final dump, start recovery.",
        # A node of a job over several VMs warned while another node recovers fails the job
        # (recovery._second_node_lost): its nodes are marked, terminated if spotcr launched them, the access point
        # deleted, the failure notified.
        capabilities=(
            JOBS_READ,
            JOBS_WRITE,
            IDEMPOTENCY,
            SEND_COMMAND,
            START_RECOVERY,
            EC2_DESCRIBE,
            TASK_CALLBACK,
            EC2_TAG,
            EC2_TERMINATE,
            PUBLISH_FAILURE,
            EFS_ACCESS_POINT_DELETE,
        ),
        rules=(
            Rule("spot-interruption-warning", _ec2(INTERRUPTION_WARNING)),
            Rule("capacity-reservation-interruption-warning", _ec2(CAPACITY_RESERVATION_WARNING)),
        ),
        timeout_s=INTERRUPTION_TIMEOUT_S,
        reserved_concurrency=True,
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
        description="Instance state changes: register jobs, recover on a missed warning, tidy finished jobs.",
        capabilities=(
            JOBS_READ,
            JOBS_WRITE,
            IDEMPOTENCY,
            EC2_DESCRIBE,
            EC2_TAG,
            EC2_TERMINATE,
            EC2_VOLUMES,
            START_RECOVERY,
            SEND_COMMAND,
            TASK_CALLBACK,
            EFS_ACCESS_POINTS,
            PUBLISH_FAILURE,
        ),
        rules=(
            Rule(
                "instance-state-change",
                _ec2(STATE_CHANGE, {"state": ["running", "stopping", "stopped", "shutting-down", "terminated"]}),
            ),
        ),
        timeout_s=REGISTERING_TIMEOUT_S,
    ),
    Function(
        name="tag-change",
        handler="spotcr_functions.handlers.tag_change.handler",
        description="spotcr:job added to a running instance: register the job; spotcr:mode: confirm the backup.",
        capabilities=(JOBS_READ, JOBS_WRITE, EC2_DESCRIBE, EC2_TAG, EC2_VOLUMES, EFS_ACCESS_POINTS),
        rules=(
            Rule(
                "job-tag-added",
                {
                    "source": ["aws.tag"],
                    "detail-type": [TAG_CHANGE],
                    "detail": {
                        "service": ["ec2"],
                        "resource-type": ["instance"],
                        "changed-tag-keys": [tags.JOB, tags.MODE],
                    },
                },
            ),
        ),
        timeout_s=REGISTERING_TIMEOUT_S,
    ),
    Function(
        name="scheduler",
        handler="spotcr_functions.handlers.scheduler.handler",
        description="Every minute: a periodic checkpoint for each running job whose interval is due; a job PENDING "
        "past pending_timeout_minutes fails (its instance marked, terminated if spotcr launched it).",
        capabilities=(
            JOBS_READ,
            JOBS_WRITE,
            SEND_COMMAND,
            EC2_DESCRIBE,
            EC2_TAG,
            EC2_TERMINATE,
            PUBLISH_FAILURE,
            EFS_ACCESS_POINT_DELETE,
        ),
        rules=(Rule("periodic-checkpoints", schedule_minutes=SCHEDULE_EVERY_MINUTES),),
        timeout_s=60,
    ),
    Function(
        name="agent-events",
        handler="spotcr_functions.handlers.agent_events.handler",
        description="Agent lifecycle events: update the job registry and resume waiting workflows.",
        # Registering a job whose JobStarted came first needs what registration needs; a JobExited only sends the
        # status command to the instance it names (the job ends from its result: command-result).
        capabilities=(
            JOBS_READ,
            JOBS_WRITE,
            IDEMPOTENCY,
            TASK_CALLBACK,
            EC2_DESCRIBE,
            EC2_TAG,
            EC2_VOLUMES,
            EFS_ACCESS_POINTS,
            SEND_COMMAND,
        ),
        rules=(Rule("agent-events", {"source": [events.SOURCE]}, agent_bus=True),),
        timeout_s=REGISTERING_TIMEOUT_S,
    ),
    Function(
        name="plan-recovery",
        handler="spotcr_functions.handlers.workflow.plan",
        description="Recovery step: backup candidates (spot per stack subnet, fallback types, on-demand last).",
        capabilities=(JOBS_READ, EC2_DESCRIBE),
        workflow_step=True,
    ),
    Function(
        name="launch-backup",
        handler="spotcr_functions.handlers.workflow.launch_backup",
        description="Recovery step: launch one backup candidate; CapacityUnavailable moves down the list.",
        # A backup launched for a generation that moved on meanwhile is terminated at once. A ready report that came
        # before the backup was recorded is handed to the readiness wait from here (rule 9).
        capabilities=(JOBS_READ, JOBS_WRITE, EC2_LAUNCH, EC2_TERMINATE, TASK_CALLBACK),
        workflow_step=True,
    ),
    Function(
        name="await-agent-event",
        handler="spotcr_functions.handlers.workflow.await_agent_event",
        description="Recovery step: store the task token that an agent event (final dump, backup ready) resumes.",
        # The final-dump wait sends the warning's final-dump command where a throttle deferred it.
        capabilities=(JOBS_READ, JOBS_WRITE, TASK_CALLBACK, SEND_COMMAND),
        workflow_step=True,
    ),
    Function(
        name="move-volume",
        handler="spotcr_functions.handlers.workflow.move_volume",
        description="Recovery step: one move of the job's EBS volume to the backup (detach, snapshot, create, attach).",
        # Each step reads the volume's and the snapshot's state first (DescribeVolumes, DescribeSnapshots).
        capabilities=(JOBS_READ, JOBS_WRITE, EC2_VOLUMES, EC2_DESCRIBE),
        workflow_step=True,
    ),
    Function(
        name="restore-job",
        handler="spotcr_functions.handlers.workflow.restore",
        description="Recovery step: retire the interrupted instance, order the restore, wait for SSM's result of it.",
        # A final dump whose answer never arrived is read from SSM before the restore (checkpoints.settle_final_dump):
        # one that found the job ended ends it there, closing its EFS access point as command-result would.
        # A job over several VMs: each recovered node's address (and EBS volume) moves to its backup first.
        capabilities=(
            JOBS_READ,
            JOBS_WRITE,
            TASK_CALLBACK,
            SEND_COMMAND,
            EC2_DESCRIBE,
            EC2_TERMINATE,
            EC2_ADDRESSES,
            EC2_VOLUMES,
            COMMAND_RESULTS,
            EFS_ACCESS_POINT_DELETE,
        ),
        workflow_step=True,
    ),
    Function(
        name="command-result",
        handler="spotcr_functions.handlers.command_status.handler",
        description="A checkpoint, restore or status command ended (SSM's event): read its result from SSM, record "
        "the checkpoint, resume the waiting step or end the job that exited.",
        # A job that ends stops its recovery's waits, closes its EFS access point and releases its backup.
        capabilities=(
            JOBS_READ,
            JOBS_WRITE,
            EC2_DESCRIBE,
            COMMAND_RESULTS,
            TASK_CALLBACK,
            EC2_TERMINATE,
            EFS_ACCESS_POINT_DELETE,
        ),
        rules=(
            Rule(
                "command-invocation-ended",
                {
                    "source": ["aws.ssm"],
                    "detail-type": [COMMAND_INVOCATION_STATUS_CHANGE],
                    "detail": {"status": list(COMMAND_ENDED)},
                },
            ),
        ),
    ),
    Function(
        name="check-restore",
        handler="spotcr_functions.handlers.workflow.check_restore",
        description="Recovery step: the restore wait timed out; ask SSM whether its command ended or still runs.",
        capabilities=(JOBS_READ, JOBS_WRITE, EC2_DESCRIBE, COMMAND_RESULTS, TASK_CALLBACK),
        workflow_step=True,
    ),
    Function(
        name="finish-recovery",
        handler="spotcr_functions.handlers.workflow.finish",
        description="Recovery step: the backup is the job's current instance; a volume a move replaced is deleted.",
        capabilities=(JOBS_READ, JOBS_WRITE, EC2_DESCRIBE, EC2_VOLUMES, PUBLISH_FAILURE),
        workflow_step=True,
    ),
    Function(
        name="recovery-ended",
        handler="spotcr_functions.handlers.recovery_ended.handler",
        description="A recovery that failed past its Catch, timed out or was aborted: mark the job FAILED, notify.",
        capabilities=(*FAILING_A_RECOVERY, PUBLISH_FAILURE),
        timeout_s=REGISTERING_TIMEOUT_S,  # detaching a hand-over volume waits for it (cloud.VOLUME_WAIT_SECONDS)
        rules=(
            Rule(
                "recovery-ended",
                {
                    "source": ["aws.states"],
                    "detail-type": [EXECUTION_STATUS_CHANGE],
                    "detail": {"status": list(ENDED_STATUSES), "stateMachineArn": [RECOVERY_STATE_MACHINE]},
                },
            ),
        ),
    ),
    Function(
        name="fail-recovery",
        handler="spotcr_functions.handlers.workflow.fail",
        description="Recovery step: mark the job FAILED, terminate its backup, delete what the hand-over made.",
        capabilities=FAILING_A_RECOVERY,
        workflow_step=True,
        timeout_s=REGISTERING_TIMEOUT_S,  # detaching a hand-over volume waits for it (cloud.VOLUME_WAIT_SECONDS)
    ),
    Function(
        name="store-credentials",
        handler="spotcr_functions.handlers.store_credentials.handler",
        description="Function URL for job VMs: S3 credentials for the caller's own job prefix only.",
        capabilities=(JOBS_READ, STORE_CREDENTIALS),
        function_url=True,
    ),
)

# Every ${Name} in statemachines/recovery.asl.json and what infra/ substitutes for it.
WORKFLOW_SUBSTITUTIONS: dict[str, str] = {
    "PlanRecoveryFunctionArn": "function:plan-recovery",
    "LaunchBackupFunctionArn": "function:launch-backup",
    "AwaitAgentEventFunctionArn": "function:await-agent-event",
    "MoveVolumeFunctionArn": "function:move-volume",
    "RestoreJobFunctionArn": "function:restore-job",
    "CheckRestoreFunctionArn": "function:check-restore",
    "FinishRecoveryFunctionArn": "function:finish-recovery",
    "FailRecoveryFunctionArn": "function:fail-recovery",
    "ReleaseDocumentName": "document:release",
    "FailureTopicArn": "topic:failure",
}
# The state machine's own SDK calls (besides invoking the functions above): release command and its result, SNS.
WORKFLOW_CAPABILITIES: tuple[str, ...] = (SEND_COMMAND, COMMAND_RESULTS, PUBLISH_FAILURE)


def by_name(name: str) -> Function:
    for function in FUNCTIONS:
        if function.name == name:
            return function
    raise KeyError(f"no function named {name!r} in the catalog")
