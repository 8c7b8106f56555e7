"""`spotcr selftest`: after deploying, one small job through a real FIS interruption in your account.

Submit a job whose result is known, wait for its first periodic checkpoint, interrupt it with the stack's FIS
template, wait for its restore on a backup and for its end, compare its stored result with the known one, and
clean up everything it made. Each phase is timed; exit 0 only if the result is the same.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from spotcr_contracts import fis as fis_experiments
from spotcr_contracts.layout import job_prefix
from spotcr_contracts.tags import STORAGES
from spotcr_functions.models import ACTIVE, ENDED, JobRecord, Status

from spotcr_cli import actions, jobs
from spotcr_cli.aws import Cloud, CommandError
from spotcr_cli.preflight import DEFAULT_INSTANCE_TYPES

RESULT_FILE = "digest.txt"
PACE_S = 0.25  # one step of the job


def job_command(steps: int) -> str:
    """A deterministic job as one `spotcr:command` (argv, no shell): SHA-256 over its step numbers, paced."""
    return (
        "python3 -c \"[h := __import__('hashlib').sha256(), "
        f"[__import__('time').sleep({PACE_S}) or h.update(str(i).encode()) for i in range({steps})], "
        f"open('{RESULT_FILE}', 'w').write(h.hexdigest())]\""
    )


def expected_digest(steps: int) -> str:
    digest = hashlib.sha256()
    for step in range(steps):
        digest.update(str(step).encode())
    return digest.hexdigest()


@dataclass
class Phases:
    say: Callable[[str], None]
    timings: dict[str, float]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        except Exception as error:
            self.timings[name] = round(time.monotonic() - started, 1)
            self.say(f"FAIL  {name} ({self.timings[name]:.1f} s): {error}")
            raise CommandError(f"{name}: {error}") from error
        self.timings[name] = round(time.monotonic() - started, 1)
        self.say(f"PASS  {name} ({self.timings[name]:.1f} s)")


def wait_for(
    cloud: Cloud, job_id: str, until: Callable[[JobRecord], bool], what: str, *, timeout_s: float, poll_s: float
) -> JobRecord:
    """Read the job's record until the condition holds; a job that ends first, or the timeout, fails naming it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            record: JobRecord | None = jobs.get_record(cloud, job_id)
        except CommandError:
            record = None  # the control plane registers a submitted job once its VM's bootstrap runs
        if record is not None and until(record):
            return record
        if record is not None and record.status in ENDED:
            raise CommandError(f"job {job_id} ended {record.status} while waiting for {what}: {record.reason or ''}")
        if time.monotonic() > deadline:
            state = record.status if record is not None else "not registered"
            raise CommandError(f"no {what} within {timeout_s:.0f} s (job {job_id} is {state})")
        time.sleep(poll_s)


def selftest(
    cloud: Cloud,
    *,
    job_id: str,
    storage: str,
    work_s: float,
    interval_s: int,
    instance_type: str | None,
    timeout_s: float,
    say: Callable[[str], None],
    poll_s: float = 2.0,
) -> dict[str, Any]:
    steps = max(1, round(work_s / PACE_S))
    phases = Phases(say, {})
    outcome: dict[str, Any] = {"job_id": job_id, "timings": phases.timings}
    with phases.phase("stack"):
        template = cloud.stack.experiment_template(fis_experiments.INTERRUPT)
        cloud.client("fis").get_experiment_template(id=template)
    try:
        with phases.phase("submit"):
            job = actions.job_tags(
                job_id, command=job_command(steps), spec=None, storage=storage, interval_s=interval_s,
                fallback_types=None, workdir=None, tcp=None, restart_from_scratch=False,
            )  # fmt: skip
            submitted = actions.submit(
                cloud, job, instance_id=None, instance_type=instance_type, on_demand=False, say=say
            )
        primary = submitted["instance_id"]

        def wait(until: Callable[[JobRecord], bool], what: str) -> JobRecord:
            return wait_for(cloud, job_id, until, what, timeout_s=timeout_s, poll_s=poll_s)

        with phases.phase("start"):
            wait(lambda r: r.status != Status.PENDING, "start of the job")
        with phases.phase("periodic checkpoint"):
            wait(lambda r: bool(r.checkpoint_id), "periodic checkpoint")
        with phases.phase("interrupt"):
            actions.interrupt(cloud, job_id, rebalance_first=False, say=say)
        with phases.phase("restore on a backup"):

            def on_backup(r: JobRecord) -> bool:
                return r.generation >= 1 and r.status in ACTIVE and r.instance_id != primary

            outcome["backup_instance_id"] = wait(on_backup, "restore on a backup").instance_id
        with phases.phase("job end"):
            ended = wait(lambda r: r.status in ENDED, "end of the job")
            if ended.status != Status.COMPLETED or ended.exit_code != 0:
                raise CommandError(f"job {job_id} ended {ended.status}, exit code {ended.exit_code}: {ended.reason}")
        with phases.phase("same result"):
            outcome["result"] = _result(cloud, ended)
            outcome["expected"] = expected_digest(steps)
            if outcome["result"] != outcome["expected"]:
                raise CommandError(f"result {outcome['result']} differs from the expected {outcome['expected']}")
    finally:
        with phases.phase("clean up"):
            outcome["cleaned"] = cleanup(cloud, job_id, say)
    return outcome


