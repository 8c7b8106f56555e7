"""Interruption handler latency: spot warning in, final-dump command out, against moto, N handler runs.

Prints p50/p99 warning-to-dump-command latency (target p99 <= 1 s) next to a bare SSM SendCommand against the
same moto (the floor), and writes bench/results/interruption.json. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
REGION = "us-east-1"


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


class _Context:
    function_name = "spotcr-interruption"
    function_version = "$LATEST"
    memory_limit_in_mb = 256
    invoked_function_arn = f"arn:aws:lambda:{REGION}:123456789012:function:spotcr-interruption"
    aws_request_id = "bench"

    def get_remaining_time_in_millis(self) -> int:
        return 30_000


def _environment() -> dict[str, str]:
    """A control plane in moto: tables, documents, a state machine (not executed), settings in the environment."""
    import boto3
    from spotcr_contracts import commands
    from spotcr_functions import registry_schema
    from spotcr_functions.config import Settings

    dynamodb = boto3.client("dynamodb", region_name=REGION)
    dynamodb.create_table(**registry_schema.create_table_arguments("spotcr-jobs"))
    dynamodb.create_table(**registry_schema.create_idempotency_table_arguments("spotcr-idempotency"))
    ssm = boto3.client("ssm", region_name=REGION)
    for name, command in commands.COMMANDS.items():
        ssm.create_document(Content=json.dumps(command.document()), Name=f"spotcr-{name}", DocumentType="Command")
    state_machine = boto3.client("stepfunctions", region_name=REGION).create_state_machine(
        name="spotcr-recovery",
        definition=json.dumps({"StartAt": "Done", "States": {"Done": {"Type": "Succeed"}}}),
        roleArn="arn:aws:iam::123456789012:role/spotcr-recovery",
    )["stateMachineArn"]
    return Settings(
        jobs_table="spotcr-jobs",
        idempotency_table="spotcr-idempotency",
        recovery_state_machine_arn=state_machine,
        event_bus_name="spotcr-agent",
        failure_topic_arn=f"arn:aws:sns:{REGION}:123456789012:spotcr-failures",
        checkpoint_bucket="spotcr-checkpoints",
        launch_template_id="lt-0123456789abcdef0",
        launch_template_version="1",
        checkpoint_document="spotcr-checkpoint",
        final_dump_document="spotcr-final-dump",
        restore_document="spotcr-restore",
        release_document="spotcr-release",
        status_document="spotcr-status",
    ).to_env()


def _event(detail_type: str, detail: dict[str, Any], instance_id: str) -> dict[str, Any]:
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": detail_type,
        "source": "aws.ec2",
        "account": "123456789012",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "region": REGION,
        "resources": [f"arn:aws:ec2:{REGION}:123456789012:instance/{instance_id}"],
        "detail": detail,
    }


def _run(runs: int) -> dict[str, Any]:
    import boto3
    from spotcr_contracts import events
    from spotcr_functions.cloud import Cloud
    from spotcr_functions.handlers import agent_events, interruption, state_change

    os.environ.update(_environment())
    ec2 = boto3.client("ec2", region_name=REGION)
    ssm = boto3.client("ssm", region_name=REGION)
    instance_ids = [
        i["InstanceId"]
        for i in ec2.run_instances(
            ImageId="ami-760aaa0f",
            MinCount=runs,
            MaxCount=runs,
            InstanceType="m5.large",
            TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "spotcr:job", "Value": "placeholder"}]}],
        )["Instances"]
    ]
    for number, instance_id in enumerate(instance_ids):
        job_id = f"bench-{number}"
        ec2.create_tags(
            Resources=[instance_id],
            Tags=[{"Key": "spotcr:job", "Value": job_id}, {"Key": "spotcr:command", "Value": "/opt/job/run"}],
        )
        state_change.handler(
            _event(
                "EC2 Instance State-change Notification", {"instance-id": instance_id, "state": "running"}, instance_id
            ),
            _Context(),
        )
        started = events.JobStarted(job_id, instance_id, 0, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), pid=1)
        entry = started.to_entry("spotcr-agent")
        agent_events.handler(
            {"source": entry["Source"], "detail-type": entry["DetailType"], "detail": json.loads(entry["Detail"])},
            _Context(),
        )

    # Instrumentation for the benchmark only: when did SendCommand return, relative to the handler's start?
    command_returned: list[float] = []
    send_final_dumps = Cloud.send_final_dumps

    def timed_send_final_dumps(self: Cloud, *args: Any, **kwargs: Any) -> str:
        command_id = send_final_dumps(self, *args, **kwargs)
        command_returned.append(time.perf_counter())
        return command_id

    Cloud.send_final_dumps = timed_send_final_dumps  # type: ignore[method-assign]
    latencies, handler_seconds = [], []
    try:
        for instance_id in instance_ids:
            warning = _event(
                "EC2 Spot Instance Interruption Warning",
                {"instance-id": instance_id, "instance-action": "terminate"},
                instance_id,
            )
            begin = time.perf_counter()
            result = interruption.handler(warning, _Context())
            handler_seconds.append(time.perf_counter() - begin)
            if result.get("action") != "recovering" or not result.get("final_dump"):
                raise RuntimeError(f"interruption handler did not order a final dump: {result}")
            latencies.append(command_returned[-1] - begin)
    finally:
        Cloud.send_final_dumps = send_final_dumps  # type: ignore[method-assign]

    bare = []
    for instance_id in instance_ids[:50]:
        begin = time.perf_counter()
        ssm.send_command(
            InstanceIds=[instance_id],
            DocumentName="spotcr-checkpoint",
            Parameters={"JobId": ["bench-0"], "Generation": ["1"], "Kind": ["final"]},
        )
        bare.append(time.perf_counter() - begin)
    return {
        "runs": runs,
        "warning_to_dump_command_p50_s": statistics.median(latencies),
        "warning_to_dump_command_p99_s": _percentile(latencies, 0.99),
        "warning_to_dump_command_max_s": max(latencies),
        "handler_total_p50_s": statistics.median(handler_seconds),
        "handler_total_p99_s": _percentile(handler_seconds, 0.99),
        "baseline_bare_send_command_p50_s": statistics.median(bare),
        "target_p99_s": 1.0,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench interruption", description=__doc__)
    parser.add_argument("--runs", type=int, default=200, help="interruption handler runs (default 200)")
    args = parser.parse_args(argv)
    for name, value in {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": REGION,
        "POWERTOOLS_LOG_LEVEL": "WARNING",
    }.items():
        os.environ[name] = value
    os.environ.pop("AWS_ENDPOINT_URL", None)
    from moto import mock_aws

    with mock_aws(), contextlib.redirect_stdout(io.StringIO()):  # handlers print EMF metrics to stdout
        figures = _run(args.runs)
    p50, p99 = figures["warning_to_dump_command_p50_s"], figures["warning_to_dump_command_p99_s"]
    floor = figures["baseline_bare_send_command_p50_s"]
    verdict = "met" if p99 <= 1.0 else "MISSED"
    total_p50, total_p99 = figures["handler_total_p50_s"] * 1000, figures["handler_total_p99_s"] * 1000
    print(f"interruption warning -> final-dump command, {figures['runs']} handler runs against moto (in-process)")
    print(f"  p50 {p50 * 1000:7.1f} ms   p99 {p99 * 1000:7.1f} ms   (target p99 <= 1000 ms: {verdict})")
    print(f"  whole handler (incl. StartExecution) p50 {total_p50:.1f} ms, p99 {total_p99:.1f} ms")
    print(f"  baseline: bare SSM SendCommand p50 {floor * 1000:.1f} ms; handler p50 is {p50 / floor:.1f}x that floor")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "interruption.json").write_text(json.dumps(figures, indent=2) + "\n")
    return 0
