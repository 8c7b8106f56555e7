"""The job registry's one data-access layer: every change to a job record is a named transition, one conditional
DynamoDB write whose typed condition enforces a rule of the job-record protocol (spotcr_contracts.protocol, whose
numbered rules the transitions cite). No other module writes a job record with a condition
(tests/functions/test_registry_transitions.py checks the source)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from functools import cached_property
from typing import Any

from boto3.dynamodb.conditions import Attr, ConditionBase, ConditionExpressionBuilder
from spotcr_contracts import commands
from spotcr_contracts.nodes import NodeRecord

from spotcr_functions import registry_schema
from spotcr_functions.cloud import CLIENT_CONFIG
from spotcr_functions.models import (
    ACTIVE,
    ENDED,
    JobRecord,
    Status,
    event_attribute,
    lost_node_attribute,
    token_attribute,
)


def restore_key(attempt: str) -> str:
    """The rendezvous of one restore attempt: each attempt has its own token and its own answer, so a duplicated
    or late answer to attempt N (a RestoreFailed redelivered) never completes attempt N+1's token."""
    return "restore" if attempt in ("", commands.RESTORE_ATTEMPTS[0]) else f"restore-{attempt}"


def _final_dump_intent(instance_id: str, generation: int, ordered: bool) -> dict[str, Any]:
    """What a fencing write sets for a warning's final dump (`ordered`): the order decided but not sent yet (no
    command_id), which the workflow's final-dump wait sends (recovery.order_deferred_final_dump) unless the
    warning's send records its command first. Nothing for a fencing write that orders no final dump."""
    return {FINAL_DUMP_COMMAND: {"instance_id": instance_id, "generation": generation}} if ordered else {}


def early_ready_key(instance_id: str) -> str:
    """Where a ready report waits when it came before the recovery recorded its instance as the backup (rule 9):
    one key per instance, so that no other instance's report replaces the backup's."""
    return f"ready-{instance_id}"


RESTORE_KEYS = tuple(restore_key(a) for a in commands.RESTORE_ATTEMPTS)
WAIT_KEYS = ("final-dump", "backup-ready", *RESTORE_KEYS)  # what a workflow step waits for
# The job record's counter of dump and restore orders (JobRecord.dump_sequence): every write that orders one increments
# it in the same conditional write (Registry._write's `add`), so each order gets its own sequence
# (commands.checkpoint_order).
DUMP_SEQUENCE = "dump_sequence"
# Where the record keeps the final-dump command a warning sent (its CommandId, instance, generation): SSM's answer to
# it is read when its status-change event comes, or by the Restore step when it never came (settle_final_dump).
FINAL_DUMP_COMMAND = "command_final_dump"
# The outbox of final-dump orders not yet sent (final_dumps): one item outside every job's name (job ids start with a
# letter or digit), whose string set ORDERS each warning adds its order to. No status or instance_id: no index holds it.
OUTBOX_KEY = "#final-dumps"
ORDERS = "orders"
# The status command sent to the instance said to have ended the job (agent_events.ask_exit).
EXIT_CLAIM = "exit_claim"
RUNS = (Status.RUNNING, Status.CHECKPOINTING)  # the job runs on its instance, which may be ordered a periodic dump
# What every fencing write clears: the previous generation's schedule, backup, hand-over, restore order and waits.
FENCE_CLEARS = (
    "next_checkpoint_at",
    "restore_ordered_at",
    "backup_instance_id",
    "backup_az",
    "handover_snapshot_id",
    "handover_volume_id",
    *(token_attribute(k) for k in WAIT_KEYS),
    *(event_attribute(k) for k in WAIT_KEYS),
)


class StaleGeneration(Exception):
    """The job moved on to another generation (or away from this instance): this work is no longer wanted."""


