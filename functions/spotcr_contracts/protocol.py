"""The job-record protocol: who may move a job, in which order, and how it ends.

One item of the registry (the job record, `spotcr_functions.models.JobRecord`) is the job's state. Every change
to it is one conditional DynamoDB write, a named transition of the one data-access layer
(`spotcr_functions.registry.Registry`); the predicates below decide, from a record as read, whether an event may
move it, and the transition's condition checks the same thing again at the write. The words MUST, MUST NOT and
SHOULD are used as in RFC 2119.

Fencing
1. The generation is the fencing token. It MUST be raised only by a fencing write: an interruption of the job's
   instance (`Registry.bump_generation`, once per interrupted instance), the loss of a backup while it restores
   (`Registry.bump_backup`), or a user's restore (`Registry.fence_for_restore`). Each fencing write moves the job
   to RECOVERING and clears the previous generation's waits.
2. A write made on behalf of a generation MUST be conditional on the record still being at that generation: a
   zombie primary, a superseded recovery workflow or a late scheduler never moves a newer generation. A workflow
   step refused so leaves as `StaleGeneration`; the workflow then MUST fail the job if it still sits RECOVERING at
   the workflow's generation (the refusal was wrong), and notify, rather than end with the job left RECOVERING
   (`statemachines/recovery.asl.json` `Superseded`,
   `test_a_step_told_the_job_moved_on_when_it_had_not_fails_the_job_and_notifies`).
3. An event or a command's report MUST carry the job's run id (`of_this_run`): another run of the same job name
   never moves this one. It MUST carry the record's generation, except the interrupted primary's last checkpoint
   and exit, which may carry the generation just fenced.

Order
4. Checkpoints MUST be ordered by (generation, sequence) (`is_newer`), both minted by the control plane with the
   dump or restore order and carried in the checkpoint's id, never by a VM's clock. The sequence
   (`dump_sequence`) MUST be incremented by the same write that orders the dump or restore.
5. The restore order MUST mint a sequence above every dump the interrupted instance was ordered, so the
   backup's checkpoints rank after all of the interrupted instance's.

Who may record
6. A checkpoint MUST be recorded as the job's newest only when its instance may record (`may_record`): the
   instance that runs the job while it is active, or while it recovers the one that takes the final dump
   (`final_dump_taker`: the interrupted instance; for a job over several VMs node 0's, whose agent dumps every
   node) until the restore is ordered (`Registry.close_generation`). After that its dumps are late and MUST
   NOT be recorded. The checkpoint it replaces becomes the fallback for a failed restore.
7. Only facts from authenticated sources MUST move the job: a checkpoint, a restore and an exit are taken from
   SSM's report of a command on that instance, never from an event a job VM can put on the bus.

One live copy
8. A checkpoint MUST NOT be restored until the interrupted instance's copy of the job is known gone: it is
   terminated, stopped, or its final dump at this generation ended the job there (`job_gone_from`) and it was
   not started again since the warning (`restarted`). For a job over several VMs this holds for the interrupted
   node's instance and for each node lost while it recovers before its restore is ordered
   (`Registry.add_lost_node`, a backup of its own each); every other node's share ends by the final dump, or by
   its agent before it restores. A node lost after the restore is ordered fails the recovery (rule 12).
9. A backup MUST be recorded only while its generation recovers (`Registry.record_backup`,
   `Registry.record_lost_backup`); a backup launched
   for a generation that moved on SHOULD be terminated at once. Only the recorded backup's ready report (or its
   failed boot) MUST move the recovery, and no such report MUST be lost to the order of the two: one that comes
   while no backup is recorded is kept under its instance's id (`Registry.keep_early_ready`) and moves the
   recovery only when the write that records that instance as the backup finds it, or when its own write finds
   the instance recorded.

Exactly one end
10. A job MUST end (COMPLETED, FAILED or CANCELLED) by one write conditional on the record as read: the first
    such write wins, and a record that ended MUST NOT be written again by any end (`exit_ends_job` is None).
    Only a new registration of the same name replaces an ended record.
11. An exit MUST end the job only when it comes from the instance the job runs on at its generation, from the backup
    right after its restore, or from the interrupted primary just before its final dump (`exit_ends_job`). For a
    job over several VMs, only node 0 runs the command: while it recovers, node 0's exit ends the job after the
    restore, and before it only with success (a node's loss makes MPI fail the others, which the restore undoes).
12. A recovery that gives up MUST fail only the generation it recovers; a job that ended meanwhile keeps its end.

Run `python -m spotcr_contracts.protocol` to print this text as the page docs/design/protocol.md.
"""

# Standard library only: this package is shipped to job VMs beside the agent.

from __future__ import annotations

import sys
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol

from spotcr_contracts.commands import checkpoint_order
from spotcr_contracts.events import UNKNOWN_EXIT_CODE


class Status(StrEnum):
    PENDING = "PENDING"  # registered, the job has not started yet
    RUNNING = "RUNNING"
    CHECKPOINTING = "CHECKPOINTING"  # a periodic dump was ordered and has not completed yet
    RECOVERING = "RECOVERING"  # the generation was bumped; the recovery workflow owns the job
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"  # the user stopped it (`spotcr cancel`): no dump is ordered, no recovery started


ACTIVE = (Status.PENDING, Status.RUNNING, Status.CHECKPOINTING)
ENDED = (Status.COMPLETED, Status.FAILED, Status.CANCELLED)  # no writer moves a job out of these but a new submit


