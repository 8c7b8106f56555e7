"""What the read commands show: job records, checkpoints in the store, logs and cost, as plain dicts."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from spotcr_contracts import results
from spotcr_contracts.commands import CHECKPOINT_ID_PATTERN, checkpoint_generation, checkpoint_order
from spotcr_contracts.layout import AGENT_LOGS, CRIU_LOGS, job_prefix, run_prefix
from spotcr_functions.models import JobRecord

from spotcr_cli.aws import Cloud, CommandError

_TERMINATED_AT = re.compile(r"\((\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}) GMT\)")
RUNNING_STATES = ("pending", "running", "stopping", "stopped")
PRICE_SOURCE = "EC2 spot price history (DescribeSpotPriceHistory, Linux/UNIX) and the AWS Price List API"


def get_record(cloud: Cloud, job_id: str) -> JobRecord:
    item = cloud.client("dynamodb").get_item(
        TableName=cloud.stack.job_table, Key={"job_id": {"S": job_id}}, ConsistentRead=True
    )
    if "Item" not in item:
        raise CommandError(f"no job {job_id!r} in {cloud.stack.job_table} (spotcr jobs lists them)")
    return JobRecord.from_item(_plain_item(item["Item"]))


def list_records(cloud: Cloud) -> list[JobRecord]:
    paginator = cloud.client("dynamodb").get_paginator("scan")
    records = []
    for page in paginator.paginate(TableName=cloud.stack.job_table):
        for item in page.get("Items", []):
            try:
                records.append(JobRecord.from_item(_plain_item(item)))
            except (KeyError, TypeError, ValueError):
                continue  # a record of another version of spotcr; `status` names its problem
    return sorted(records, key=lambda r: r.job_id)


def _plain_item(item: Mapping[str, Any]) -> dict[str, Any]:
    from boto3.dynamodb.types import TypeDeserializer

    deserializer = TypeDeserializer()
    return {key: deserializer.deserialize(value) for key, value in item.items()}


def is_checkpoint_id(checkpoint_id: str) -> bool:
    return re.fullmatch(CHECKPOINT_ID_PATTERN, checkpoint_id) is not None


def checkpoint_time(checkpoint_id: str) -> datetime | None:
    """A checkpoint id starts with its time in Unix milliseconds (spotcr_contracts.commands.CHECKPOINT_ID_PATTERN)."""
    if not is_checkpoint_id(checkpoint_id):
        return None
    return datetime.fromtimestamp(int(checkpoint_id.split("-", 1)[0]) / 1000, UTC)


@dataclass(frozen=True)
class Checkpoint:
    checkpoint_id: str
    kind: str
    generation: int
    created_at: datetime | None
    size: int | None  # bytes of the images and files it holds
    stored: int | None  # bytes this checkpoint added to the store (its manifest and the chunks no older one has)
    source: str  # "manifest" when read from the store, else "record"

    def view(self, now: datetime) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "kind": self.kind,
            "generation": self.generation,
            "created_at": self.created_at.isoformat() if self.created_at else None,
            "age_s": round((now - self.created_at).total_seconds(), 1) if self.created_at else None,
            "size_bytes": self.size,
            "stored_bytes": self.stored,
            "source": self.source,
        }


def checkpoints(cloud: Cloud, record: JobRecord) -> list[Checkpoint]:
    """Committed checkpoints, oldest first: from the store's manifests for S3 jobs, else the record's two."""
    if record.storage != "s3":
        ids = [c for c in (record.previous_checkpoint_id, record.checkpoint_id) if c]
        return [_from_id(c) for c in ids]
    from spotcr_agent.store.errors import StoreError
    from spotcr_agent.store.manifest import Manifest

    s3, bucket, prefix = cloud.client("s3"), cloud.stack.bucket, run_prefix(record.job_id, record.run_id)
    manifests: list[tuple[Manifest, int]] = []
    for obj in _objects(s3, bucket, prefix + "checkpoints/"):
        checkpoint_id = obj["Key"].rsplit("/", 1)[-1].removesuffix(".json")
        raw = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        try:
            manifests.append((Manifest.from_json(raw, checkpoint_id), int(obj["Size"])))
        except (StoreError, ValueError):
            continue  # a damaged manifest is not a committed checkpoint; the restore skips it the same way
    chunk_sizes = {obj["Key"].rsplit("/", 1)[-1]: int(obj["Size"]) for obj in _objects(s3, bucket, prefix + "chunks/")}
    seen: set[str] = set()
    out = []
    for manifest, manifest_size in sorted(manifests, key=lambda m: checkpoint_order(m[0].checkpoint_id)):
        chunks = manifest.stored_chunks()
        new = chunks.keys() - seen
        seen |= chunks.keys()
        out.append(
            Checkpoint(
                checkpoint_id=manifest.checkpoint_id,
                kind=manifest.kind,
                generation=manifest.generation,
                created_at=_parse_time(manifest.created_at) or checkpoint_time(manifest.checkpoint_id),
                size=manifest.bytes_total,
                # a packed chunk's stored length is in the manifest; format 1's chunk is an object of its own
                stored=manifest_size + sum(chunks[h].stored or chunk_sizes.get(h, 0) for h in new),
                source="manifest",
            )
        )
    return out


def _from_id(checkpoint_id: str) -> Checkpoint:
    valid = is_checkpoint_id(checkpoint_id)
    return Checkpoint(
        checkpoint_id=checkpoint_id,
        kind=checkpoint_id.rsplit("-", 1)[-1] if valid else "?",
        generation=checkpoint_generation(checkpoint_id) if valid else -1,
        created_at=checkpoint_time(checkpoint_id),
        size=None,
        stored=None,
        source="record",
    )


def _objects(s3: Any, bucket: str, prefix: str) -> Iterator[dict[str, Any]]:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        yield from page.get("Contents", [])


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def instances(cloud: Cloud, job_id: str) -> list[dict[str, Any]]:
    """Every instance that carried the job (primary and backups, terminated ones while EC2 still lists them)."""
    found = []
    paginator = cloud.client("ec2").get_paginator("describe_instances")
    for page in paginator.paginate(Filters=[{"Name": "tag:spotcr:job", "Values": [job_id]}]):
        for reservation in page.get("Reservations", []):
            found.extend(reservation.get("Instances", []))
    return sorted(found, key=lambda i: i.get("LaunchTime") or datetime.min.replace(tzinfo=UTC))


def cost(cloud: Cloud, job_id: str, now: datetime) -> dict[str, Any]:
    """What the job's instances cost so far, and what the same hours would cost on demand."""
    spot_total: float | None = 0.0
    on_demand_total: float | None = 0.0
    hours_total = 0.0
    notes: list[str] = []
    rows = []
    for instance in instances(cloud, job_id):
        launched = instance.get("LaunchTime")
        if launched is None:
            continue
        state = instance.get("State", {}).get("Name", "")
        ended = now if state in RUNNING_STATES else _ended_at(instance) or now
        hours = max(0.0, (ended - launched).total_seconds() / 3600)
        instance_type = instance.get("InstanceType", "")
        spot = instance.get("InstanceLifecycle") == "spot"
        on_demand_price = _on_demand_price(cloud, instance_type, notes)
        price = _spot_price(cloud, instance_type, instance.get("Placement", {}).get("AvailabilityZone"), launched)
        price = price if spot else on_demand_price
        hours_total += hours
        spot_total = None if spot_total is None or price is None else spot_total + price * hours
        on_demand_total = (
            None if on_demand_total is None or on_demand_price is None else on_demand_total + on_demand_price * hours
        )
        rows.append(
            {
                "instance_id": instance.get("InstanceId"),
                "instance_type": instance_type,
                "market": "spot" if spot else "on-demand",
                "hours": round(hours, 4),
                "price_per_hour": price,
            }
        )
    return {
        "hours": round(hours_total, 4),
        "cost_usd": None if spot_total is None else round(spot_total, 4),
        "on_demand_usd": None if on_demand_total is None else round(on_demand_total, 4),
        "source": PRICE_SOURCE,
        "notes": sorted(set(notes)),
        "instances": rows,
    }


