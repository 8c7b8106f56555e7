"""A wave of spot interruptions: N jobs warned within seconds, recovered by one control plane at once.

When a capacity pool runs dry, every instance in it gets its warning within seconds. `run_wave` plays that against
a ControlPlane (rehearsal/controlplane.py, the real handlers and ASL on the local AWS) whose VMs are simulated agents
(rehearsal/simagent.py): it registers the jobs through the real register path (launch, EC2's state change, the
agent's JobStarted), delivers every warning through EventBridge's routing within `warn_within_s` (the notice shows in
each VM's IMDS at the same moment, where its agent polls for it), waits for every
workflow to end, then reads the wave's end state: recovered, failed, stuck, two live copies, leaks.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import boto3
from spotcr_contracts import tags as tag_names
from spotcr_functions.models import Status

from rehearsal import controlplane, leaks
from rehearsal.localaws import REGION, awslambda, wrap
from rehearsal.localaws import throttle as rate_limits
from rehearsal.simagent import SimulatedAgents

LIVE_STATES = ("pending", "running")
QUEUE_WINDOW_S = 10.0


@dataclass
class WaveResult:
    """What the wave did: per job, when each step came after its warning (s); and its end state."""

    jobs: list[str]
    warned_over_s: float  # first warning to last
    to_final_dump_begun: dict[str, float] = field(default_factory=dict)  # the agent's IMDS poll, or the command
    to_final_dump_command: dict[str, float] = field(default_factory=dict)
    to_backup_launched: dict[str, float] = field(default_factory=dict)
    to_running_again: dict[str, float] = field(default_factory=dict)
    recovered: list[str] = field(default_factory=list)
    without_final_dump: list[str] = field(default_factory=list)  # recovered, but not from their final dump
    failed: dict[str, str] = field(default_factory=dict)  # job -> why
    stuck: list[str] = field(default_factory=list)  # its workflow still running when the wave's time was up
    live_copies: dict[str, list[str]] = field(default_factory=dict)  # job -> its live instances, where more than one
    leaks: list[str] = field(default_factory=list)
    agent_errors: list[str] = field(default_factory=list)  # events Lambda dropped after its retries; answers refused
    seconds: float = 0.0  # first warning to the last workflow's end
    throttles: dict[str, Any] = field(default_factory=dict)  # the throttle Meter's report, when limits applied
    # The local AWS's own queue (one request at a time) over the wave's first QUEUE_WINDOW_S: requests served, and
    # how long each waited for its turn (s: mean, p50, p99)
    local_aws_queue: dict[str, float] = field(default_factory=dict)
    # CPU seconds this process used over the same window: the local AWS, every handler and every simulated agent
    # share its one interpreter, which runs one thread at a time (about 1 s of CPU a second at most)
    window_cpu_s: float = 0.0
    # Per function, its invocations begun in that window: how many, and the CPU seconds each used on its own thread
    # (its handler, and the in-process local AWS serving that handler's requests): {"invocations", "cpu_s", "p50_s"}
    function_cpu: dict[str, dict[str, float]] = field(default_factory=dict)

    def clean(self) -> bool:
        """Every job recovered, none failed or stuck, no job with two live copies, nothing leaked."""
        return len(self.recovered) == len(self.jobs) and not (
            self.failed or self.stuck or self.live_copies or self.leaks or self.agent_errors
        )


def spread(values: dict[str, float]) -> dict[str, float]:
    """p50, p99 and max of a figure over the jobs (p99 by the inclusive method: never beyond the max)."""
    if not values:
        return {}
    ordered = sorted(values.values())
    p99 = statistics.quantiles(ordered, n=100, method="inclusive")[98] if len(ordered) > 1 else ordered[0]
    return {"p50": statistics.median(ordered), "p99": p99, "max": ordered[-1]}


def register(plane: controlplane.ControlPlane, count: int, prefix: str = "wave") -> dict[str, str]:
    """`count` running jobs, registered as `spotcr submit` does; job id -> its instance."""
    if count < 1:
        raise ValueError(f"a wave needs at least one job, not {count}")
    return {f"{prefix}-{n:03d}": plane.start_job(f"{prefix}-{n:03d}") for n in range(count)}


def run_wave(
    plane: controlplane.ControlPlane,
    agents: SimulatedAgents,
    instances: dict[str, str],
    *,
    warn_within_s: float = 5.0,
    timeout_s: float = 300.0,
    limits: rate_limits.Limits | None = None,
    progress: Callable[[str], None] = lambda _line: None,
) -> WaveResult:
    """Warn every job's instance within `warn_within_s` (evenly spread; each delivered on time, as EventBridge
    delivers to Lambda's event queue, the agents' queue: `agents.events`), then wait up to `timeout_s` for every
    workflow to end and for every event to run or be dropped.
    With `limits`, AWS's rate limits apply from the first warning until then (not to the reads of the end state)."""
    warned: dict[str, float] = {}

    def warn(job_id: str, at: float) -> None:
        time.sleep(max(0.0, at - time.time()))
        warned[job_id] = time.time()
        agents.notice(instances[job_id])
        controlplane.deliver(agents.events, controlplane.ec2_event("spot-interruption-warning", instances[job_id]))

    before = find_leaks()
    waits: list[tuple[float, float]] = []
    invocations: list[tuple[str, float, float]] = []
    with contextlib.ExitStack() as throttled:
        meter = rate_limits.install(throttled, limits) if limits else None
        controlplane._MOTO.waits = waits
        throttled.callback(setattr, controlplane._MOTO, "waits", None)
        wrap(throttled, awslambda.Functions, "call", lambda call: _cpu_measured(call, invocations))
        began = time.monotonic()
        start = time.time()
        cpu = [time.process_time()]
        window = threading.Timer(QUEUE_WINDOW_S, lambda: cpu.append(time.process_time()))
        window.daemon = True
        window.start()
        step = warn_within_s / max(1, len(instances) - 1)
        with ThreadPoolExecutor(len(instances), thread_name_prefix="eventbridge") as pool:
            for delivered in [pool.submit(warn, job, start + n * step) for n, job in enumerate(instances)]:
                delivered.result()
        result = WaveResult(jobs=list(instances), warned_over_s=max(warned.values()) - min(warned.values()))
        progress(f"{len(warned)} warnings delivered over {result.warned_over_s:.1f} s")
        executions = _wait_for_workflows(plane, len(instances), start + timeout_s, progress)
        result.seconds = time.time() - start
        agents.events.join()
    result.throttles = meter.report() if meter else {}
    result.local_aws_queue = _queue_figures([w for at, w in waits if at - began <= QUEUE_WINDOW_S])
    result.function_cpu = _function_cpu([(name, cpu) for name, at, cpu in invocations if at - began <= QUEUE_WINDOW_S])
    window.cancel()
    result.window_cpu_s = cpu[1] - cpu[0] if len(cpu) > 1 else 0.0
    live = _live_instances(plane)
    for job_id, primary in instances.items():
        times = agents.job(job_id)
        if times.final_dump_begun is not None:
            result.to_final_dump_begun[job_id] = times.final_dump_begun - warned[job_id]
        if times.final_dump_ordered is not None:
            result.to_final_dump_command[job_id] = times.final_dump_ordered - warned[job_id]
        if times.backup_launched is not None:
            result.to_backup_launched[job_id] = times.backup_launched - warned[job_id]
        stopped = _end_state(plane, result, job_id, primary, executions.get(job_id), live=live.get(job_id, []))
        if stopped is not None:
            result.to_running_again[job_id] = stopped - warned[job_id]
    result.leaks = _leaks(plane, instances, before)
    result.agent_errors = agents.events.dropped + agents.errors
    return result


