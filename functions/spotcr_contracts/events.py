"""Lifecycle events the agent publishes to the project's EventBridge bus.

One definition for both sides: the agent builds them with `to_entry`, the functions parse
them with `parse_detail`. `tests/events/agent/*.json` holds the shared test vectors.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from spotcr_contracts.fields import from_fields

SOURCE = "spotcr.agent"
VERSION = 1


class InvalidEvent(ValueError):
    """An agent event that does not match its definition; the message says which field."""


@dataclass(frozen=True)
class AgentEvent:
    """Fields every agent event carries. `generation` is the fencing token the VM serves; `run_id` the run of the
    job it serves (spotcr:run). An event whose run_id is not the job's moves nothing (telemetry only): any job VM
    can put an event on the bus, and a run id is what it cannot guess. Empty only before the control plane
    registered this VM's run; an AgentReady in run mode without one just asks it to check that registration."""

    DETAIL_TYPE: ClassVar[str] = ""

    job_id: str
    instance_id: str
    generation: int
    at: str  # ISO 8601 UTC time on the VM
    run_id: str = ""
    # Minted by the agent once per event; a resend after an ambiguous PutEvents failure carries the same one, and
    # the control plane handles each event once (the agent-events function is idempotent on the whole detail).
    event_id: str = ""

    def detail(self) -> dict[str, Any]:
        return {"version": VERSION, **dataclasses.asdict(self)}

    def to_entry(self, bus_name: str) -> dict[str, Any]:
        """A PutEvents entry for this event."""
        return {
            "Source": SOURCE,
            "DetailType": self.DETAIL_TYPE,
            "Detail": json.dumps(self.detail(), separators=(",", ":")),
            "EventBusName": bus_name,
            "Resources": [],
        }


@dataclass(frozen=True)
class AgentReady(AgentEvent):
    """The agent is up, storage is mounted, and it accepts commands (mode: run | restore)."""

    DETAIL_TYPE: ClassVar[str] = "AgentReady"
    mode: str = "run"


@dataclass(frozen=True)
class BootstrapFailed(AgentEvent):
    DETAIL_TYPE: ClassVar[str] = "BootstrapFailed"
    step: str = ""
    reason: str = ""


@dataclass(frozen=True)
class JobStarted(AgentEvent):
    DETAIL_TYPE: ClassVar[str] = "JobStarted"
    pid: int = 0


@dataclass(frozen=True)
class CheckpointCompleted(AgentEvent):
    """A checkpoint is committed (its manifest is written) and may be restored."""

    DETAIL_TYPE: ClassVar[str] = "CheckpointCompleted"
    checkpoint_id: str = ""
    kind: str = "periodic"  # periodic | final
    seconds: float = 0.0  # dump start to durable
    frozen_seconds: float = 0.0
    bytes_total: int = 0  # image bytes described by the manifest
    bytes_uploaded: int = 0  # bytes actually sent to the store (after dedup and compression)
    memory_tracking: str = ""  # incremental (the kernel tracks dirty memory) or full, and why
    # The agent's deadline plan after a periodic dump (spotcr_agent.deadline); 0 and "" before it can plan.
    predicted_final_seconds: float = 0.0  # the final dump's time, notice to durable, at the worst moment
    next_interval_s: int = 0  # the interval to order periodic dumps at: the job's own, or shorter to fit
    deadline_risk: str = ""  # why even the shortest interval cannot fit the notice less the margin


@dataclass(frozen=True)
class FinalDumpAtRisk(AgentEvent):
    """Even with periodic dumps at the shortest interval, the final dump is predicted not to fit the notice less
    the margin: the job may lose the work since its last checkpoint when it is interrupted."""

    DETAIL_TYPE: ClassVar[str] = "FinalDumpAtRisk"
    checkpoint_id: str = ""  # the periodic dump whose figures gave the prediction
    predicted_final_seconds: float = 0.0
    budget_seconds: float = 0.0  # the notice less the margin
    interval_s: int = 0  # the shortest interval, asked for all the same
    reason: str = ""


@dataclass(frozen=True)
class CheckpointFailed(AgentEvent):
    DETAIL_TYPE: ClassVar[str] = "CheckpointFailed"
    kind: str = "periodic"
    reason: str = ""
    log_tail: str = ""  # the end of CRIU's log when CRIU failed
    criu_log: str = ""  # where CRIU's whole log was kept in the job's storage (s3://... or a path)
    # A failed final dump: the agent killed the job's whole tree, confirmed it gone, and fenced it off this VM.
    job_stopped: bool = False


@dataclass(frozen=True)
class RestoreCompleted(AgentEvent):
    DETAIL_TYPE: ClassVar[str] = "RestoreCompleted"
    checkpoint_id: str = ""
    attempt: str = ""  # the restore command's Attempt this answers (empty: a restore run by hand)
    seconds: float = 0.0  # until the job's last page was in
    pid: int = 0
    skipped: str = ""  # why newer checkpoints were not restored (corrupt, incompatible); empty if none were
    running_seconds: float = 0.0  # until the job ran again: earlier than `seconds` when `lazy`
    lazy: bool = False


@dataclass(frozen=True)
class RestoreFailed(AgentEvent):
    DETAIL_TYPE: ClassVar[str] = "RestoreFailed"
    checkpoint_id: str = ""
    attempt: str = ""  # the restore command's Attempt this answers (empty: a restore run by hand)
    reason: str = ""
    log_tail: str = ""  # the end of CRIU's log when CRIU failed
    criu_log: str = ""  # where CRIU's whole log was kept in the job's storage (s3://... or a path)


# The job's PID 1 was gone with no exit code recorded: the VM stopped or restarted under it, the job did not end.
UNKNOWN_EXIT_CODE = -1


@dataclass(frozen=True)
class JobExited(AgentEvent):
    DETAIL_TYPE: ClassVar[str] = "JobExited"
    exit_code: int = 0
    result: str = ""  # where the job's final work dir was committed (its result manifest); empty: not stored
    result_error: str = ""  # why the result could not be stored; the VM is then left running with the work dir
    # The files the job declared (spotcr:result) but did not leave, comma-separated: its end is a failure.
    result_missing: str = ""


EVENT_TYPES: dict[str, type[AgentEvent]] = {
    cls.DETAIL_TYPE: cls
    for cls in (
        AgentReady,
        BootstrapFailed,
        JobStarted,
        CheckpointCompleted,
        FinalDumpAtRisk,
        CheckpointFailed,
        RestoreCompleted,
        RestoreFailed,
        JobExited,
    )
}


def parse_detail(detail_type: str, detail: Mapping[str, Any]) -> AgentEvent:
    """Build the typed event from an EventBridge detail-type and detail."""
    cls = EVENT_TYPES.get(detail_type)
    if cls is None:
        raise InvalidEvent(f"unknown agent event {detail_type!r}")
    version = detail.get("version")
    if version != VERSION:
        raise InvalidEvent(f"{detail_type}: version {version!r} is not {VERSION}")
    return from_fields(cls, detail, detail_type, InvalidEvent)
