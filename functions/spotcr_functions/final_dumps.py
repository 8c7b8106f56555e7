"""A wave's final-dump orders, sent in as few SendCommands as they fit.

When a capacity pool runs dry, every instance in it is warned within seconds. One SendCommand per job meets SSM's
rate long before the notice ends; one FINAL_DUMP command (spotcr_contracts.commands) carries up to 50 instances'
orders. So a warning sends its own order together with every order waiting in the registry's outbox (those a
throttle kept back from other senders), and puts back what a throttle keeps back from it.

Rules, enforced here and in Registry.queue_final_dumps / take_final_dumps:
1. An order is held by one sender (its warning's, until it first puts it in the outbox; or the sender whose take
   emptied the outbox, one atomic write), or is in the outbox, or is sent.
2. A sender sends its own orders with all it took, or puts back what a throttle kept it from sending; a warning's
   sender then tries again while SEND_S lasts. So a throttle makes the next command carry more orders instead of
   failing one.
3. A sender records each sent order's command on its job (Registry.record_final_dump_order), so that the answer is
   read from SSM even if its status-change event is lost (checkpoints.settle_final_dump).
4. An order SSM refuses for anything but its rate is not delivered: the job's final-dump wait resumes with
   FinalDumpNotDelivered, and the job restores from its newest committed checkpoint.
5. The workflow's final-dump wait sends the outbox too (recovery.order_deferred_final_dump); it sends its job's
   order as its own only once HOLD_S has passed since the warning with no command recorded (its sender died holding
   it). An order sent twice is harmless: the agent answers both commands with its one final dump.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError
from spotcr_contracts import commands
from spotcr_contracts.commands import FinalDumpOrder
from spotcr_contracts.protocol import parse_time

from spotcr_functions import rendezvous
from spotcr_functions.cloud import is_throttle
from spotcr_functions.deps import Deps
from spotcr_functions.models import JobRecord
from spotcr_functions.observability import SERVICE, Metric

logger = Logger(service=SERVICE, child=True)

SEND_S = 20.0  # how long a warning's sender keeps trying orders a throttle kept back (rule 2): within the notice
HOLD_S = 30.0  # from the warning, how long an unsent order is trusted to its sender (rule 5): past SEND_S
# A throttled sender's pauses (full jitter): from 0.2 s, doubling up to 1 s. SSM's bucket refills in fractions of a
# second, and a sender stops as soon as another one has taken the outbox.
FIRST_PAUSE_S, MAX_PAUSE_S = 0.2, 1.0


def order_of(record: JobRecord, instance_id: str) -> FinalDumpOrder:
    """The final dump the fencing write ordered on `instance_id` (its sequence minted by Registry.bump_generation)."""
    return FinalDumpOrder(instance_id, record.job_id, record.run_id, record.generation, record.dump_sequence)


def send(deps: Deps, own: Sequence[FinalDumpOrder] = (), for_s: float = 0.0) -> bool:
    """Send `own` orders with what the outbox holds (rule 2): once, or again after each throttle while `for_s`
    lasts. True when a throttle left orders in the outbox."""
    until = deps.now().timestamp() + for_s
    pause = FIRST_PAUSE_S
    held = set(own)
    while True:
        held |= {FinalDumpOrder.parse(text) for text in deps.registry.take_final_dumps()}
        if not held:
            return False
        kept = _send(deps, sorted(held, key=FinalDumpOrder.text))
        if not kept:
            return False
        deps.registry.queue_final_dumps([order.text() for order in kept])
        if deps.now().timestamp() + pause > until:
            return True
        deps.sleep(random.uniform(0, pause))  # noqa: S311 (jitter, not a secret)
        pause = min(2 * pause, MAX_PAUSE_S)
        held = set()


def _send(deps: Deps, orders: Sequence[FinalDumpOrder]) -> list[FinalDumpOrder]:
    """Send the orders in as few commands as they fit; returns those a throttle kept back."""
    kept: list[FinalDumpOrder] = []
    for batch in commands.order_batches(orders):
        if kept:
            kept += batch  # the bucket is empty: the rest waits for it too
            continue
        try:
            command_id = deps.cloud.send_final_dumps(deps.settings.final_dump_document, batch)
        except ClientError as error:
            if is_throttle(error):
                kept += batch
            elif len(batch) > 1:
                kept += [o for order in batch for o in _send(deps, [order])]  # find the order SSM refuses
            else:
                _not_delivered(deps, batch[0], error)
            continue
        logger.info("final dumps ordered", command_id=command_id, jobs=[o.job_id for o in batch])
        for order in batch:
            _record(deps, order, command_id)
    return kept


def _record(deps: Deps, order: FinalDumpOrder, command_id: str) -> None:
    """Rule 3; the warning-to-command latency of each order that is still its job's."""
    sent = {"command_id": command_id, "instance_id": order.instance_id, "generation": order.generation}
    record = deps.registry.record_final_dump_order(order.job_id, order.generation, sent)
    if record is not None and record.interrupted_at:
        latency = (deps.now() - parse_time(record.interrupted_at)).total_seconds()
        deps.metric(Metric.INTERRUPTION_TO_DUMP_SECONDS, "Seconds", max(latency, 0.0))


def _not_delivered(deps: Deps, order: FinalDumpOrder, error: ClientError) -> None:
    """Rule 4."""
    logger.warning("final dump command not delivered; recovering from the newest checkpoint", job_id=order.job_id)
    cause = f"the final-dump command was not delivered to {order.instance_id}: {error}"[:1000]
    rendezvous.arrive(
        deps, order.job_id, "final-dump", order.generation, {}, error="FinalDumpNotDelivered", cause=cause
    )