def _ended_at(instance: Mapping[str, Any]) -> datetime | None:
    # EC2 writes "User initiated (2026-11-23 17:01:02 GMT)" when an instance is stopped or terminated.
    match = _TERMINATED_AT.search(str(instance.get("StateTransitionReason", "")))
    return datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC) if match else None


def _spot_price(cloud: Cloud, instance_type: str, zone: str | None, at: datetime) -> float | None:
    arguments: dict[str, Any] = {
        "InstanceTypes": [instance_type],
        "ProductDescriptions": ["Linux/UNIX"],
        "StartTime": at,
        "EndTime": at,
    }
    if zone:
        arguments["AvailabilityZone"] = zone
    try:
        history = cloud.client("ec2").describe_spot_price_history(**arguments).get("SpotPriceHistory", [])
    except Exception:
        return None
    prices = [float(entry["SpotPrice"]) for entry in history if entry.get("SpotPrice")]
    return max(prices) if prices else None


def _on_demand_price(cloud: Cloud, instance_type: str, notes: list[str]) -> float | None:
    """Linux on-demand price per hour from the Price List API (served in us-east-1 for every region)."""
    region = cloud.client("ec2").meta.region_name
    filters = [
        {"Type": "TERM_MATCH", "Field": field, "Value": value}
        for field, value in (
            ("instanceType", instance_type),
            ("regionCode", region),
            ("operatingSystem", "Linux"),
            ("tenancy", "Shared"),
            ("preInstalledSw", "NA"),
            ("capacitystatus", "Used"),
        )
    ]
    key = f"on-demand:{region}:{instance_type}"
    if key in cloud.prices:
        price, note = cloud.prices[key]
        notes.extend([note] if note else [])
        return price
    try:
        import boto3
        from botocore.config import Config

        pricing = boto3.client(
            "pricing",
            region_name="us-east-1",
            endpoint_url=cloud.endpoint_url,
            config=Config(retries={"max_attempts": 1}),
        )
        products = pricing.get_products(ServiceCode="AmazonEC2", Filters=filters, MaxResults=1)["PriceList"]
        terms = json.loads(products[0])["terms"]["OnDemand"]
        dimension = next(iter(next(iter(terms.values()))["priceDimensions"].values()))
        cloud.prices[key] = (float(dimension["pricePerUnit"]["USD"]), "")
    except Exception as error:
        cloud.prices[key] = (
            None,
            f"on-demand price unknown: Price List API: {type(error).__name__}: {str(error)[:120]}",
        )
    return _on_demand_price(cloud, instance_type, notes)