def _result(cloud: Cloud, record: JobRecord) -> str:
    from spotcr_agent.result import ResultError, fetch_result_file
    from spotcr_agent.store.backends import S3Backend
    from spotcr_agent.store.errors import StoreError

    backend = S3Backend(cloud.stack.bucket, client=cloud.client("s3"))
    try:
        return fetch_result_file(backend, record.job_id, RESULT_FILE, record.run_id).decode().strip()
    except (ResultError, StoreError) as error:
        raise CommandError(f"the stored result of job {record.job_id}: {error}") from error


def cleanup(cloud: Cloud, job_id: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Cancel the job if it still runs, terminate its instances, delete its checkpoints, stored result and record."""
    try:
        record = jobs.get_record(cloud, job_id)
    except CommandError:
        record = None  # never registered: only its instance may be left
    if record is not None and record.status not in ENDED:
        actions.cancel(cloud, job_id, delete_checkpoints=False, say=say)
    running = [i["InstanceId"] for i in jobs.instances(cloud, job_id) if i["State"]["Name"] in jobs.RUNNING_STATES]
    if running:
        cloud.client("ec2").terminate_instances(InstanceIds=running)
        say(f"terminating {', '.join(running)}")
    deleted: dict[str, Any] = {"instances_terminated": running}
    if record is not None:
        deleted["checkpoints"] = actions.delete_job_checkpoints(cloud, jobs.get_record(cloud, job_id), say)
    s3, bucket = cloud.client("s3"), cloud.stack.bucket
    keys = [o["Key"] for o in jobs._objects(s3, bucket, job_prefix(job_id))]
    for start in range(0, len(keys), 1000):
        s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[start : start + 1000]]})
    deleted["result_objects"] = len(keys)
    cloud.client("dynamodb").delete_item(TableName=cloud.stack.job_table, Key={"job_id": {"S": job_id}})
    say(f"deleted {len(keys)} more objects under s3://{bucket}/{job_prefix(job_id)} and job {job_id}'s record")
    return deleted


def register(commands: Any) -> None:
    parser = commands.add_parser("selftest", help="after deploying: a small job through a real FIS interruption")
    parser.add_argument("--storage", choices=STORAGES, default="s3", help="where checkpoints go (default s3)")
    parser.add_argument("--job", help="the test job's name (default selftest-<random>)")
    parser.add_argument("--work-seconds", type=float, default=900.0, help="how long the job runs uninterrupted")
    parser.add_argument("--interval", type=int, default=60, help="seconds between periodic checkpoints")
    parser.add_argument(
        "--instance-type",
        default=DEFAULT_INSTANCE_TYPES[0],
        help="instance type (default %(default)s, the type preflight checks quotas for by default)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds each phase may take")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=cmd_selftest)


def cmd_selftest(args: argparse.Namespace) -> int:
    import sys

    from spotcr_cli import render

    def say(line: str) -> None:  # progress on stderr with --json, as the other commands do
        print(line, file=sys.stderr if args.json else args.out, flush=True)

    outcome = selftest(
        args.cloud,
        job_id=args.job or f"selftest-{uuid.uuid4().hex[:8]}",
        storage=args.storage,
        work_s=args.work_seconds,
        interval_s=args.interval,
        instance_type=args.instance_type,
        timeout_s=args.timeout,
        say=say,
    )
    if args.json:
        render.as_json(outcome, args.out)
    else:
        print(f"selftest passed: job {outcome['job_id']}, result {outcome['result']}", file=args.out)
    return 0
