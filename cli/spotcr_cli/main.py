"""`spotcr`: submit jobs, watch them, list and restore checkpoints, read logs, interrupt and cancel them.

Everything it needs comes from the stack's outputs (--stack, default spotcr); --endpoint-url (or
SPOTCR_ENDPOINT_URL) points it at another endpoint, such as the local cloud of the rehearsal.
Exit codes: 0 done, 1 failed (the message says why), 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

from spotcr_contracts import tags
from spotcr_functions.models import ENDED

from spotcr_cli import actions, jobs, preflight, render, selftest
from spotcr_cli.aws import DEFAULT_STACK, ENDPOINT_ENV, STACK_ENV, Cloud, CommandError

OPTIONAL_COMMANDS = ("spotcr_cli.plan", "spotcr_cli.probe")  # written beside this module; absent ones are skipped


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotcr", description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--endpoint-url", help=f"AWS endpoint to use instead of AWS's own (env {ENDPOINT_ENV}), e.g. the local cloud"
    )
    parser.add_argument("--stack", help=f"the spotcr stack's name (env {STACK_ENV}; default {DEFAULT_STACK})")
    parser.add_argument("--region", help="AWS region (default: the AWS configuration's)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_submit(commands)

    listing = commands.add_parser("jobs", help="every job: state, generation, instance, newest checkpoint")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_jobs)

    status = commands.add_parser("status", help="one job: state, instances, checkpoint, interruptions, cost")
    status.add_argument("job", metavar="JOB")
    status.add_argument("--json", action="store_true")
    status.add_argument("--watch", type=float, metavar="S", help="print it again every S seconds until the job ends")
    status.set_defaults(func=cmd_status)

    checkpoints = commands.add_parser("checkpoints", help="a job's committed checkpoints")
    checkpoints.add_argument("job", metavar="JOB")
    checkpoints.add_argument("--json", action="store_true")
    checkpoints.set_defaults(func=cmd_checkpoints)

    restore = commands.add_parser("restore", help="recover a job from a chosen checkpoint on a new VM")
    restore.add_argument("job", metavar="JOB")
    restore.add_argument(
        "--checkpoint", required=True, metavar="ID", help="a committed checkpoint (spotcr checkpoints)"
    )
    restore.add_argument("--json", action="store_true")
    restore.set_defaults(func=cmd_restore)

    logs = commands.add_parser("logs", help="CRIU's logs kept in the store and the job's failure reasons")
    logs.add_argument("job", metavar="JOB")
    logs.add_argument(
        "--no-agent", dest="agent", action="store_false", help="do not ask the job's agent (on a running job's VM)"
    )
    logs.add_argument("--json", action="store_true")
    logs.set_defaults(func=cmd_logs)

    interrupt = commands.add_parser("interrupt", help="a real spot interruption of the job's VM, through AWS FIS")
    interrupt.add_argument("job", metavar="JOB")
    interrupt.add_argument(
        "--rebalance-first", action="store_true", help="a rebalance recommendation two minutes before the notice"
    )
    interrupt.add_argument("--json", action="store_true")
    interrupt.set_defaults(func=cmd_interrupt)

    cancel = commands.add_parser("cancel", help="stop a job and release its VMs; keep or delete its checkpoints")
    cancel.add_argument("job", metavar="JOB")
    cancel.add_argument("--delete-checkpoints", action="store_true", help="delete its checkpoints (not its result)")
    cancel.add_argument("--json", action="store_true")
    cancel.set_defaults(func=cmd_cancel)

    preflight.register(commands)
    selftest.register(commands)
    for name in OPTIONAL_COMMANDS:
        try:
            module = __import__(name, fromlist=["register"])
        except ImportError:
            continue
        module.register(commands)
    return parser


def _add_submit(commands: Any) -> None:
    submit = commands.add_parser("submit", help="launch a job from the stack's launch template (or tag an instance)")
    submit.add_argument("job", metavar="JOB", help="the job's name: 1-63 of a-z, 0-9 and '-'")
    what = submit.add_mutually_exclusive_group(required=True)
    what.add_argument("--command", dest="job_command", help="the command, as argv (no shell)")
    what.add_argument("--spec", help="s3://bucket/key of a JSON job spec")
    submit.add_argument(
        "--storage", choices=tags.STORAGES, help=f"where checkpoints go (default {tags.DEFAULT_STORAGE})"
    )
    submit.add_argument(
        "--interval", type=int, help=f"seconds between periodic checkpoints (default {tags.DEFAULT_INTERVAL_S})"
    )
    submit.add_argument("--fallback-types", help="instance types tried after the job's own, comma-separated")
    submit.add_argument("--workdir", help="the job's working directory on the VM")
    submit.add_argument("--tcp", choices=tags.TCP_POLICIES, help="the job's TCP connections after a restore")
    submit.add_argument(
        "--result",
        metavar="FILES",
        help="files, relative to the work dir and comma-separated, the job must leave: without them it FAILS",
    )
    submit.add_argument(
        "--no-restart-from-scratch",
        dest="restart_from_scratch",
        action="store_const",
        const=False,
        help="fail the job instead of starting it over when no checkpoint can be restored",
    )
    submit.add_argument(
        "--no-lazy-restore",
        dest="lazy_restore",
        action="store_const",
        const=False,
        help="a backup downloads the whole checkpoint before the job runs again (by default its memory follows)",
    )
    submit.add_argument(
        "--nodes",
        type=int,
        help="a job over several VMs: launch this many nodes (2-16) in one subnet, each tagged with its index; node 0 "
        "runs the command (mpiexec across them); efs or fsx storage. Not for real work yet: a warned or lost node "
        "fails the job, since its recovery is not built",
    )
    submit.add_argument("--instance-type", help="instance type to launch (required unless --instance)")
    submit.add_argument("--on-demand", action="store_true", help="launch on demand instead of spot")
    submit.add_argument(
        "--instance", metavar="ID", help="tag this running instance (from the stack's launch template), not launch one"
    )
    submit.add_argument("--json", action="store_true", help="print the job as JSON")
    submit.set_defaults(func=cmd_submit)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.out = out or sys.stdout
    args.cloud = Cloud(endpoint_url=args.endpoint_url, region=args.region, stack=args.stack)
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return int(args.func(args))
    except (BotoCoreError, ClientError) as error:
        print(f"spotcr {args.command}: {error}", file=sys.stderr)
        return 1
    except tags.InvalidJobTags as error:
        print(f"spotcr {args.command}: {error}", file=sys.stderr)
        return 2
    except CommandError as error:
        print(f"spotcr {args.command}: {error}", file=sys.stderr)
        return error.code
    except KeyboardInterrupt:
        return 130


def _progress(args: argparse.Namespace) -> Callable[[str], None]:
    """Progress lines go to stderr with --json (stdout is the JSON alone), else to stdout."""
    stream = sys.stderr if getattr(args, "json", False) else args.out
    return lambda line: print(line, file=stream, flush=True)


def cmd_submit(args: argparse.Namespace) -> int:
    job = actions.job_tags(
        args.job,
        command=args.job_command,
        spec=args.spec,
        storage=args.storage,
        interval_s=args.interval,
        fallback_types=args.fallback_types,
        workdir=args.workdir,
        tcp=args.tcp,
        restart_from_scratch=args.restart_from_scratch,
        lazy_restore=args.lazy_restore,
        result=args.result,
        nodes=args.nodes,
    )
    if args.instance and (args.instance_type or args.on_demand):
        raise CommandError("--instance tags a running instance: --instance-type and --on-demand do not apply", 2)
    if args.nodes is not None:
        return _submit_nodes(args, job)
    result = actions.submit(
        args.cloud,
        job,
        instance_id=args.instance,
        instance_type=args.instance_type,
        on_demand=args.on_demand,
        say=_progress(args),
    )
    if args.json:
        render.as_json(result, args.out)
    else:
        print(f"job {result['job_id']} on {result['instance_id']}: spotcr status {result['job_id']}", file=args.out)
    return 0


def _submit_nodes(args: argparse.Namespace, job: dict[str, str]) -> int:
    """Launch every node of a job over several VMs, node 0 first, each with its own index, all in one subnet."""
    if args.instance:
        raise CommandError("--nodes launches every node: tag running instances with spotcr:nodes and spotcr:node", 2)
    say = _progress(args)
    say(
        f"job {args.job} over {args.nodes} VMs in one subnet: each warned or lost node moves to a backup there with "
        "its address (docs/design/multinode.md)"
    )
    launched = [
        actions.submit(
            args.cloud,
            actions.node_tags(job, index),
            instance_id=None,
            instance_type=args.instance_type,
            on_demand=args.on_demand,
            say=say,
        )
        for index in range(args.nodes)
    ]
    if args.json:
        render.as_json({"job_id": args.job, "nodes": launched}, args.out)
    else:
        instances = ", ".join(f"{index} {node['instance_id']}" for index, node in enumerate(launched))
        print(f"job {args.job} on {args.nodes} nodes ({instances}): spotcr status {args.job}", file=args.out)
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    now = datetime.now(UTC)
    views = [jobs.status_view(args.cloud, r, now, with_cost=False) for r in jobs.list_records(args.cloud)]
    if args.json:
        render.as_json(views, args.out)
        return 0
    rows = [
        (
            v["job_id"],
            v["state"],
            v["generation"],
            v["instance_id"],
            v["backup_instance_id"],
            v["storage"],
            (v["checkpoint"] or {}).get("kind"),
            render.age((v["checkpoint"] or {}).get("age_s")),
        )
        for v in views
    ]
    headers = ("job", "state", "gen", "instance", "backup", "storage", "checkpoint", "age")
    render.table(headers, rows, args.out)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    while True:
        view = jobs.status_view(args.cloud, jobs.get_record(args.cloud, args.job), datetime.now(UTC))
        if args.json:
            render.as_json(view, args.out)
        else:
            _print_status(view, args.out)
        ended = view["state"] in ENDED
        if not args.watch or ended:
            return 0
        time.sleep(args.watch)


def _print_status(view: dict[str, Any], out: TextIO) -> None:
    checkpoint = view["checkpoint"] or {}
    cost = view["cost"]
    lines = [
        ("job", view["job_id"]),
        ("state", view["state"]),
        ("generation", view["generation"]),
        ("instance", f"{view['instance_id']} ({view['instance_type']})"),
        ("backup", view["backup_instance_id"]),
        (
            "nodes",
            f"{len(view['nodes'])} of {view['node_count']}: "
            + ", ".join(f"{n['index']} {n['instance_id']} ({n['address']})" for n in view["nodes"])
            if view.get("node_count")
            else None,
        ),
        ("storage", f"{view['storage']}, a periodic checkpoint every {view['interval_s']} s"),
        (
            "newest checkpoint",
            f"{checkpoint['checkpoint_id']} ({checkpoint['kind']}, {render.size(checkpoint.get('size_bytes'))}, "
            f"{render.age(checkpoint.get('age_s'))} ago)"
            if checkpoint
            else None,
        ),
        ("interruptions survived", view["interruptions_survived"]),
        ("work redone", None if view["work_redone_s"] is None else f"{view['work_redone_s']} s (latest interruption)"),
        ("exit code", view["exit_code"]),
        ("result", view["result"]),
        ("reason", view["reason"]),
        (
            "cost so far",
            f"{render.money(cost['cost_usd'])} for {cost['hours']:.3f} instance-hours; "
            f"on demand {render.money(cost['on_demand_usd'])} (prices: {cost['source']})",
        ),
    ]
    lines += [("", note) for note in cost["notes"]]
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        if value is not None and value != "":
            print(f"{key.ljust(width)}  {value}", file=out)


def cmd_checkpoints(args: argparse.Namespace) -> int:
    record = jobs.get_record(args.cloud, args.job)
    now = datetime.now(UTC)
    views = [c.view(now) for c in jobs.checkpoints(args.cloud, record)]
    if args.json:
        render.as_json(views, args.out)
        return 0
    rows = [
        (
            v["checkpoint_id"],
            v["kind"],
            v["generation"],
            render.size(v["size_bytes"]),
            render.size(v["stored_bytes"]),
            render.age(v["age_s"]),
        )
        for v in views
    ]
    render.table(("checkpoint", "kind", "gen", "size", "stored", "age"), rows, args.out)
    if record.storage != "s3":
        print(f"({record.storage}: the store is on the job's storage; the record names these two)", file=args.out)
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    result = actions.restore(args.cloud, args.job, args.checkpoint, say=_progress(args))
    if args.json:
        render.as_json(result, args.out)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    record = jobs.get_record(args.cloud, args.job)
    reasons = jobs.failures(record) + jobs.instance_errors(args.cloud, args.job)
    logs = jobs.criu_logs(args.cloud, record)
    agent_logs = jobs.agent_logs(args.cloud, record)
    running = record.status in ("RUNNING", "CHECKPOINTING", "PENDING")
    agent = jobs.agent_view(args.cloud, record) if args.agent and running else None
    if args.json:
        document = {"job_id": args.job, "failures": reasons, "criu_logs": logs, "agent_logs": agent_logs}
        render.as_json({**document, "agent": agent}, args.out)
        return 0
    for reason in reasons:
        print(f"{reason['what']}: {reason['reason']}", file=args.out)
    if agent is not None:
        print(f"agent on {record.instance_id}:", file=args.out)
        for key, value in sorted(agent.items()):
            print(f"  {key}: {value}", file=args.out)
    for log in logs:
        print(f"==> {log['key']} ({render.size(log['size_bytes'])}): {log['error']} <==", file=args.out)
        print(log["text"].rstrip(), file=args.out)
    for log in agent_logs:
        print(f"==> {log['key']} ({render.size(log['size_bytes'])}) <==", file=args.out)
        print(log["text"].rstrip(), file=args.out)
    if not reasons and not logs:
        print(f"job {args.job}: no failure recorded and no CRIU log kept", file=args.out)
    return 0


def cmd_interrupt(args: argparse.Namespace) -> int:
    result = actions.interrupt(args.cloud, args.job, rebalance_first=args.rebalance_first, say=_progress(args))
    if args.json:
        render.as_json(result, args.out)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    result = actions.cancel(args.cloud, args.job, delete_checkpoints=args.delete_checkpoints, say=_progress(args))
    if args.json:
        render.as_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