def time_lost(record: JobRecord) -> dict[str, Any]:
    """The latest interruption's cost in time: the work redone, from the checkpoint restored to the warning."""
    restore = record.arrival("restore") or {}
    restored_from = str((restore.get("output") or {}).get("checkpoint_id") or "")
    interrupted = _parse_time(record.interrupted_at)
    checkpoint_at = checkpoint_time(restored_from) if restored_from else None
    if interrupted is None or checkpoint_at is None or restore.get("generation") != record.generation:
        return {"work_redone_s": None}
    return {"work_redone_s": round(max(0.0, (interrupted - checkpoint_at).total_seconds()), 1)}


def status_view(cloud: Cloud, record: JobRecord, now: datetime, *, with_cost: bool = True) -> dict[str, Any]:
    stored = checkpoints(cloud, record) if with_cost else []
    newest = stored[-1] if stored else (_from_id(record.checkpoint_id) if record.checkpoint_id else None)
    view: dict[str, Any] = {
        "job_id": record.job_id,
        "state": str(record.status),
        "generation": record.generation,
        "instance_id": record.instance_id,
        "backup_instance_id": record.backup_instance_id,
        "instance_type": record.instance_type,
        "storage": record.storage,
        "interval_s": record.interval_s,
        "checkpoint": newest.view(now) if newest else None,
        "checkpoints": len(stored),
        "interruptions_survived": record.generation,
        "interrupted_at": record.interrupted_at,
        **time_lost(record),
        "exit_code": record.exit_code,
        "result": record.result,
        "reason": record.reason,
        "updated_at": record.updated_at,
    }
    run_id = record.extra.get("run_id")
    if run_id is not None:
        view["run_id"] = run_id
    if record.node_count:  # a job over several VMs: its nodes registered so far
        view["node_count"] = record.node_count
        view["nodes"] = [node.to_item() for node in record.nodes]
    if with_cost:
        view["cost"] = cost(cloud, record.job_id, now)
    return view