class Record(Protocol):
    """What the predicates read of a job record (spotcr_functions.models.JobRecord)."""

    @property
    def status(self) -> Status: ...
    @property
    def generation(self) -> int: ...
    @property
    def run_id(self) -> str: ...
    @property
    def instance_id(self) -> str: ...
    @property
    def checkpoint_id(self) -> str | None: ...
    @property
    def restore_ordered_at(self) -> str | None: ...
    @property
    def recovering_from(self) -> str | None: ...
    @property
    def backup_instance_id(self) -> str | None: ...
    @property
    def interrupted_at(self) -> str | None: ...
    @property
    def node_count(self) -> int: ...
    @property
    def interrupted_node(self) -> int | None: ...

    def arrival(self, key: str) -> dict[str, Any] | None: ...
    def node_0_instance(self) -> str: ...


class Exit(Protocol):
    """What exit_ends_job reads of a job's exit (spotcr_contracts.events.JobExited)."""

    @property
    def instance_id(self) -> str: ...
    @property
    def generation(self) -> int: ...
    @property
    def exit_code(self) -> int: ...


def of_this_run(record: Record, run_id: str) -> bool:
    """Rule 3: only the job's own run moves it."""
    return run_id == record.run_id


def may_record(record: Record, instance_id: str) -> bool:
    """Rule 6: who may commit the job's checkpoints now."""
    if record.status in ACTIVE:
        return instance_id == record.instance_id
    if record.status == Status.RECOVERING:
        return instance_id == final_dump_taker(record) and not record.restore_ordered_at
    return False


def final_dump_taker(record: Record) -> str | None:
    """Rule 6: the instance a recovery's final dump is ordered to: the interrupted one; for a job over several VMs
    node 0's (until Finish, `instance_id`), whose agent coordinates every node's dump."""
    return record.instance_id if record.node_count else record.recovering_from


def is_newer(record: Record, checkpoint_id: str) -> bool:
    """Rule 4: the checkpoint ranks after the record's newest by (generation, sequence). A final dump the agent took
    on its own notice ranks after that VM's ordered dumps and before its backup's."""
    if not record.checkpoint_id:
        return True
    return checkpoint_order(checkpoint_id) > checkpoint_order(record.checkpoint_id)


def exit_ends_job(record: Record, event: Exit) -> str | None:
    """Rules 10 and 11: whether this exit ends the job as the record stands; how, or None when it must be ignored."""
    if record.status in ENDED:
        return None
    if record.status in ACTIVE:
        same = event.instance_id == record.instance_id and event.generation == record.generation
        return "on its instance" if same else None
    if record.node_count:
        return _node_0_exit_ends_job(record, event)
    # RECOVERING: the backup ran the restored job and it ended before Finish; or the primary's job ended just
    # before the warning (a recorded exit code: -1 is a VM that stopped, whose job recovery must bring back).
    if event.instance_id == record.backup_instance_id and event.generation == record.generation:
        return "on the backup right after its restore"
    interrupted = event.instance_id == record.recovering_from and event.generation in (
        record.generation - 1,
        record.generation,
    )
    if interrupted and event.exit_code != UNKNOWN_EXIT_CODE:
        return "on the interrupted primary before its final dump"
    return None


def _node_0_exit_ends_job(record: Record, event: Exit) -> str | None:
    """Rule 11 for a job over several VMs while it recovers: node 0 runs the command. After the restore its exit
    at this generation ends the job (from the instance that holds node 0 by then: its backup when node 0 is one of
    the nodes recovered); before it only a success does, since a node's loss makes MPI end the other nodes'
    processes with an error."""
    if record.restore_ordered_at:
        same = event.instance_id == record.node_0_instance() and event.generation == record.generation
        return "on node 0 right after the restore" if same else None
    before = event.instance_id == record.instance_id and event.generation in (record.generation - 1, record.generation)
    return "on node 0 before the interruption" if before and event.exit_code == 0 else None


def job_gone_from(record: Record, instance_id: str) -> bool:
    """Rule 8: the final dump at this generation ended the job's processes on the instance: it committed, or it
    failed and the agent there confirmed it killed the job."""
    arrival = record.arrival("final-dump") or {}
    if arrival.get("generation") != record.generation:
        return False
    if not arrival.get("error"):
        return True
    output = arrival.get("output") or {}
    return bool(output.get("job_stopped")) and output.get("instance_id") == instance_id


def restarted(record: Record, launched_at: str | None) -> bool:
    """Rule 8: the instance was started again after the warning (EC2 restarts a stopped spot instance), so its
    final dump no longer proves the job is gone from it: the agent may have started or resumed the job there."""
    if not launched_at or not record.interrupted_at:
        return False
    return parse_time(launched_at) > parse_time(record.interrupted_at)


def parse_time(value: str) -> datetime:
    """A record's or an event's ISO 8601 time (EC2 and the agent write a trailing Z)."""
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def page() -> str:
    """This module's docstring as the Markdown page docs/design/protocol.md."""
    title, _, body = (__doc__ or "").partition("\n\n")
    generated = "<!-- Generated by `python -m spotcr_contracts.protocol`: edit its docstring. -->"
    lines = [f"# {title.strip()}", "", generated]
    for paragraph in body.strip().split("\n\n"):
        heading, _, rest = paragraph.partition("\n")
        if rest and heading.strip() and not heading[0].isdigit() and rest.lstrip()[:1].isdigit():
            lines += ["", f"## {heading.strip()}", "", rest]
        else:
            lines += ["", paragraph]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(page())
