"""Periodic dumps: the every-minute scheduler and the rebalance recommendation."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError
from spotcr_contracts import commands

from spotcr_functions import exits
from spotcr_functions.deps import Deps
from spotcr_functions.models import JobRecord, Status
from spotcr_functions.observability import SERVICE
from spotcr_functions.registry import DUMP_SEQUENCE

logger = Logger(service=SERVICE, child=True)


def run_scheduler(deps: Deps) -> dict[str, Any]:
    now = deps.unix_now()
    ordered = []
    asked = []
    for record in deps.registry.due_jobs(now):
        if exits.ask_again(deps, record):
            asked.append(record.job_id)
        if _order_periodic(deps, record, expected_due=record.next_checkpoint_at):
            ordered.append(record.job_id)
    return {"ordered": ordered, "exits_asked": asked}


def on_rebalance(deps: Deps, instance_id: str) -> dict[str, Any]:
    """An early sign of interruption: take a periodic checkpoint now so that little work is at risk."""
    record = deps.registry.by_instance(instance_id)
    if record is None or record.status not in (Status.RUNNING, Status.CHECKPOINTING):
        logger.info("rebalance recommendation for no running job", instance_id=instance_id)
        return {"action": "ignored"}
    ordered = _order_periodic(deps, record, expected_due=None)
    return {"action": "checkpoint" if ordered else "ignored", "job_id": record.job_id}


def _order_periodic(deps: Deps, record: JobRecord, expected_due: int | None) -> bool:
    """Claim the checkpoint with a conditional write (one order per due time, however many schedulers run); the
    same write mints the dump's sequence, which orders it after every dump ordered before."""
    condition = "#generation = :g AND #instance = :i AND #status IN (:running, :checkpointing)"
    values: dict[str, Any] = {
        ":g": record.generation,
        ":i": record.instance_id,
        ":running": Status.RUNNING.value,
        ":checkpointing": Status.CHECKPOINTING.value,
    }
    if expected_due is not None:
        condition += " AND next_checkpoint_at = :due"
        values[":due"] = expected_due
    claimed = deps.registry.update(
        record.job_id,
        {
            "status": Status.CHECKPOINTING.value,
            "next_checkpoint_at": deps.unix_now() + record.interval_s,
            "updated_at": deps.iso_now(),
        },
        condition=condition,
        condition_values=values,
        add=(DUMP_SEQUENCE,),
    )
    if claimed is None:
        return False
    parameters = {
        "JobId": record.job_id,
        "Generation": str(record.generation),
        "Kind": "periodic",
        "RunId": record.run_id,
        "Sequence": str(claimed.dump_sequence),
    }
    try:
        deps.cloud.send_command(deps.settings.checkpoint_document, commands.CHECKPOINT, record.instance_id, parameters)
    except ClientError as error:
        logger.warning("periodic checkpoint not delivered", job_id=record.job_id, error=str(error))
        return False
    logger.info("periodic checkpoint ordered", job_id=record.job_id, generation=record.generation)
    return True