def _cpu_measured(call: Any, invocations: list[tuple[str, float, float]]) -> Any:
    """Functions.call, noting each invocation's (function, when it began, CPU seconds of its thread meanwhile)."""

    def measured(self: awslambda.Functions, name: str, payload: Any) -> Any:
        began, cpu = time.monotonic(), time.thread_time()
        try:
            return call(self, name, payload)
        finally:
            invocations.append((name, began, time.thread_time() - cpu))  # list.append: atomic

    return measured


def _function_cpu(invocations: list[tuple[str, float]]) -> dict[str, dict[str, float]]:
    by_function: dict[str, list[float]] = {}
    for name, cpu in invocations:
        by_function.setdefault(name, []).append(cpu)
    return {
        name: {"invocations": len(cpus), "cpu_s": sum(cpus), "p50_s": statistics.median(cpus)}
        for name, cpus in sorted(by_function.items(), key=lambda item: -sum(item[1]))
    }


def _queue_figures(waits: list[float]) -> dict[str, float]:
    if not waits:
        return {}
    spread_s = spread({str(n): wait for n, wait in enumerate(waits)})
    return {
        "window_s": QUEUE_WINDOW_S,
        "requests": len(waits),
        "mean_wait_s": statistics.fmean(waits),
        "p50_wait_s": spread_s["p50"],
        "p99_wait_s": spread_s["p99"],
    }