def failures(record: JobRecord) -> list[dict[str, str]]:
    """Why things went wrong, from the record: its reason and each failed wait of the current generation."""
    out = []
    if record.reason:
        out.append({"what": "job", "reason": record.reason})
    for key in ("final-dump", "backup-ready", "restore"):
        arrival = record.arrival(key) or {}
        if arrival.get("error"):
            out.append(
                {
                    "what": f"{key} (generation {arrival.get('generation')})",
                    "reason": f"{arrival['error']}: {arrival.get('cause', '')}",
                }
            )
    return out


def criu_logs(cloud: Cloud, record: JobRecord) -> list[dict[str, Any]]:
    """CRIU's logs of failed dumps and restores, kept in the job's store (S3 jobs: the bucket)."""
    if record.storage != "s3":
        return []
    from spotcr_agent.criu import explain

    s3, bucket = cloud.client("s3"), cloud.stack.bucket
    logs = []
    for obj in _objects(s3, bucket, job_prefix(record.job_id) + f"{CRIU_LOGS}/"):
        text = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read().decode(errors="replace")
        logs.append({"key": obj["Key"], "size_bytes": int(obj["Size"]), "error": explain(text), "text": text})
    return sorted(logs, key=lambda log: log["key"])


def agent_logs(cloud: Cloud, record: JobRecord) -> list[dict[str, Any]]:
    """The agent's own log lines of each failed dump or restore, kept beside CRIU's (S3 jobs: the bucket)."""
    if record.storage != "s3":
        return []
    s3, bucket = cloud.client("s3"), cloud.stack.bucket
    logs = []
    for obj in _objects(s3, bucket, job_prefix(record.job_id) + f"{AGENT_LOGS}/"):
        text = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read().decode(errors="replace")
        logs.append({"key": obj["Key"], "size_bytes": int(obj["Size"]), "text": text})
    return sorted(logs, key=lambda log: log["key"])


def agent_view(cloud: Cloud, record: JobRecord, wait_s: float = 60.0) -> dict[str, Any]:
    """The agent's own view of the job on its current VM (`spotcr-agent status`, through the stack's SSM document):
    the job's process, its last checkpoint, its final dumps and its newest CRIU logs (on any storage)."""
    import time

    document = cloud.stack.status_document
    if not document:
        return {"error": f"stack {cloud.stack.name} has no StatusDocument output"}
    ssm = cloud.client("ssm")
    try:
        command = ssm.send_command(
            InstanceIds=[record.instance_id], DocumentName=document, Parameters={"JobId": [record.job_id]}
        )["Command"]["CommandId"]
    except Exception as error:
        return {"error": f"{record.instance_id} cannot be asked: {error}"}
    deadline = time.monotonic() + wait_s
    while True:
        time.sleep(1)
        try:
            invocation = ssm.get_command_invocation(CommandId=command, InstanceId=record.instance_id)
        except ssm.exceptions.InvocationDoesNotExist:
            invocation = {"Status": "Pending"}
        if invocation["Status"] not in ("Pending", "InProgress", "Delayed"):
            break
        if time.monotonic() > deadline:
            return {"error": f"the agent on {record.instance_id} did not answer within {wait_s:.0f} s"}
    try:
        view = results.parse_status(invocation.get("StandardOutputContent") or "")
    except results.InvalidResult as error:
        return {"error": f"{invocation['Status']}: {error}: {invocation.get('StandardErrorContent', '')[-400:]}"}
    return (
        {"error": view.error} if isinstance(view, results.CommandFailed) else {"ok": True, **dataclasses.asdict(view)}
    )


def instance_errors(cloud: Cloud, job_id: str) -> list[dict[str, str]]:
    """spotcr:error tags: why an instance's tags were refused."""
    out = []
    for instance in instances(cloud, job_id):
        for tag in instance.get("Tags", []):
            if tag.get("Key") == "spotcr:error":
                out.append({"what": f"instance {instance.get('InstanceId')}", "reason": tag.get("Value", "")})
    return out