class Registry:
    def __init__(self, table_name: str, session: Any = None) -> None:
        self.table_name = table_name
        self._session = session

    @cached_property
    def table(self) -> Any:
        import boto3

        return (self._session or boto3).resource("dynamodb", config=CLIENT_CONFIG).Table(self.table_name)

    @cached_property
    def _conditional_failure(self) -> type[Exception]:
        return self.table.meta.client.exceptions.ConditionalCheckFailedException

    def get(self, job_id: str) -> JobRecord | None:
        item = self.table.get_item(Key={registry_schema.PARTITION_KEY: job_id}, ConsistentRead=True).get("Item")
        return JobRecord.from_item(item) if item else None

    def by_instance(self, instance_id: str) -> JobRecord | None:
        """The job whose current instance this is (then read consistently from the table)."""
        response = self.table.query(
            IndexName=registry_schema.BY_INSTANCE.name,
            KeyConditionExpression="instance_id = :i",
            ExpressionAttributeValues={":i": instance_id},
        )
        for item in response.get("Items", []):
            record = self.get(item[registry_schema.PARTITION_KEY])
            if record and record.instance_id == instance_id:
                return record
        return None

    def register(self, record: JobRecord) -> JobRecord:
        """Insert a new job, or replace a finished one of the same name; returns the registered record."""
        try:
            new_or_ended = Attr(registry_schema.PARTITION_KEY).not_exists() | _status_in(ENDED)
            self.table.put_item(Item=record.to_item(), **_condition_arguments(new_or_ended))
        except self._conditional_failure:
            existing = self.get(record.job_id)
            if existing is None:
                raise
            return existing
        return record

    def update(self, job_id: str, set_values: Mapping[str, Any], remove: tuple[str, ...] = ()) -> JobRecord | None:
        """An unconditional write, for tests and tools that set a record up; the protocol's writes are below."""
        return self._write(job_id, set_values, remove)

    def _write(
        self,
        job_id: str,
        set_values: Mapping[str, Any],
        remove: tuple[str, ...] = (),
        condition: ConditionBase | None = None,
        *,
        add: tuple[str, ...] = (),
    ) -> JobRecord | None:
        """One UpdateItem; returns the new record, or None when the condition failed. Each attribute in `add` is a
        counter that the same write increments (DynamoDB's ADD: atomic, 1 when it was absent)."""
        names: dict[str, str] = {}
        values: dict[str, Any] = {}
        clauses = []
        for index, (attribute, value) in enumerate(set_values.items()):
            values[f":set{index}"] = value
            clauses.append(f"{_path(names, f'set{index}', attribute)} = :set{index}")
        expression = ("SET " + ", ".join(clauses)) if clauses else ""
        if remove:
            paths = [_path(names, f"remove{index}", attribute) for index, attribute in enumerate(remove)]
            expression += " REMOVE " + ", ".join(paths)
        if add:
            names |= {f"#add{index}": attribute for index, attribute in enumerate(add)}
            values[":one"] = 1
            expression += " ADD " + ", ".join(f"#add{index} :one" for index in range(len(add)))
        arguments: dict[str, Any] = {
            "Key": {registry_schema.PARTITION_KEY: job_id},
            "UpdateExpression": expression.strip(),
            "ExpressionAttributeNames": names,
            "ReturnValues": "ALL_NEW",
        }
        if condition is not None:
            built = _condition_arguments(condition)
            arguments["ConditionExpression"] = built["ConditionExpression"]
            names |= built["ExpressionAttributeNames"]
            values |= built.get("ExpressionAttributeValues", {})
        if values:
            arguments["ExpressionAttributeValues"] = values
        try:
            response = self.table.update_item(**arguments)
        except self._conditional_failure:
            return None
        return JobRecord.from_item(response["Attributes"])

    # Registration and start (rules 2 and 10).

    def record_volume(self, job_id: str, instance_id: str, volume_id: str) -> JobRecord | None:
        """The job's EBS volume, created for the instance that registered it."""
        return self._write(job_id, {"volume_id": volume_id}, condition=Attr("instance_id").eq(instance_id))

    def record_node_volume(self, job_id: str, index: int, instance_id: str, volume_id: str) -> JobRecord | None:
        """Node `index`'s EBS volume (a job over several VMs, one volume per node), created for the instance that
        holds the node."""
        condition = Attr(f"nodes.{index}.instance_id").eq(instance_id)
        return self._write(job_id, {f"nodes.{index}.volume_id": volume_id}, condition=condition)

    def record_access_point(self, job_id: str, run_id: str, access_point_arn: str) -> JobRecord | None:
        """The run's EFS access point, unless another registration of the run stored its own or the run ended."""
        kept = Attr("access_point_arn").not_exists() | Attr("access_point_arn").eq(access_point_arn)
        condition = Attr("run_id").eq(run_id) & ~_status_in(ENDED) & kept
        return self._write(job_id, {"access_point_arn": access_point_arn}, condition=condition)

    def join_node(
        self, seen: JobRecord, node: NodeRecord, at: str, coordinator: Mapping[str, Any] | None = None
    ) -> JobRecord | None:
        """A node of a job over several VMs joins the run the first node's registration minted (the first node is
        in the record `register` put): only while that run (rule 3) is PENDING at its generation (rule 2) with the
        same node count, and only into an index no other instance holds (the same instance joining again is a
        duplicate event: the same write). Node 0's join makes its instance the job's, with `coordinator`'s values
        (its type and image). None: refused, re-read to say why."""
        path = f"nodes.{node.index}"
        free = Attr(path).not_exists() | Attr(f"{path}.instance_id").eq(node.instance_id)
        condition = Attr("run_id").eq(seen.run_id) & _at(seen.generation, Status.PENDING) & free
        condition &= Attr("node_count").eq(seen.node_count)
        values = {path: node.to_item(), "updated_at": at}
        if node.index == 0:
            values |= {"instance_id": node.instance_id, **(coordinator or {})}
        return self._write(seen.job_id, values, condition=condition)

    def mark_started(self, seen: JobRecord, next_checkpoint_at: int, at: str) -> JobRecord | None:
        """PENDING to RUNNING: the job started on its instance; its first periodic dump is due at next_checkpoint_at."""
        values = {"status": Status.RUNNING.value, "next_checkpoint_at": next_checkpoint_at, "updated_at": at}
        return self._write(seen.job_id, values, condition=_at(seen.generation, Status.PENDING))

    # Periodic dumps and checkpoints (rules 2, 4 and 6).

    def claim_periodic_dump(self, seen: JobRecord, expected_due: int | None, next_at: int, at: str) -> JobRecord | None:
        """Order one periodic dump per due time, however many schedulers run (expected_due None: now, whatever is
        due); the same write mints the dump's sequence (rule 4)."""
        condition = _running_on(seen.generation, seen.instance_id)
        if expected_due is not None:
            condition &= Attr("next_checkpoint_at").eq(expected_due)
        values = {"status": Status.CHECKPOINTING.value, "next_checkpoint_at": next_at, "updated_at": at}
        return self._write(seen.job_id, values, condition=condition, add=(DUMP_SEQUENCE,))

    def settle_periodic_dump(self, seen: JobRecord, at: str) -> JobRecord | None:
        """CHECKPOINTING to RUNNING: the periodic dump ordered reported (committed or failed)."""
        values = {"status": Status.RUNNING.value, "updated_at": at}
        return self._write(seen.job_id, values, condition=_at(seen.generation, Status.CHECKPOINTING))

    def record_plan(
        self, seen: JobRecord, instance_id: str, plan: Mapping[str, Any], *, at_risk: bool
    ) -> JobRecord | None:
        """The agent's deadline plan from the instance that runs the job (final_dump_risk cleared when it fits)."""
        remove = () if at_risk else ("final_dump_risk",)
        return self._write(seen.job_id, plan, remove, condition=_running_on(seen.generation, instance_id))

    def record_checkpoint(self, seen: JobRecord, checkpoint_id: str, instance_id: str, at: str) -> JobRecord | None:
        """The job's newest checkpoint (rule 6), if the record is still exactly as `seen`: generation, status,
        instance, newest checkpoint, and while it recovers no restore ordered. The one it replaces is the fallback."""
        condition = _at(seen.generation, seen.status) & Attr("instance_id").eq(seen.instance_id)
        values: dict[str, Any] = {"checkpoint_id": checkpoint_id, "checkpoint_instance_id": instance_id}
        values["updated_at"] = at
        if seen.checkpoint_id:
            condition &= Attr("checkpoint_id").eq(seen.checkpoint_id)
            values["previous_checkpoint_id"] = seen.checkpoint_id
        else:
            condition &= Attr("checkpoint_id").not_exists()
        if seen.status == Status.RECOVERING:
            condition &= Attr("restore_ordered_at").not_exists()
        return self._write(seen.job_id, values, condition=condition)

    # Exits and ends (rules 10 to 12).

    def record_exit_claim(self, seen: JobRecord, claim: Mapping[str, Any], at: str) -> JobRecord | None:
        """The status command sent to the instance said to have ended the job (exits.ask_again asks again)."""
        values = {EXIT_CLAIM: claim, "updated_at": at}
        return self._write(seen.job_id, values, condition=_at(seen.generation, seen.status))

    def end(self, seen: JobRecord, status: Status, values: Mapping[str, Any]) -> JobRecord | None:
        """End the job (COMPLETED, FAILED or CANCELLED) if it is still exactly as `seen` (None when it moved: re-read,
        retry): the first end wins and an ended record is never written again (rule 10)."""
        if status not in ENDED:
            raise ValueError(f"{status} is not an end")
        if seen.status in ENDED:
            raise ValueError(f"job {seen.job_id} already ended {seen.status}: an ended record is never written again")
        backup = (
            Attr("backup_instance_id").eq(seen.backup_instance_id)
            if seen.backup_instance_id
            else Attr("backup_instance_id").not_exists()
        )
        condition = _at(seen.generation, seen.status) & Attr("instance_id").eq(seen.instance_id) & backup
        return self._write(seen.job_id, {"status": status.value, **values}, ("next_checkpoint_at",), condition)

    def forget_volume(self, job_id: str, generation: int, at: str, node: int | None = None) -> JobRecord | None:
        """A finished job's volume (`node`: that node's) was deleted with its instance."""
        attribute = "volume_id" if node is None else f"nodes.{node}.volume_id"
        return self._write(job_id, {"updated_at": at}, (attribute,), _at(generation))

    # Fencing (rule 1).

    def bump_generation(
        self,
        job_id: str,
        instance_id: str,
        generation: int,
        at: str,
        read: JobRecord | None = None,
        *,
        final_dump: bool = False,
    ) -> JobRecord | None:
        """The fencing write: generation+1 once per interrupted instance, only while that instance is current.
        `final_dump` (a warning's): the same write records that a final dump is to be ordered on the instance, so a
        retry after a crash before the order was sent or recorded still waits for it (recovery._already_recovering).

        An early final dump (the agent took it on its own IMDS notice and it was recorded before this write) is
        kept: its arrival moves to the new generation, so recovery restores it at once instead of waiting for a
        final dump that was already taken. The write is conditional on the arrival it read, and re-read on a race.
        `read`: the record as the caller just read it consistently (the first try writes from it, one GetItem less
        before the final dump is ordered); a failed condition re-reads it.
        """
        for _ in range(5):
            record, read = read or self.get(job_id), None
            if record is None or record.instance_id != instance_id or record.generation != generation:
                return None
            if record.status not in ACTIVE or record.recovering_from == instance_id:
                return None
            early = _early_final_dump(record, instance_id)
            carried = {event_attribute("final-dump"): {**early, "generation": generation + 1}} if early else {}
            arrival = record.arrival("final-dump")
            if arrival:
                checkpoint = (arrival.get("output") or {}).get("checkpoint_id")
                at_path = f"{event_attribute('final-dump')}.output.checkpoint_id"
                same_arrival = Attr(f"{event_attribute('final-dump')}.generation").eq(arrival.get("generation")) & (
                    Attr(at_path).eq(checkpoint) if checkpoint else Attr(at_path).not_exists()
                )
            else:
                same_arrival = Attr(event_attribute("final-dump")).not_exists()
            condition = (
                Attr("instance_id").eq(instance_id)
                & _at(generation, record.status)
                & (Attr("recovering_from").not_exists() | Attr("recovering_from").ne(instance_id))
                & same_arrival
            )
            ordered = _final_dump_intent(instance_id, generation + 1, final_dump)
            bumped = self._write(
                job_id,
                {**_fenced(generation, instance_id, at), "status": Status.RECOVERING.value, **carried, **ordered},
                tuple(a for a in FENCE_CLEARS if a not in carried),
                condition,
                add=(DUMP_SEQUENCE,),  # the final dump this warning orders
            )
            if bumped is not None:
                return bumped
        return None

    def bump_node(self, job_id: str, instance_id: str, at: str, *, final_dump: bool = False) -> JobRecord | None:
        """The fencing write of a job over several VMs: generation+1 once per interrupted node, only while the job is
        active and `instance_id` holds that node. `interrupted_node` names the node whose share the backup takes over;
        a warning's final dump is ordered to node 0's instance (rule 6, `final_dump_taker`), whose agent dumps every
        node. Its agents take no final dump on their own notice, so no early one is carried. None: not active on
        that node (a duplicate, or the job moved on)."""
        for _ in range(5):  # a periodic dump's claim or settlement may move the status between the read and the write
            record = self.get(job_id)
            node = record.node_of(instance_id) if record else None
            if record is None or node is None or record.status not in ACTIVE:
                return None
            condition = _at(record.generation, record.status) & Attr(f"nodes.{node.index}.instance_id").eq(instance_id)
            values = {
                **_fenced(record.generation, instance_id, at),
                "status": Status.RECOVERING.value,
                "interrupted_node": node.index,
                **_final_dump_intent(record.instance_id, record.generation + 1, final_dump),
            }
            bumped = self._write(
                job_id, values, (*FENCE_CLEARS, *lost_attributes(record)), condition, add=(DUMP_SEQUENCE,)
            )
            if bumped is not None:
                return bumped
        return None

    def bump_backup(self, seen: JobRecord, at: str, *, final_dump: bool = False) -> JobRecord | None:
        """The fencing write for a backup lost while it restores: generation+1, recovering from that backup (and, on
        its warning, `final_dump` as in bump_generation)."""
        condition = _at(seen.generation, Status.RECOVERING) & Attr("backup_instance_id").eq(seen.backup_instance_id)
        taker = seen.instance_id if seen.node_count else str(seen.backup_instance_id)  # rule 6: final_dump_taker
        ordered = _final_dump_intent(taker, seen.generation + 1, final_dump)
        return self._write(
            seen.job_id,
            {**_fenced(seen.generation, seen.backup_instance_id, at), **ordered},
            # The handed-over EBS volume (if any) stays named: it holds the job's data and moves on from the backup.
            tuple(a for a in FENCE_CLEARS if a not in ("next_checkpoint_at", "handover_volume_id")),
            condition,
            add=(DUMP_SEQUENCE,),  # the final dump the backup's warning may order
        )

    def fence_for_restore(
        self, seen: JobRecord, checkpoint_id: str, previous_checkpoint_id: str | None, at: str
    ) -> JobRecord | None:
        """A user's restore (spotcr restore): the fencing write of an active or ended job, recovering from its
        instance, naming the checkpoint the restore starts its walk from (and the one before it, if any)."""
        chosen = {"checkpoint_id": checkpoint_id}
        if previous_checkpoint_id:
            chosen["previous_checkpoint_id"] = previous_checkpoint_id
        return self._write(
            seen.job_id,
            {**_fenced(seen.generation, seen.instance_id, at), "status": Status.RECOVERING.value, **chosen},
            (*FENCE_CLEARS, *lost_attributes(seen), *(() if previous_checkpoint_id else ("previous_checkpoint_id",))),
            _at(seen.generation, seen.status),
        )

    # The recovery workflow's steps, each for the generation it recovers (rules 2, 5, 8, 9 and 12).

    def record_final_dump_order(self, job_id: str, generation: int, ordered: Mapping[str, Any]) -> JobRecord | None:
        """The final-dump command a warning sent, read from SSM when its answer is lost (settle_final_dump)."""
        return self._write(job_id, {FINAL_DUMP_COMMAND: ordered}, condition=_at(generation))

    def queue_final_dumps(self, orders: Collection[str]) -> None:
        """Put final-dump orders in the outbox (final_dumps rule 1): DynamoDB's ADD to a set, atomic, creating it."""
        if not orders:
            return
        self.table.update_item(
            Key={registry_schema.PARTITION_KEY: OUTBOX_KEY},
            UpdateExpression="ADD #orders :orders",
            ExpressionAttributeNames={"#orders": ORDERS},
            ExpressionAttributeValues={":orders": set(orders)},
        )

    def take_final_dumps(self) -> set[str]:
        """Take every order in the outbox in one atomic write: no other take gets any of them (final_dumps rule 1)."""
        response = self.table.update_item(
            Key={registry_schema.PARTITION_KEY: OUTBOX_KEY},
            UpdateExpression="REMOVE #orders",
            ExpressionAttributeNames={"#orders": ORDERS},
            ReturnValues="UPDATED_OLD",
        )
        return {str(order) for order in (response.get("Attributes") or {}).get(ORDERS, ())}

    def record_backup(self, job_id: str, generation: int, instance_id: str, az: str, at: str) -> JobRecord | None:
        """The backup launched for this generation (None: the job moved on, terminate it)."""
        values = {"backup_instance_id": instance_id, "backup_az": az, "updated_at": at}
        return self._write(job_id, values, condition=_at(generation, Status.RECOVERING))

    def keep_early_ready(
        self, job_id: str, generation: int, instance_id: str, at: str, *, error: str = "", cause: str = ""
    ) -> JobRecord | None:
        """A readiness report (ready, or `error` BootstrapFailed with its `cause`) from an instance not recorded as
        the backup, kept while this generation recovers and has no backup recorded, or has recorded this one in
        between (None: another backup, or the job moved on)."""
        no_other_backup = Attr("backup_instance_id").not_exists() | Attr("backup_instance_id").eq(instance_id)
        return self.note_ready(job_id, generation, instance_id, at, error=error, cause=cause, only_if=no_other_backup)

    def record_image_warning(self, job_id: str, generation: int, warning: str) -> JobRecord | None:
        """Why this generation's backup launched from the template's image."""
        return self._write(job_id, {"image_warning": warning}, condition=_at(generation))

    def record_handover(
        self, job_id: str, generation: int, *, snapshot_id: str = "", volume_id: str = ""
    ) -> JobRecord | None:
        """A step of the EBS hand-over to another AZ: the snapshot taken, then the volume made from it."""
        values = {"handover_snapshot_id": snapshot_id} if snapshot_id else {"handover_volume_id": volume_id}
        return self._write(job_id, values, condition=_at(generation))

    def move_node(self, job_id: str, generation: int, index: int, instance_id: str, at: str) -> JobRecord | None:
        """A job over several VMs: the interrupted node's address now belongs to its backup (EC2 moved it, after
        rule 8 held for the interrupted instance), so the node is the backup's from here on. Only the recorded backup
        of this generation's interrupted node."""
        condition = _at(generation, Status.RECOVERING) & Attr("backup_instance_id").eq(instance_id)
        condition &= Attr("interrupted_node").eq(index)
        return self._write(job_id, {f"nodes.{index}.instance_id": instance_id, "updated_at": at}, condition=condition)

    def add_lost_node(self, seen: JobRecord, index: int, instance_id: str, at: str) -> JobRecord | None:
        """Another node of a job over several VMs went while this recovery runs, before its restore was ordered: the
        same restore brings it back, on a backup of its own (no new generation: the checkpoint is the job's, and
        every node is restored from it). Once per node, only while `instance_id` still holds it. None otherwise."""
        attribute = lost_node_attribute(index)
        condition = _at(seen.generation, Status.RECOVERING) & Attr("restore_ordered_at").not_exists()
        condition &= Attr(f"nodes.{index}.instance_id").eq(instance_id) & Attr("interrupted_node").ne(index)
        condition &= Attr(attribute).not_exists()
        return self._write(
            seen.job_id, {attribute: {"instance_id": instance_id}, "updated_at": at}, condition=condition
        )

    def record_lost_backup(self, job_id: str, generation: int, index: int, backup: str, at: str) -> JobRecord | None:
        """The backup launched for a lost node (None: the job moved on or another backup is recorded: terminate it)."""
        attribute = lost_node_attribute(index)
        condition = _at(generation, Status.RECOVERING) & Attr(attribute).exists()
        condition &= Attr(f"{attribute}.backup").not_exists() | Attr(f"{attribute}.backup").eq(backup)
        return self._write(job_id, {f"{attribute}.backup": backup, "updated_at": at}, condition=condition)

    def note_ready(
        self,
        job_id: str,
        generation: int,
        instance_id: str,
        at: str,
        *,
        error: str = "",
        cause: str = "",
        only_if: ConditionBase | None = None,
    ) -> JobRecord | None:
        """A backup's readiness report (ready, or `error` BootstrapFailed with its `cause`) kept by instance while
        this generation recovers (and `only_if` holds): the restore step reads a lost node's backup's from here
        (None: moved on)."""
        output = {} if error else {"instance_id": instance_id}
        report = {"output": output, "error": error, "cause": cause, "at": at, "generation": generation}
        values = {event_attribute(early_ready_key(instance_id)): report}
        condition = _at(generation, Status.RECOVERING)
        return self._write(job_id, values, condition=condition if only_if is None else condition & only_if)

    def move_lost_node(self, job_id: str, generation: int, index: int, backup: str, at: str) -> JobRecord | None:
        """As move_node, for a lost node: its address now belongs to its recorded backup."""
        condition = _at(generation, Status.RECOVERING) & Attr(f"{lost_node_attribute(index)}.backup").eq(backup)
        return self._write(job_id, {f"nodes.{index}.instance_id": backup, "updated_at": at}, condition=condition)

    def close_generation(self, job_id: str, generation: int, at: str) -> JobRecord | None:
        """The recovery orders a restore: from now on the interrupted instance's checkpoints of this generation are
        late and never recorded (rule 6), so the checkpoint chosen from the returned record is the newest the job
        will ever have at this generation until the backup commits its own. The same write mints the restore
        order's sequence, above every dump the interrupted instance was ordered (rule 5). None when stale."""
        values = {"restore_ordered_at": at, "updated_at": at}
        return self._write(job_id, values, condition=_at(generation, Status.RECOVERING), add=(DUMP_SEQUENCE,))

    def record_restore_order(
        self, job_id: str, generation: int, attribute: str, ordered: Mapping[str, Any]
    ) -> JobRecord | None:
        """The restore command one attempt sent to the backup."""
        return self._write(job_id, {attribute: ordered}, condition=_at(generation, Status.RECOVERING))

    def finish_recovery(
        self,
        job_id: str,
        generation: int,
        values: Mapping[str, Any],
        *,
        backup: str | None = None,
        seen: JobRecord | None = None,
    ) -> JobRecord | None:
        """The job runs again on values' instance_id (the backup; node 0's for a job over several VMs): RUNNING again
        at this generation (None: the job moved on). The backup's ready report kept before it was recorded, if any,
        is done with, and so are the lost nodes `seen` names, with their backups' reports."""
        handed_over = ("backup_instance_id", "backup_az", "handover_snapshot_id", "handover_volume_id")
        early_ready = event_attribute(early_ready_key(str(backup or values["instance_id"])))
        running = {"status": Status.RUNNING.value, **values}
        remove = (*handed_over, "restore_ordered_at", "interrupted_node", early_ready, *lost_attributes(seen))
        return self._write(job_id, running, remove, _at(generation, Status.RECOVERING))

    def fail_recovery(self, job_id: str, generation: int, reason: str, at: str) -> JobRecord | None:
        """The recovery of this generation gave up: FAILED, unless the job moved on or ended meanwhile (rule 12)."""
        values = {"status": Status.FAILED.value, "reason": reason, "updated_at": at}
        return self._write(job_id, values, ("next_checkpoint_at",), _at(generation, Status.RECOVERING))

    def due_jobs(self, now: int) -> list[JobRecord]:
        """Jobs whose periodic checkpoint is due: RUNNING ones, and CHECKPOINTING ones whose dump never reported."""
        return self._due((Status.RUNNING, Status.CHECKPOINTING), now)

    def overdue_pending(self, now: int) -> list[JobRecord]:
        """PENDING jobs past the deadline to start that registration set (none without one: pending_timeout 0)."""
        return self._due((Status.PENDING,), now)

    def _due(self, statuses: tuple[Status, ...], now: int) -> list[JobRecord]:
        records = []
        for status in statuses:
            arguments: dict[str, Any] = {
                "IndexName": registry_schema.BY_STATUS.name,
                "KeyConditionExpression": "#s = :s AND next_checkpoint_at <= :now",
                "ExpressionAttributeNames": {"#s": "status"},
                "ExpressionAttributeValues": {":s": status.value, ":now": now},
            }
            while True:
                response = self.table.query(**arguments)
                records += [JobRecord.from_item(item) for item in response.get("Items", [])]
                if "LastEvaluatedKey" not in response:
                    break
                arguments["ExclusiveStartKey"] = response["LastEvaluatedKey"]
        return records

    def store_token(self, job_id: str, key: str, generation: int, token: str) -> JobRecord:
        """The waiter's half of the rendezvous (each restore attempt waits under its own key: restore_key)."""
        record = self._write(
            job_id,
            {token_attribute(key): {"token": token, "generation": generation}},
            condition=_at(generation, Status.RECOVERING),
        )
        if record is None:
            raise StaleGeneration(f"job {job_id} is no longer at generation {generation}")
        return record

    def record_arrival(self, job_id: str, key: str, generation: int, arrival: Mapping[str, Any]) -> JobRecord | None:
        """The event's half of the rendezvous; None when the job is at another generation."""
        values = {event_attribute(key): {**arrival, "generation": generation}}
        return self._write(job_id, values, condition=_at(generation))


