"""One moto account holding spotcr's control plane, with the catalog's real handlers run in-process.

The local AWS of rehearsal/localaws with no VMs: the same stack, Lambda, SSM, fleet, Step Functions and IAM as
the rehearsal's LocalCloud. moto's Step Functions engine runs the real ASL; its Lambda invocations land in
`invoke_function`, EC2 events are routed to handlers by the catalog's own patterns, and the test plays the agent's
events (no VM runs one).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from unittest import mock

import boto3
from botocore.exceptions import ClientError
from moto.core.botocore_stubber import BotocoreStubber
from moto.events.models import EventPattern
from moto.ssm.models import Command as MotoCommand
from moto.ssm.models import ssm_backends
from spotcr_contracts import commands, events, results
from spotcr_contracts import tags as tag_names
from spotcr_functions import catalog
from spotcr_functions.config import ENV, Settings
from spotcr_functions.handlers import _edge
from spotcr_functions.models import JobRecord

from rehearsal.iam import enforce, principals
from rehearsal.localaws import (
    ACCOUNT,
    REGION,
    addresses,
    awslambda,
    dynamodb,
    ec2_tags,
    fleet,
    iam,
    ssm,
    stack,
    stepfunctions,
    wrap,
)
from rehearsal.localaws import throttle as rate_limits
from rehearsal.localaws.iam import STACK_CONTEXT
from rehearsal.polling import wait_for

ROOT = Path(__file__).resolve().parents[1]
EVENTS = ROOT / "tests" / "events"
ASL = stack.ASL_PATH
FUNCTION_PREFIX = "spotcr-"
MOTO_CONFIG: Any = {"stepfunctions": {"execute_state_machine": True}, "lambda": {"use_docker": False}}
# The stack's roles as named in this account (the store-credentials tests sign as sessions of the job role).
JOB_ROLE_NAME = "spotcr-JobRole-1A2B3C4D5E6F"
STORE_ROLE_NAME = "spotcr-StoreRole-0F1E2D3C4B5A"


FUNCTIONS = awslambda.Functions(FUNCTION_PREFIX)
invoke_function = FUNCTIONS.call
function_arn = FUNCTIONS.arn
function_key = enforce.function_key


class FairLock:
    """A re-entrant lock handed over in the order it was asked for. A plain RLock lets a newcomer take it ahead of
    threads that waited long: in a wave of hundreds of requests some waited past a minute while others went
    through, which AWS, serving unrelated calls side by side, never does."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._waiting: collections.deque[tuple[int, threading.Event]] = collections.deque()
        # (when the turn came, seconds waited for it) of each acquire while `waits` is a list: the wave's measure
        # of the local AWS's own queue (rehearsal/wave.py)
        self.waits: list[tuple[float, float]] | None = None

    def acquire(self, timeout: float = -1) -> bool:
        me = threading.get_ident()
        asked = time.monotonic()
        with self._mutex:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._waiting:
                self._owner, self._depth = me, 1
                self._note(asked)
                return True
            turn = (me, threading.Event())
            self._waiting.append(turn)
        if turn[1].wait(None if timeout < 0 else timeout):
            self._note(asked)
            return True
        with self._mutex:
            if self._owner == me:  # handed over just as the wait timed out
                return True
            self._waiting.remove(turn)
            return False

    def _note(self, asked: float) -> None:
        if self.waits is not None:
            now = time.monotonic()
            self.waits.append((now, now - asked))

    def release(self) -> None:
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairLock released by a thread that does not hold it")
            self._depth -= 1
            if self._depth:
                return
            if self._waiting:
                self._owner, event = self._waiting.popleft()
                self._depth = 1
                event.set()
            else:
                self._owner = None

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# In-process moto is not thread-safe, and the workflow engine runs in threads of its own: one request at a time.
# Re-entrant, since a request may call out (a Lambda invoke aside, which runs outside the lock) and nest another.
_MOTO = FairLock()
_LAMBDA_INVOKE = re.compile(r"^https://lambda\.[^/]+/[^/]+/functions/[^/]+/invocations")


