"""`spotcr plan`: the checkpoint interval for a job and what a run costs on each storage.

Two modes. With the job's own figures (--memory-gib ...): the Young/Daly interval, the final dump against the
two-minute notice, the expected overhead and the cost of a run on each storage (the VM, the storage's requests,
the storage the retention keeps; per day too), from `spotcr probe` results when given, else from documented
defaults. With the original research's inputs (--interval-hours
--dump-seconds --stored-gb --storage-price-gb-month): that research's long-running model, exactly.
The formulas are in model.py and in docs/planning.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from math import inf
from pathlib import Path
from typing import Any

from spotcr_contracts.tags import STORAGES

from . import model
from .model import PlanInputError, Rates, Source

RESEARCH_FLAGS = ("interval_hours", "dump_seconds", "stored_gb", "storage_price_gb_month")
JOB_FLAGS = ("memory_gib", "dirty_gib_per_min", "interruption_rate")
PROBES_PREFIX = "probes/"


def probe_key(instance_type: str, storage: str) -> str:
    """Where `spotcr probe` keeps a result in the stack's bucket, and where `spotcr plan` looks for it."""
    return f"{PROBES_PREFIX}{instance_type}/{storage}.json"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="checkpoint interval, final dump against the notice, and the cost of a run on each storage",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    job = parser.add_argument_group("a job (the Young/Daly plan)")
    job.add_argument("--memory-gib", type=float, help="the job's memory, GiB")
    job.add_argument("--dirty-gib-per-min", type=float, help="memory the job changes per minute, GiB")
    job.add_argument(
        "--interruption-rate",
        metavar="RATE",
        # argparse formats help with %: the bands' own % must be doubled
        help="interruptions per hour (e.g. 0.01), or a Spot Instance Advisor band: "
        + ", ".join(model.BANDS).replace("%", "%%"),
    )
    job.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="a job over several VMs: its node count; --memory-gib, --dirty-gib-per-min and the prices are one "
        "node's, and the job is interrupted when any node is",
    )
    job.add_argument("--storage", choices=(*STORAGES, "all"), default="all", help="storage to plan for (all)")
    job.add_argument("--instance-type", default="", help="the job's instance type; selects probe results")
    job.add_argument("--on-demand-price-hour", type=float, help="on-demand price of the type, to compare")
    job.add_argument(
        "--rewritten-per-interval",
        metavar="SHARE|GiB",
        help="memory the job rewrites between checkpoints, as a share (5%%, 0.05) or GiB (3.2GiB); "
        "default: the dirty rate over the interval",
    )
    job.add_argument("--stored-gib", type=float, help="GiB kept in the store (default: what the retention keeps)")
    job.add_argument("--interval-minutes", type=float, help="evaluate this interval instead of Daly's")
    job.add_argument(
        "--storage-price",
        action="append",
        default=[],
        metavar="STORAGE=USD",
        help="price per GB-month of a storage, overriding the default (repeatable)",
    )
    job.add_argument("--probe", action="append", default=[], metavar="FILE", help="a `spotcr probe` result (JSON)")
    job.add_argument("--bucket", default="", help=f"read probe results from s3://BUCKET/{PROBES_PREFIX}<type>/")
    research = parser.add_argument_group("the original research's long-running model")
    research.add_argument("--interval-hours", type=float, help="hours of work between checkpoints")
    research.add_argument("--dump-seconds", type=float, help="seconds one checkpoint stops the job")
    research.add_argument("--stored-gb", type=float, help="GB stored for the month")
    research.add_argument("--storage-price-gb-month", type=float, help="storage price, USD per GB-month")
    both = parser.add_argument_group("both")
    both.add_argument("--work-hours", type=float, help="hours of work the job needs")
    both.add_argument("--vm-price-hour", type=float, help="the VM's (spot) price, USD per hour")
    both.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        result = plan(args)
    except PlanInputError as error:
        print(f"spotcr plan: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    elif result["model"] == "research":
        print(_research_table(result))
    else:
        print(_job_table(result))
    return 0


def plan(args: argparse.Namespace) -> dict[str, Any]:
    given = {name for name in (*RESEARCH_FLAGS, *JOB_FLAGS) if getattr(args, name) is not None}
    research = given & set(RESEARCH_FLAGS)
    if research:
        if given & set(JOB_FLAGS):
            raise PlanInputError("give either the research model's inputs or the job's (--memory-gib ...), not both")
        missing = [f"--{name.replace('_', '-')}" for name in ("work_hours", *RESEARCH_FLAGS, "vm_price_hour")]
        missing = [flag for flag in missing if getattr(args, flag[2:].replace("-", "_")) is None]
        if missing:
            raise PlanInputError(f"the research model also needs {', '.join(missing)}")
        return model.ResearchRun(
            work_hours=args.work_hours,
            interval_hours=args.interval_hours,
            dump_seconds=args.dump_seconds,
            stored_gb=args.stored_gb,
            vm_price_hour=args.vm_price_hour,
            storage_price_gb_month=args.storage_price_gb_month,
        ).to_json()
    missing = [
        f"--{name.replace('_', '-')}"
        for name in (*JOB_FLAGS, "work_hours", "vm_price_hour")
        if getattr(args, name) is None
    ]
    if missing:
        raise PlanInputError(f"a plan needs {', '.join(missing)} (or the research model's inputs)")
    rate, rate_source = model.parse_rate(args.interruption_rate)
    job = model.JobPlanInput(
        memory_gib=args.memory_gib,
        dirty_gib_per_min=args.dirty_gib_per_min,
        rate_per_hour=rate,
        rate_source=rate_source,
        work_hours=args.work_hours,
        vm_price_hour=args.vm_price_hour,
        on_demand_price_hour=args.on_demand_price_hour,
        stored_gib=args.stored_gib,
        rewritten_gib=(
            model.parse_rewritten(args.rewritten_per_interval, args.memory_gib)
            if args.rewritten_per_interval is not None
            else None
        ),
        storage_price={**model.DEFAULT_STORAGE_PRICE, **_prices(args.storage_price)},
        interval_s=args.interval_minutes * 60.0 if args.interval_minutes is not None else None,
        nodes=args.nodes,
    )
    storages = list(STORAGES) if args.storage == "all" else [args.storage]
    probes = _load_probes(args.probe, args.bucket, args.instance_type, storages)
    plans = [model.plan_storage(job, storage, rates_for(storage, probes)) for storage in storages]
    return {
        "model": "job",
        "instance_type": args.instance_type,
        "memory_gib": job.memory_gib,
        "dirty_gib_per_min": job.dirty_gib_per_min,
        "nodes": job.nodes,
        "interruptions_per_hour": job.job_rate_per_hour,
        "interruption_rate_source": rate_source + (f", times {job.nodes} nodes" if job.nodes > 1 else ""),
        "mean_time_between_interruptions_h": 1.0 / job.job_rate_per_hour,
        "work_hours": job.work_hours,
        "vm_price_hour": job.vm_price_hour,
        "boot_s": {"value": job.boot.value, "source": job.boot.source},
        "storages": plans,
        "cheapest": min(plans, key=lambda p: p["total_cost"])["storage"],
    }


def rates_for(storage: str, probes: Mapping[str, Mapping[str, Any]]) -> Rates:
    """A storage's rates: from its probe result where there is one, else the defaults and their sources."""
    found = probes.get(storage)
    local = probes.get("local")
    write, read, pipeline = model.DEFAULT_WRITE_MIB_S[storage], model.DEFAULT_READ_MIB_S[storage], None
    if found is not None:
        where = f"spotcr probe of {found['location']} on {found['instance_type']} at {found['measured_at']}"
        write = Source(float(found["write_mib_s"]), where)
        read = Source(float(found["read_mib_s"]), where)
        if found.get("pipeline_mib_s"):
            pipeline = Source(float(found["pipeline_mib_s"]), f"{where}: the agent's pipeline")
    local_dump = model.DEFAULT_LOCAL_DUMP_MIB_S
    if local is not None:
        local_dump = Source(float(local["write_mib_s"]), f"spotcr probe of the scratch dir {local['location']}")
    return Rates(write=write, read=read, pipeline=pipeline or model.DEFAULT_PIPELINE_MIB_S, local_dump=local_dump)


def _prices(items: Sequence[str]) -> dict[str, Source]:
    prices = {}
    for item in items:
        storage, sep, value = item.partition("=")
        model.check_storage(storage)
        try:
            price = float(value) if sep else -1.0
        except ValueError:
            price = -1.0
        if price < 0:
            raise PlanInputError(f"--storage-price {item[:40]!r}: expected STORAGE=USD per GB-month, 0 or more")
        prices[storage] = Source(price, "given")
    return prices


def _load_probes(files: Sequence[str], bucket: str, instance_type: str, storages: Sequence[str]) -> dict[str, Any]:
    """Probe results by storage: the files given, then the bucket's for this instance type (files win)."""
    from spotcr_agent.probe import ProbeError, ProbeResult

    probes: dict[str, Any] = {}
    texts: list[tuple[str, str]] = []
    if bucket:
        if not instance_type:
            raise PlanInputError("--bucket needs --instance-type: probe results are kept per instance type")
        texts += _bucket_probes(bucket, instance_type, [*storages, "local"])
    for name in files:
        try:
            texts.append((name, Path(name).read_text()))
        except OSError as error:
            raise PlanInputError(f"cannot read probe result {name}: {error.strerror}") from error
    for name, text in texts:
        try:
            result = ProbeResult.from_json(json.loads(text))
        except (ValueError, ProbeError) as error:
            raise PlanInputError(f"probe result {name}: {error}") from error
        if instance_type and result.instance_type != instance_type:
            raise PlanInputError(f"probe result {name} was measured on {result.instance_type}, not on {instance_type}")
        probes[result.storage] = result.to_json()
    return probes


def _bucket_probes(bucket: str, instance_type: str, storages: Sequence[str]) -> list[tuple[str, str]]:
    import boto3
    from botocore.exceptions import ClientError

    client = boto3.client("s3")
    found = []
    for storage in storages:
        key = probe_key(instance_type, storage)
        try:
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                continue
            raise PlanInputError(f"cannot read s3://{bucket}/{key}: {error}") from error
        found.append((f"s3://{bucket}/{key}", body.decode()))
    return found


def _nodes(count: int) -> str:
    return f"{count} nodes of " if count > 1 else ""


def _research_table(result: Mapping[str, Any]) -> str:
    rows = [
        ("checkpoints", f"{result['checkpoints']}"),
        ("time checkpointing", f"{result['checkpoint_hours']:.3f} h ({result['checkpoint_share']:.1%} of the run)"),
        ("total time", f"{result['total_hours']:.3f} h"),
        ("VM cost", f"${result['vm_cost']:.4f}"),
        ("storage cost", f"${result['storage_cost']:.4f}"),
        ("total cost", f"${result['total_cost']:.4f}"),
    ]
    return _table(("the research's model", ""), rows)


def _job_table(result: Mapping[str, Any]) -> str:
    head = (
        f"job: {_nodes(result['nodes'])}{result['memory_gib']:g} GiB, dirties {result['dirty_gib_per_min']:g} GiB/min, "
        f"{result['work_hours']:g} h of work on {result['instance_type'] or 'an unnamed type'}; "
        f"{result['interruptions_per_hour']:.5f} interruptions/h ({result['interruption_rate_source']}), "
        f"one every {result['mean_time_between_interruptions_h']:.1f} h"
    )
    columns = (
        "storage",
        "interval (tag, s)",
        "Young",
        "freeze",
        "final dump worst/first",
        f"fits {model.FINAL_DUMP_BUDGET_S:.0f} s",
        "overhead",
        "run",
        "cost",
    )
    rows = []
    for p in result["storages"]:
        final = p["final_dump"]
        fits = (
            "yes"
            if final["fits"]
            else (
                "no: "
                + (f"after {final['fits_until_s'] / 60:.0f} min" if final["fits_until_s"] is not None else "never")
            )
        )
        rows.append(
            (
                p["storage"],
                f"{p['interval']['seconds'] / 60:.1f} min ({next(iter(p['interval']['tag'].values()))})",
                f"{p['interval']['young_s'] / 60:.1f} min",
                f"{p['checkpoint_freeze_s']:.1f} s",
                f"{final['worst_s']:.0f} s / {final['first_s']:.0f} s",
                fits,
                f"{p['overhead']:.2%}",
                f"{p['run_hours']:.2f} h",
                f"${p['total_cost']:.2f}"
                + (f" (on-demand ${p['on_demand_cost']:.2f})" if "on_demand_cost" in p else ""),
            )
        )
    per_day = []
    for p in result["storages"]:
        day, kept = p["per_day"], p["kept"]
        per_day.append(
            (
                p["storage"],
                f"{p['new_gib_per_checkpoint']['value']:.2f} GiB",
                f"{day['written_gib']:,.1f} GiB",
                f"{day['puts']:,.0f} PUT, {day['gets']:,.0f} GET" if "requests_per_gib" in p else "-",
                f"{kept['checkpoints']}: {kept['gib']:,.1f} GiB"
                + (f" + {kept['noncurrent_gib']:,.0f} GiB deleted" if kept["noncurrent_gib"] else "")
                + (
                    f" > {kept['provisioned_gib']:g} provisioned"
                    if kept["gib"] > kept.get("provisioned_gib", inf)
                    else ""
                ),
                f"${day['vm_cost']:.2f}",
                f"${day['requests_cost']:.2f}",
                f"${day['storage_cost']:.2f}",
            )
        )
    per_day_columns = ("per day", "new/checkpoint", "written", "S3 requests", "kept", "VM", "requests", "storage")
    sources = ["rates (MiB/s) and where they come from:"]
    for p in result["storages"]:
        for name, rate in p["rates_mib_s"].items():
            line = f"  {name}: {rate['value']:.1f} ({rate['source']})"
            line = line if name in ("pipeline", "local_dump") else f"  {p['storage']} {line.strip()}"
            if line not in sources:
                sources.append(line)
    prices = ["prices beside the VM:"]
    for p in result["storages"]:
        prices.append(f"  {p['storage']}: {p['request_price']['source']}")
        if "requests_per_gib" in p:
            puts, gets = p["requests_per_gib"]["puts"], p["requests_per_gib"]["gets"]
            prices.append(f"  {p['storage']}: {puts['value']:g} PUTs per GiB written ({puts['source']})")
            prices.append(f"  {p['storage']}: {gets['value']:g} GETs per GiB restored ({gets['source']})")
    return "\n".join(
        [
            head,
            "",
            _table(columns, rows),
            "",
            _table(per_day_columns, per_day),
            "",
            *sources,
            *prices,
            f"cheapest: {result['cheapest']}",
        ]
    )


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)