def _condition_arguments(condition: ConditionBase) -> dict[str, Any]:
    """The write's ConditionExpression with its placeholders (#n0, :v0, ...), built by a builder of its own. boto3's
    Table builds a condition with one builder per resource, reset at each call: two threads writing through one
    resource take each other's placeholders, and a write is refused, or allowed, on a condition nobody wrote. Lambda
    runs one invocation at a time per execution environment; the local AWS runs concurrent invocations in one process
    with the handlers' cached Registry, where a wave saw a backup's launch refused although its job had not moved on
    (tests/functions/test_registry_transitions.py)."""
    built = ConditionExpressionBuilder().build_expression(condition)
    arguments: dict[str, Any] = {
        "ConditionExpression": built.condition_expression,
        "ExpressionAttributeNames": built.attribute_name_placeholders,
    }
    if built.attribute_value_placeholders:
        arguments["ExpressionAttributeValues"] = built.attribute_value_placeholders
    return arguments


def lost_attributes(record: JobRecord | None) -> tuple[str, ...]:
    """The lost nodes this record names and their backups' ready reports: cleared when its recovery ends and by
    the next fencing write, so that no later recovery takes them for its own."""
    if record is None:
        return ()
    lost = record.lost_nodes
    reports = (event_attribute(early_ready_key(node.backup)) for node in lost.values() if node.backup)
    return (*(lost_node_attribute(index) for index in lost), *reports)


