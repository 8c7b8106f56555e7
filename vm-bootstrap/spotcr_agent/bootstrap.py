"""`spotcr-agent bootstrap`: read the job from IMDS, fetch its spec, prepare its storage, write agent.json,
then wait until SSM can reach this instance (readiness.py), so the agent's first event is answerable.

A failure names its step, goes to the console, and is published as BootstrapFailed with the run this VM was
registered for (its spotcr:run, waited for a bounded while): the control plane acts on no other.
"""

from __future__ import annotations

import argparse
import logging
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from spotcr_contracts.events import BootstrapFailed
from spotcr_contracts.settings import AGENT_FLAGS, VmSettings
from spotcr_contracts.tags import ERROR, JOB, RUN, RUN_ID_PATTERN, JobSpec, parse_job_tags

from . import config as agent_config
from . import readiness, scratch, storage, store_credentials
from .config import AgentConfig
from .events import EventBridgePublisher, Publisher, now_iso
from .imds import Imds, Metadata, instance_tags, require
from .runner import JobDefinition, parse_job_spec

log = logging.getLogger(__name__)


class BootstrapError(RuntimeError):
    def __init__(self, step: str, reason: str) -> None:
        super().__init__(f"bootstrap step {step!r} failed: {reason}")
        self.step = step
        self.reason = reason


def fetch_spec(uri: str) -> bytes:
    """The job spec object from S3 (s3://bucket/key, already validated by the tag parser)."""
    import boto3

    bucket, _, key = uri.removeprefix("s3://").partition("/")
    body: bytes = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read(64 * 1024 + 1)
    return body


TAG_POLL_S = 5.0
# How long a failed bootstrap waits for the run's tag: the control plane puts it on "running", in seconds.
RUN_WAIT_S = 120.0


def fetch_nodes(url: str, job_id: str, region: str) -> Mapping[str, str]:
    """A node's view of its job over several VMs, from the store-credentials URL, which answers once every node
    registered (asked again until then, for store_credentials.WAIT_S): every node's address, this node's index and
    the run's launch key."""
    if not url:
        raise ValueError("a job over several VMs needs the store-credentials URL: it hands each node the others")
    answer = store_credentials.fetcher(url, job_id, region)()
    if not answer.get("nodes"):
        raise ValueError(f"the store-credentials URL named no nodes for job {job_id}")
    return answer


def build_config(
    metadata: Metadata,
    args: argparse.Namespace,
    environ: Mapping[str, str],
    spec_reader: Callable[[str], bytes] = fetch_spec,
    sleep: Callable[[float], None] = time.sleep,
    *,
    nodes_reader: Callable[[str, str, str], Mapping[str, str]] = fetch_nodes,
) -> AgentConfig:
    """Everything the agent needs to know, from IMDS, the instance's tags and the bootstrap flags."""
    step = "imds"
    context: dict[str, str] = {}
    try:
        context["instance_id"] = require(metadata, "meta-data/instance-id")
        context["availability_zone"] = require(metadata, "meta-data/placement/availability-zone")
        context["region"] = metadata.get("meta-data/placement/region") or context["availability_zone"][:-1]
        step = "tags"
        job = parse_job_tags(wait_for_job_tag(metadata, sleep))
        step = "spec"
        definition = JobDefinition(command=job.command, workdir=job.workdir)
        if job.spec_uri:
            definition = parse_job_spec(spec_reader(job.spec_uri))
        step = "nodes"
        node: dict[str, Any] = {}
        if job.nodes > 1:
            url = VmSettings.from_agent_options(vars(args)).store_credentials_url
            answer = nodes_reader(url, job.job_id, context["region"])
            node = {
                "nodes": tuple(answer["nodes"].split(",")),
                "node_index": int(answer["node_index"]),
                "launch_key": answer["launch_key"],
            }
            if node["node_index"] != job.node_index or len(node["nodes"]) != job.nodes:
                raise ValueError(
                    f"the control plane lists this instance as node {node['node_index']} of {len(node['nodes'])}, "
                    f"its tags say node {job.node_index} of {job.nodes}"
                )
        step = "config"
        return _config(job, definition, context, args, environ, node=node)
    except Exception as error:
        raise BootstrapError(step, str(error)) from error


def wait_for_job_tag(metadata: Metadata, sleep: Callable[[float], None]) -> dict[str, str]:
    """The instance's tags once `spotcr:job` is among them: a user may add it to an instance already running
    from the launch template, and the job starts then (IMDS shows tag changes)."""
    tags = instance_tags(metadata)
    if JOB not in tags:
        log.info("no %s tag on this instance yet; waiting for one", JOB)
    while JOB not in tags:
        sleep(TAG_POLL_S)
        tags = instance_tags(metadata)
    return tags