def _wait_for_workflows(
    plane: controlplane.ControlPlane, count: int, deadline: float, progress: Callable[[str], None]
) -> dict[str, dict[str, Any]]:
    """job id -> its recovery workflow's execution, once all `count` have ended or the deadline passed."""
    paginator = plane.sfn.get_paginator("list_executions")
    while True:
        listed = [e for page in paginator.paginate(stateMachineArn=plane.state_machine_arn) for e in page["executions"]]
        running = sum(e["status"] == "RUNNING" for e in listed)
        if (len(listed) >= count and not running) or time.time() > deadline:
            break
        progress(f"{len(listed)} workflows, {running} running")
        time.sleep(1.0)
    described = [plane.sfn.describe_execution(executionArn=e["executionArn"]) for e in listed]
    return {json.loads(e["input"])["job_id"]: dict(e) for e in described}


def _end_state(
    plane: controlplane.ControlPlane,
    result: WaveResult,
    job_id: str,
    primary: str,
    execution: dict[str, Any] | None,
    *,
    live: list[str],
) -> float | None:
    """Sorts the job into recovered, failed or stuck (`live`: the job's live instances); returns when it ran again
    (its workflow's end), if it did."""
    record = plane.job(job_id)
    if len(live) > 1:
        result.live_copies[job_id] = live
    if execution is None:
        result.failed[job_id] = f"no recovery workflow started; the job is {record.status}"
    elif execution["status"] == "RUNNING":
        result.stuck.append(job_id)
    elif execution["status"] != "SUCCEEDED":
        why = f"{execution.get('error', '')} {execution.get('cause', '')}; the job's reason: {record.reason}"
        result.failed[job_id] = f"workflow {execution['status']}: {why}"
    elif record.status != Status.RUNNING or record.instance_id == primary or live != [record.instance_id]:
        where = f"{record.status} on {record.instance_id}, live: {live}"
        result.failed[job_id] = f"workflow succeeded, but the job is {where}"
    else:
        result.recovered.append(job_id)
        if not str(record.checkpoint_id or "").endswith("-final"):
            result.without_final_dump.append(job_id)
        return float(execution["stopDate"].timestamp())
    return None


def _live_instances(plane: controlplane.ControlPlane) -> dict[str, list[str]]:
    """job id -> its live instances, from one listing of every instance tagged with a job (moto filters tags by
    scanning every tag of the account for each instance: a listing per job made the 300-job wave's end state take
    longer than its recovery)."""
    filters = [
        {"Name": "tag-key", "Values": [tag_names.JOB]},
        {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
    ]
    live: dict[str, list[str]] = {}
    for page in plane.ec2.get_paginator("describe_instances").paginate(Filters=filters):
        for instance in (i for r in page["Reservations"] for i in r["Instances"]):
            job_id = next(t["Value"] for t in instance["Tags"] if t["Key"] == tag_names.JOB)
            live.setdefault(job_id, []).append(instance["InstanceId"])
    return {job_id: sorted(ids) for job_id, ids in live.items()}


def find_leaks() -> list[leaks.Leak]:
    return leaks.find_leaks(lambda service: boto3.client(service, region_name=REGION))


def _leaks(plane: controlplane.ControlPlane, instances: dict[str, str], before: list[leaks.Leak]) -> list[str]:
    """What leaks.find_leaks names that was not there before the wave, less what the running jobs hold: their
    instance, its volumes, their access point."""
    held = {leak.resource_id for leak in before}
    for job_id in instances:
        record = plane.job(job_id)
        if record.status == Status.RUNNING:
            held.add(record.instance_id)
            if record.access_point_arn:
                held.add(record.access_point_arn.rsplit("/", 1)[-1])
    attached = [{"Name": "attachment.instance-id", "Values": sorted(held)}]
    held |= {v["VolumeId"] for v in plane.ec2.describe_volumes(Filters=attached)["Volumes"]}
    return [str(leak) for leak in find_leaks() if leak.resource_id not in held]