def _path(names: dict[str, str], tag: str, attribute: str) -> str:
    """The placeholder path of an attribute in an update expression, its names added to `names`: a dotted
    attribute is a path into a map (nodes.2.volume_id), one name placeholder per part."""
    parts = attribute.split(".")
    names |= {f"#{tag}_{part}": name for part, name in enumerate(parts)}
    return ".".join(f"#{tag}_{part}" for part in range(len(parts)))


def _at(generation: int, status: Status | None = None) -> ConditionBase:
    """Rule 2: the record is still at this generation (and, if named, in this status)."""
    condition = Attr("generation").eq(generation)
    return condition & Attr("status").eq(status.value) if status else condition


def _running_on(generation: int, instance_id: str) -> ConditionBase:
    """The job runs (or dumps) on this instance at this generation."""
    return Attr("generation").eq(generation) & Attr("instance_id").eq(instance_id) & _status_in(RUNS)


def _status_in(statuses: tuple[Status, ...]) -> ConditionBase:
    return Attr("status").is_in([s.value for s in statuses])


def _fenced(generation: int, recovering_from: str | None, at: str) -> dict[str, Any]:
    """What every fencing write sets (rule 1): the next generation, recovering from the instance that was lost."""
    return {"generation": generation + 1, "recovering_from": recovering_from, "interrupted_at": at, "updated_at": at}


def _early_final_dump(record: JobRecord, instance_id: str) -> dict[str, Any] | None:
    """The final dump `instance_id` committed at the generation being bumped, if it arrived before the bump."""
    arrival = record.arrival("final-dump")
    if not arrival or arrival.get("error") or arrival.get("generation") != record.generation:
        return None
    output = arrival.get("output") or {}
    return arrival if output.get("instance_id") == instance_id and output.get("checkpoint_id") else None