def _config(
    job: JobSpec,
    definition: JobDefinition,
    context: Mapping[str, str],
    args: argparse.Namespace,
    environ: Mapping[str, str],
    *,
    node: Mapping[str, Any],
) -> AgentConfig:
    state_dir = Path(environ.get(agent_config.STATE_DIR_ENV, str(agent_config.DEFAULT_STATE_DIR)))
    deployment = VmSettings.from_agent_options(vars(args))
    workdir = job.workdir or definition.workdir
    values: dict[str, Any] = {
        "job_id": job.job_id,
        "instance_id": context["instance_id"],
        "availability_zone": context["availability_zone"],
        "region": context["region"],
        "storage": job.storage,
        "generation": job.generation,
        "mode": job.mode,
        "run_id": job.run_id,
        # The deployment's settings the boot passed, under the same names in agent.json.
        **{name: getattr(deployment, name) for name in AGENT_FLAGS},
        "ebs_volume_id": args.ebs_volume_id,
        "command": definition.command,
        "env": dict(definition.env),
        "result_files": job.result_files or definition.result_files,
        "interval_s": job.interval_s,
        "tcp": job.tcp,
        "restart_from_scratch": job.restart_from_scratch,
        "lazy_restore": job.lazy_restore,
        "deadline_margin_s": job.deadline_margin_s,
        "state_dir": state_dir,
        "imds_endpoint": environ.get(agent_config.IMDS_ENV, agent_config.DEFAULT_IMDS_ENDPOINT),
        **node,
    }
    if workdir:
        values["workdir"] = Path(workdir)
    if args.scratch_dir:
        values["scratch_dir"] = Path(args.scratch_dir)
    return AgentConfig(**values)


def bootstrap(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    print_result: Callable[[Mapping[str, Any]], None],
    *,
    metadata: Metadata | None = None,
    publisher: Publisher | None = None,
    spec_reader: Callable[[str], bytes] = fetch_spec,
    devices_dir: Path = Path("/dev/disk/by-id"),
    ping_status: readiness.PingStatus | None = None,
    scratch_warning: Callable[[Path], str | None] = scratch.capacity_warning,
    sleep: Callable[[float], None] = time.sleep,
    nodes_reader: Callable[[str, str, str], Mapping[str, str]] = fetch_nodes,
) -> int:
    metadata = metadata or Imds(environ.get(agent_config.IMDS_ENV, agent_config.DEFAULT_IMDS_ENDPOINT))
    config: AgentConfig | None = None
    waited_s = 0.0
    warning: str | None = None
    try:
        if args.report_failure:
            raise BootstrapError(args.report_failure, "the bootstrap script failed at this step; see the console log")
        config = build_config(metadata, args, environ, spec_reader, nodes_reader=nodes_reader)
        if storage.handed_over_at_restore(config):
            log.info("ebs: recovery hands the volume over once this backup is ready; the restore command mounts it")
        else:
            try:
                storage.prepare(config, devices_dir)
            except Exception as error:
                raise BootstrapError("storage", str(error)) from error
        path = agent_config.config_path(environ)
        try:
            config.write(path)
        except OSError as error:
            raise BootstrapError("config", f"cannot write {path}: {error}") from error
        warning = scratch_warning(config.scratch_dir)
        if warning:
            log.warning("this job may not be checkpointable on this instance: %s", warning)
        try:
            waited_s = readiness.wait_for_ssm(
                config.instance_id,
                ping_status or readiness.ssm_ping_status(config.region),
                timeout_s=float(getattr(args, "ssm_wait_seconds", readiness.DEFAULT_WAIT_S)),
            )
        except readiness.NotReachable as error:
            raise BootstrapError("ssm", str(error)) from error
    except BootstrapError as error:
        log.error("%s", error)
        region = config.region if config else _best_effort(metadata, "meta-data/placement/region")
        publisher = publisher or EventBridgePublisher(args.event_bus, "" if region == "unknown" else region)
        publisher.publish(
            BootstrapFailed(
                job_id=config.job_id if config else _best_effort_job(metadata),
                instance_id=config.instance_id if config else _best_effort(metadata, "meta-data/instance-id"),
                generation=config.generation if config else 0,
                at=now_iso(),
                run_id=config.run_id if config and config.run_id else registered_run(metadata, sleep),
                step=error.step,
                reason=error.reason[:1000],
            )
        )
        print_result({"ok": False, "step": error.step, "error": error.reason})
        return 2 if error.step in ("tags", "spec") else 1
    result: dict[str, Any] = {"ok": True, "config": str(path), "job_id": config.job_id, "mode": config.mode}
    result["ssm_wait_s"] = round(waited_s, 2)
    if warning:
        result["scratch_warning"] = warning
    print_result(result)
    return 0


def registered_run(metadata: Metadata, sleep: Callable[[float], None], wait_s: float = RUN_WAIT_S) -> str:
    """The run the control plane registered this instance for (spotcr:run), waited for a bounded while; empty when
    it refused the instance (spotcr:error), IMDS cannot tell, or none came: a failure without it moves no job."""
    waited = 0.0
    while True:
        try:
            found = instance_tags(metadata)
        except Exception:
            found = {}
        run_id = found.get(RUN, "")
        if run_id or ERROR in found or waited >= wait_s:
            return run_id if re.fullmatch(RUN_ID_PATTERN, run_id) else ""
        sleep(TAG_POLL_S)
        waited += TAG_POLL_S


def _best_effort(metadata: Metadata, path: str) -> str:
    try:
        return (metadata.get(path) or "unknown").strip()
    except Exception:
        return "unknown"


def _best_effort_job(metadata: Metadata) -> str:
    try:
        return instance_tags(metadata).get("spotcr:job", "unknown")
    except Exception:
        return "unknown"