def _serialized(process_request: Any) -> Any:
    def serialized(self: Any, request: Any) -> Any:
        if _LAMBDA_INVOKE.search(str(request.url)):
            # A Lambda function runs beside the others, as in AWS (each of its own requests is serialized): held
            # for its whole run, the lock would let a workflow's one task stop every other function's calls.
            return process_request(self, request)
        if not _MOTO.acquire(timeout=60):
            raise RuntimeError("a moto request waited 60 s for another one: a handler blocked inside a request?")
        try:
            return process_request(self, request)
        finally:
            _MOTO.release()

    return serialized


def _restore_runs(init: Any) -> Any:
    """A restore, checkpoint or final-dump command runs on its instance until the agent there answers (finish_restore,
    finish_checkpoint): SSM reports it InProgress (moto reports every command Success at once, with no output)."""

    def init_running(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self.document_name.endswith(("-restore", "-checkpoint", "-final-dump")):
            self.status = self.status_details = "InProgress"
            for invocation in self.invocations:
                invocation.update({"Status": "InProgress", "StatusDetails": "InProgress", "ResponseCode": -1})

    return init_running


def command_ended(instance_id: str, command_id: str, document_name: str, status: str) -> dict[str, Any]:
    """SSM's status-change event for one invocation, shaped as AWS's published sample (tests/events/ssm)."""
    event = load_event("ssm/command-invocation-status-change")
    event.pop("_source", None)
    event["id"] = str(uuid.uuid4())
    event["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    event["region"], event["account"] = REGION, ACCOUNT
    event["resources"] = [f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/{instance_id}"]
    event["detail"].update(
        {"command-id": command_id, "document-name": document_name, "instance-id": instance_id, "status": status}
    )
    return event


def _answer(command: Any, invocation: dict[str, Any], status: str, code: int, line: str) -> None:
    """The agent's command ends on its instance: SSM's status, its exit code, and its one result line on stdout;
    spotcr sends each command to one instance, so the command's own status (ListCommands) is its invocation's."""
    command.status = command.status_details = status
    invocation.update(
        {
            "Status": status,
            "StatusDetails": status,
            "ResponseCode": code,
            "StandardOutputContent": line + "\n",
            "StandardErrorContent": "",
        }
    )


def end_restore_command(answer: events.RestoreCompleted | events.RestoreFailed) -> tuple[str, dict[str, Any]]:
    """The backup's agent ends the newest restore command sent to its instance as the real agent does: one result
    line on stdout (spotcr_agent.cli._restore), exit 0 only when restored. Returns SSM's status-change event for it,
    not delivered."""
    backend = ssm_backends[ACCOUNT][REGION]
    restores = [c for c in backend._commands if str(c.document_name).endswith("-restore")]
    sent = [c for c in restores if answer.instance_id in c.instance_ids]
    command = sent[-1]
    parameters = {k: v[0] for k, v in command.parameters.items()}
    result = results.RestoreResult(
        ok=isinstance(answer, events.RestoreCompleted),
        job_id=parameters["JobId"],
        run_id=answer.run_id or parameters.get("RunId", ""),
        generation=answer.generation,
        attempt=answer.attempt or parameters.get("Attempt", ""),
    )
    if isinstance(answer, events.RestoreCompleted):
        restored = dataclasses.replace(
            result, checkpoint_id=answer.checkpoint_id, seconds=answer.seconds, pid=answer.pid, skipped=answer.skipped
        )
        line = restored.to_line()
        status, code = "Success", 0
    else:
        line = dataclasses.replace(result, error=f"{answer.checkpoint_id or 'newest'}: {answer.reason}").to_line()
        status, code = "Failed", 1
    for invocation in command.invocations:
        if invocation["InstanceId"] == answer.instance_id:
            _answer(command, invocation, status, code, line)
    return command.command_id, command_ended(answer.instance_id, command.command_id, str(command.document_name), status)


def finish_restore(answer: events.RestoreCompleted | events.RestoreFailed) -> list[tuple[str, Any]]:
    """The backup's restore ends: its command's result is in SSM, SSM's status-change event is delivered, and the
    agent's own event (telemetry) too."""
    _, ended = end_restore_command(answer)
    return route(ended) + route(agent_event(answer))


def end_checkpoint_command(
    report: events.CheckpointCompleted | events.CheckpointFailed,
) -> tuple[str, dict[str, Any]] | None:
    """The VM's agent ends the newest unanswered checkpoint command sent to its instance (of the report's kind if
    one is pending) as the real agent does: one result line on stdout (spotcr_agent.cli._checkpoint), exit 0 only
    when committed. Returns SSM's status-change event for it, not delivered; None when no command is pending there
    (a dump nobody ordered: nothing reports it through SSM)."""
    pending = _pending_checkpoint(report.instance_id)
    if not pending:
        return None
    of_kind = [(c, i) for c, i in pending if order_parameters(c, report.instance_id)["Kind"] == report.kind]
    command, invocation = (of_kind or pending)[-1]
    parameters = order_parameters(command, report.instance_id)
    result = results.CheckpointResult(  # the order it answers, as the real agent names it
        ok=isinstance(report, events.CheckpointCompleted),
        job_id=parameters["JobId"],
        run_id=report.run_id or parameters.get("RunId", ""),
        generation=int(parameters["Generation"]),
        kind=report.kind,
    )
    if isinstance(report, events.CheckpointCompleted):
        figures = {
            name: getattr(report, name)
            for name in (
                "checkpoint_id",
                "seconds",
                "frozen_seconds",
                "bytes_total",
                "bytes_uploaded",
                "memory_tracking",
                "predicted_final_seconds",
                "next_interval_s",
                "deadline_risk",
            )
        }
        line = dataclasses.replace(result, **figures, dump_generation=report.generation).to_line()
        status, code = "Success", 0
    else:
        line = dataclasses.replace(result, error=report.reason, job_stopped=report.job_stopped).to_line()
        status, code = "Failed", 1
    _answer(command, invocation, status, code, line)
    return command.command_id, command_ended(report.instance_id, command.command_id, str(command.document_name), status)


def end_dump_order_with_exit(exited: events.JobExited) -> tuple[str, dict[str, Any]]:
    """The agent finds the job ended when a dump order comes (a final dump ordered just after the job exited): it
    answers the newest unanswered checkpoint or final-dump command on its instance with the exit, its result stored
    or given up (spotcr_agent.cli._checkpoint). Returns SSM's status-change event for it, not delivered."""
    [*_, (command, invocation)] = _pending_checkpoint(exited.instance_id)
    parameters = order_parameters(command, exited.instance_id)
    line = results.CheckpointResult(
        ok=False,
        job_id=parameters["JobId"],
        run_id=exited.run_id or parameters.get("RunId", ""),
        generation=int(parameters["Generation"]),
        kind=parameters["Kind"],
        error=f"the job is not running: it exited with code {exited.exit_code}",
        exit_code=exited.exit_code,
        result=exited.result,
        result_error=_settled_error(exited),
        result_missing=exited.result_missing,
    ).to_line()
    _answer(command, invocation, "Failed", 1, line)
    document = str(command.document_name)
    return command.command_id, command_ended(exited.instance_id, command.command_id, document, "Failed")


def _settled_error(exited: events.JobExited) -> str:
    """The real agent reports an exit only once its result is stored or given up (Agent.watch_job): one is always
    set, so a test's exit with no result is one given up."""
    return exited.result_error or ("" if exited.result else "the test stored no result")


def order_parameters(command: Any, instance_id: str) -> dict[str, str]:
    """A checkpoint or final-dump command's order to one instance, as the checkpoint document's parameters (a
    final-dump command's own order for that instance: the agent takes that one, spotcr_agent.cli._own_order)."""
    parameters = {k: v[0] for k, v in command.parameters.items()}
    if not str(command.document_name).endswith("-final-dump"):
        return parameters
    [order] = [o for o in commands.parse_orders(parameters["Orders"]) if o.instance_id == instance_id]
    return _order_dict(order)


def _order_dict(order: commands.FinalDumpOrder) -> dict[str, str]:
    return {
        "JobId": order.job_id,
        "Generation": str(order.generation),
        "Kind": "final",
        "RunId": order.run_id,
        "Sequence": str(order.sequence),
    }


def _pending_checkpoint(instance_id: str, kind: str = "") -> list[tuple[Any, dict[str, Any]]]:
    """The checkpoint and final-dump commands (of that kind) still running on the instance, oldest first, with their
    invocation."""
    backend = ssm_backends[ACCOUNT][REGION]
    return [
        (command, invocation)
        for command in backend._commands
        if str(command.document_name).endswith(("-checkpoint", "-final-dump"))
        for invocation in command.invocations
        if invocation["InstanceId"] == instance_id and invocation["Status"] == "InProgress"
        if kind in ("", order_parameters(command, instance_id)["Kind"])
    ]


def finish_checkpoint(report: events.CheckpointCompleted | events.CheckpointFailed) -> list[tuple[str, Any]]:
    """The VM's dump ends: its command's result is in SSM, SSM's status-change event is delivered, and the agent's
    own event (telemetry) too. A periodic dump with no order pending on its instance was ordered earlier: the
    checkpoint command is sent first, as the scheduler sent it (tests of ordering order it first)."""
    if report.kind == "periodic" and not _pending_checkpoint(report.instance_id, "periodic"):
        parameters = {
            "JobId": [report.job_id],
            "Generation": [str(report.generation)],
            "Kind": ["periodic"],
            "RunId": [report.run_id or _run_tag(report.instance_id)],
        }
        boto3.client("ssm", region_name=REGION).send_command(
            InstanceIds=[report.instance_id], DocumentName="spotcr-checkpoint", Parameters=parameters
        )
    ended = end_checkpoint_command(report)
    return (route(ended[1]) if ended else []) + route(agent_event(report))


def end_status_command(exited: events.JobExited) -> list[tuple[str, dict[str, Any]]]:
    """The exited job's agent answers every status command sent to its instance and not yet answered, as the real
    agent does (spotcr_agent.cli: one JSON line of Agent.status, its exit code and stored result). Returns SSM's
    status-change event for each, not delivered."""
    backend = ssm_backends[ACCOUNT][REGION]
    statuses = [c for c in backend._commands if str(c.document_name).endswith("-status")]
    result_error = _settled_error(exited)
    line = results.StatusResult(
        job_id=exited.job_id,
        run_id=exited.run_id,
        instance_id=exited.instance_id,
        storage="efs",
        mode="run",
        generation=exited.generation,
        job_status="exited",
        job_pid=0,
        job_alive=False,
        exit_code=exited.exit_code,
        result=exited.result,
        result_error=result_error,
        result_missing=exited.result_missing,
        last_checkpoint=None,
        final_dumps={},
    ).to_line()
    ended = []
    for command in statuses:
        for invocation in command.invocations:
            if invocation["InstanceId"] != exited.instance_id or invocation.get("StandardOutputContent"):
                continue
            _answer(command, invocation, "Success", 0, line)
            event = command_ended(exited.instance_id, command.command_id, str(command.document_name), "Success")
            ended.append((command.command_id, event))
    return ended


def finish_exit(exited: events.JobExited) -> list[tuple[str, Any]]:
    """The job exits on its VM: the agent's JobExited (telemetry, which asks the instance through SSM), the status
    command answered by that instance's agent, and SSM's status-change event delivered. Returns what the
    status-change events did (the job's end), or what the agent's event did when it asked nothing."""
    asked = route(agent_event(exited))
    answered = [outcome for _, event in end_status_command(_with_run(exited)) for outcome in route(event)]
    return answered or asked


def answer_exit(exited: events.JobExited) -> list[dict[str, Any]]:
    """As finish_exit, but SSM's status-change events are returned undelivered (to deliver late, or twice)."""
    route(agent_event(exited))
    return [event for _, event in end_status_command(_with_run(exited))]


def _with_run(exited: events.JobExited) -> events.JobExited:
    """The exit with the run its instance is tagged with, as the real agent reports it (see agent_event)."""
    return exited if exited.run_id else dataclasses.replace(exited, run_id=_run_tag(exited.instance_id))


def load_event(name: str) -> dict[str, Any]:
    return json.loads((EVENTS / f"{name}.json").read_text())


def ec2_event(name: str, instance_id: str, **detail: Any) -> dict[str, Any]:
    """A sample EC2 event from tests/events for this instance, with a fresh id and the current time."""
    event = load_event(name)
    event["id"] = str(uuid.uuid4())
    event["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    event["resources"] = [f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/{instance_id}"]
    if "instance-id" in event["detail"]:
        event["detail"]["instance-id"] = instance_id
    event["detail"].update(detail)
    return event


def agent_event(event: events.AgentEvent) -> dict[str, Any]:
    """The event as the VM's agent puts it: with the run its instance is tagged with (spotcr:run), as a real agent
    learns it; an instance without that tag (refused, or made up by the test) sends none, unless the test set one."""
    if not event.run_id:
        event = dataclasses.replace(event, run_id=_run_tag(event.instance_id))
    if isinstance(event, (events.RestoreCompleted, events.RestoreFailed)) and not event.attempt:
        # The agent answers the restore command it ran: the newest one sent to its instance.
        event = dataclasses.replace(event, attempt=_last_restore_attempt(event.instance_id))
    entry = event.to_entry("spotcr-agent")
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": entry["DetailType"],
        "source": entry["Source"],
        "account": ACCOUNT,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "region": REGION,
        "resources": [],
        "detail": json.loads(entry["Detail"]),
    }


def _last_restore_attempt(instance_id: str) -> str:
    sent = boto3.client("ssm", region_name=REGION).list_commands(InstanceId=instance_id)["Commands"]
    restores = [c for c in sent if "Attempt" in c.get("Parameters", {})]  # in the order they were sent
    return str(restores[-1]["Parameters"]["Attempt"][0]) if restores else ""


def _run_tag(instance_id: str) -> str:
    try:
        reservations = boto3.client("ec2", region_name=REGION).describe_instances(InstanceIds=[instance_id])
    except ClientError:
        return ""
    found = [i for r in reservations["Reservations"] for i in r["Instances"]]
    tags = {t["Key"]: t["Value"] for i in found for t in i.get("Tags", [])}
    return tags.get(tag_names.RUN, "")


def targets(event: Mapping[str, Any]) -> list[str]:
    """The catalog functions EventBridge delivers the event to: those whose rule pattern matches it."""
    on_agent_bus = event.get("source") == events.SOURCE
    state_machine_arn = os.environ.get(ENV["recovery_state_machine_arn"], "")
    matched = []
    for function in catalog.FUNCTIONS:
        for rule in function.rules:
            pattern = rule.pattern_for(state_machine_arn)
            if pattern is None or rule.agent_bus != on_agent_bus:
                continue
            if EventPattern.load(json.dumps(pattern)).matches_event(dict(event)):  # type: ignore[arg-type]
                matched.append(function.name)
    return matched


def route(event: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Deliver an event to every function whose rule matches it, one after the other, and return what each did (an
    error raised): the test in EventBridge's and Lambda's place."""
    return [(name, FUNCTIONS.call(name, json.loads(json.dumps(event)))) for name in targets(event)]


def deliver(queue: awslambda.EventQueue, event: Mapping[str, Any]) -> None:
    """Deliver an event as EventBridge does: an asynchronous invocation of every function whose rule matches it,
    through Lambda's event queue (its retries: awslambda.EventQueue)."""
    for name in targets(event):
        queue.submit(name, json.loads(json.dumps(event)))


def event_queue(retries: awslambda.AsyncRetries | None = None) -> awslambda.EventQueue:
    """Lambda's event queue for the stack's functions (its retries as AWS's, unless given)."""
    return awslambda.EventQueue(FUNCTIONS.attempt, retries or awslambda.AsyncRetries())


class ControlPlane:
    """The deployed control plane, in moto (the local AWS with no VMs). Use it as a context manager inside
    mock_aws(config=MOTO_CONFIG): inside, IAM is enforced; leaving stops what runs and undoes every patch."""

    def __init__(self, final_dump_wait_s: int = 30, restore_wait_s: int = 30) -> None:
        self._patches = contextlib.ExitStack()
        try:
            self._deploy(final_dump_wait_s, restore_wait_s)
        except BaseException:
            self._patches.close()
            raise

    def __enter__(self) -> ControlPlane:
        self._patches.enter_context(enforce.enforced(self.enforcer))
        return self

    def __exit__(self, *exc: object) -> None:
        with self._patches:
            self.close()

    def refuse_launches(self, refusal: fleet.Refusal) -> list[tuple[str, str, str]]:
        """EC2 refuses the launches `refusal` names (rehearsal.localaws.fleet); returns every launch tried."""
        return fleet.refuse_launches(self._patches, refusal)

    def throttle(self, limits: rate_limits.Limits, **time: Any) -> rate_limits.Meter:
        """AWS's rate limits on every call until the plane closes (rehearsal.localaws.throttle; off unless asked):
        `time` may give the throttle's `clock` and `sleep`."""
        return rate_limits.install(self._patches, limits, **time)

    def _deploy(self, final_dump_wait_s: int, restore_wait_s: int) -> None:
        patches = self._patches
        wrap(patches, BotocoreStubber, "process_request", _serialized)
        wrap(patches, MotoCommand, "__init__", _restore_runs)
        FUNCTIONS.serve(patches)
        dynamodb.atomic_requests(patches)
        dynamodb.wire_form_values(patches)
        ssm.to_instance_ids_only(patches)
        stepfunctions.keep_failure_cause(patches)
        stepfunctions.lambda_errors_named(patches)
        stepfunctions.parse_once(patches)
        fleet.launch_template_tags(patches)
        fleet.idempotent_launches(patches)
        ec2_tags.own_tags(patches)
        addresses.reassigned_addresses(patches)
        _edge._deps.cache_clear()
        _edge._persistence.cache_clear()
        self.ec2 = boto3.client("ec2", region_name=REGION)
        self.ssm = boto3.client("ssm", region_name=REGION)
        self.sfn = boto3.client("stepfunctions", region_name=REGION)
        self.sns = boto3.client("sns", region_name=REGION)
        stack.create_registry(boto3.client("dynamodb", region_name=REGION), "spotcr-jobs", "spotcr-idempotency")
        self.topic_arn = self.sns.create_topic(Name="spotcr-failures")["TopicArn"]
        # What the failure topic sends, as an operator's subscribed queue receives it.
        self.sqs = boto3.client("sqs", region_name=REGION)
        self.inbox = self.sqs.create_queue(QueueName="spotcr-failures-inbox")["QueueUrl"]
        inbox_arn = self.sqs.get_queue_attributes(QueueUrl=self.inbox, AttributeNames=["QueueArn"])["Attributes"]
        self.sns.subscribe(TopicArn=self.topic_arn, Protocol="sqs", Endpoint=inbox_arn["QueueArn"])
        self.documents = stack.create_documents(self.ssm, FUNCTION_PREFIX, commands.COMMANDS.values())
        vpc_id = self.ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        self.subnets = {
            az: self.ec2.create_subnet(VpcId=vpc_id, CidrBlock=f"10.0.{16 * (i + 1)}.0/20", AvailabilityZone=az)[
                "Subnet"
            ]["SubnetId"]
            for i, az in enumerate((f"{REGION}a", f"{REGION}b"))
        }
        image_id = "ami-760aaa0f"  # one of moto's built-in Amazon Linux images (listing them all takes seconds)
        self.launch_template_id = self.ec2.create_launch_template(
            LaunchTemplateName="spotcr-job", LaunchTemplateData={"ImageId": image_id, "InstanceType": "m5.large"}
        )["LaunchTemplate"]["LaunchTemplateId"]
        self.image_id = image_id
        self.file_system_id = boto3.client("efs", region_name=REGION).create_file_system(CreationToken="spotcr")[
            "FileSystemId"
        ]
        # moto builds a REST service's request router on its first request: for Lambda's, seconds under a wave's
        # load, with every other request of the local AWS waiting behind it. AWS has no such pause: built here.
        boto3.client("lambda", region_name=REGION).list_functions()
        function_arns = {function.name: FUNCTIONS.arn(function.name) for function in catalog.FUNCTIONS}
        definition = stack.recovery_definition(function_arns, self.documents, self.topic_arn)
        self.state_machine_arn = self.sfn.create_state_machine(
            name="spotcr-recovery", definition=definition, roleArn=f"arn:aws:iam::{ACCOUNT}:role/spotcr-recovery"
        )["stateMachineArn"]
        # The stack's subnets: the two job subnets, not every subnet of the VPC (see test_placement).
        self.vpc_id = vpc_id
        settings = Settings(
            jobs_table=f"{FUNCTION_PREFIX}jobs",
            idempotency_table=f"{FUNCTION_PREFIX}idempotency",
            recovery_state_machine_arn=self.state_machine_arn,
            event_bus_name=f"{FUNCTION_PREFIX}agent",
            failure_topic_arn=self.topic_arn,
            checkpoint_bucket=f"{FUNCTION_PREFIX}checkpoints",
            launch_template_id=self.launch_template_id,
            launch_template_version="1",
            checkpoint_document=self.documents["checkpoint"],
            final_dump_document=self.documents["final-dump"],
            restore_document=self.documents["restore"],
            release_document=self.documents["release"],
            status_document=self.documents["status"],
            final_dump_wait_s=final_dump_wait_s,
            restore_wait_s=restore_wait_s,
            poll_s=1,
            backup_ready_wait_s=30,
            subnet_ids=tuple(self.subnets.values()),
            # The tag value the stack's grants require on the volumes and snapshots spotcr creates.
            stack_name=principals.function_setting(principals.template(STACK_CONTEXT), ENV["stack_name"]),
        )
        patches.enter_context(mock.patch.dict(os.environ, settings.to_env()))
        where = iam.local(
            settings,
            function_prefix=FUNCTION_PREFIX,
            job_role=JOB_ROLE_NAME,
            store_role=STORE_ROLE_NAME,
            file_system_id=self.file_system_id,
        )
        roles = iam.stack_roles(where)
        # The test's own key (mock_aws's): it builds the account as CloudFormation would, plays the user and the
        # agents, and reads what happened; IAM does not evaluate it.
        self.enforcer = iam.enforcer(roles, trusted={os.environ["AWS_ACCESS_KEY_ID"]: "the test"}, where=where)

    def launch_job_instance(
        self, job_tags: Mapping[str, str], az: str = f"{REGION}a", instance_type: str = "m5.large"
    ) -> str:
        """A job VM as the user starts it (`spotcr submit`): from the stack's launch template, tagged, running."""
        tag_list = [{"Key": k, "Value": v} for k, v in job_tags.items()]
        return str(
            self.ec2.run_instances(
                LaunchTemplate={"LaunchTemplateId": self.launch_template_id},
                InstanceType=instance_type,
                MinCount=1,
                MaxCount=1,
                SubnetId=self.subnets[az],
                TagSpecifications=[{"ResourceType": "instance", "Tags": tag_list}] if tag_list else [],
            )["Instances"][0]["InstanceId"]
        )

    def start_job(self, job_id: str, **extra_tags: str) -> str:
        """Launch, register (state change running) and start (JobStarted) a job; returns its instance id."""
        az = extra_tags.pop("az", f"{REGION}a")
        instance_id = self.launch_job_instance(
            {tag_names.JOB: job_id, tag_names.COMMAND: "/opt/job/run", **extra_tags}, az
        )
        route(ec2_event("state-change-running", instance_id))
        route(agent_event(events.JobStarted(job_id, instance_id, 0, now_iso(), pid=4242)))
        return instance_id

    def job(self, job_id: str) -> JobRecord:
        table = boto3.resource("dynamodb", region_name=REGION).Table("spotcr-jobs")
        return JobRecord.from_item(table.get_item(Key={"job_id": job_id})["Item"])

    def instance_tags(self, instance_id: str) -> dict[str, str]:
        reservations = self.ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
        return {t["Key"]: t["Value"] for t in reservations[0]["Instances"][0].get("Tags", [])}

    def sent_commands(self, command: str | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        """The commands sent so far (of that document; of that Kind: a checkpoint command's periodic or final). A
        final-dump command is listed once per order, with the order's instance and its parameters as a checkpoint
        command's (order_parameters)."""
        sent = []
        for c in self.ssm.list_commands()["Commands"]:
            if c["DocumentName"] == self.documents["final-dump"]:
                orders = commands.parse_orders(c["Parameters"]["Orders"][0])
                sent += [
                    {"document": c["DocumentName"], "instances": [o.instance_id], "parameters": _order_dict(o)}
                    for o in orders
                ]
                continue
            parameters = {k: v[0] for k, v in c["Parameters"].items()}
            sent.append({"document": c["DocumentName"], "instances": c["InstanceIds"], "parameters": parameters})
        sent = [c for c in sent if command is None or c["document"] == self.documents[command]]
        return [c for c in sent if kind is None or c["parameters"].get("Kind") == kind]

    def notifications(self) -> list[str]:
        """Messages published to the failure topic so far."""
        messages = self.sqs.receive_message(QueueUrl=self.inbox, MaxNumberOfMessages=10).get("Messages", [])
        return [json.loads(m["Body"])["Message"] for m in messages]

    def executions(self) -> list[dict[str, Any]]:
        return list(self.sfn.list_executions(stateMachineArn=self.state_machine_arn)["executions"])

    def backups(self) -> list[dict[str, Any]]:
        reservations = self.ec2.describe_instances(Filters=[{"Name": f"tag:{tag_names.MODE}", "Values": ["restore"]}])
        return [i for r in reservations["Reservations"] for i in r["Instances"]]

    def wait_until(self, predicate: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
        return wait_for(predicate, what, timeout)

    def wait_for_execution(self, timeout: float = 30.0) -> dict[str, Any]:
        def finished() -> dict[str, Any] | None:
            executions = self.executions()
            if executions and executions[0]["status"] != "RUNNING":
                return dict(self.sfn.describe_execution(executionArn=executions[0]["executionArn"]))
            return None

        return self.wait_until(finished, "the recovery workflow to finish", timeout)

    def close(self) -> None:
        """Stop workflows a test left waiting, so no engine thread outlives the mock."""
        for execution in self.executions():
            if execution["status"] == "RUNNING":
                self._stop_execution(execution["executionArn"])

    def _stop_execution(self, arn: str) -> None:
        # moto's stop_execution fails with AttributeError until its engine thread has set the execution up (a
        # workflow the test started a moment ago): try again briefly rather than leave the thread running.
        deadline = time.monotonic() + 10
        while True:
            try:
                self.sfn.stop_execution(executionArn=arn)
                return
            except AttributeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def wait_for_token(self, job_id: str, key: str) -> JobRecord:
        return self.wait_until(lambda: (r := self.job(job_id)).token(key) and r, f"the {key} token")


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def checkpoint_id(kind: str, generation: int, at_ms: int | None = None, sequence: int | None = None) -> str:
    return commands.checkpoint_id(at_ms or int(time.time() * 1000), generation, kind, sequence)
