"""The result lines of the agent's commands, which the control plane reads back from SSM.

Every agent command prints one JSON object line on stdout (its logs go to stderr). Read from GetCommandInvocation,
that line is what the instance's own SSM Agent reported: no other VM can write it, so it is the only source the
control plane takes a committed checkpoint, a restore or a job's exit from (tests/workflow/test_authenticated.py).

One writer, one reader: the agent prints each result with `to_line` (spotcr_agent.cli), the functions read it with
`parse_checkpoint`, `parse_restore` and `parse_status`; `tests/events/results/*.json` holds the shared test vectors,
which both sides' tests load. A command that fails before it can answer its order (bad flags, another job's command, no
config) prints a `CommandFailed` instead; a reader gets that too. Fields beyond a type's are ignored, so an agent
may add one before the functions read it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

from spotcr_contracts.commands import CHECKPOINT_ID_PATTERN, RESTORE_ATTEMPTS
from spotcr_contracts.fields import from_fields

KINDS = ("periodic", "final")
# none | running | exited | checkpointed (by its final dump) | stopped (killed after its final dump failed)
JOB_STATUSES = ("none", "running", "exited", "checkpointed", "stopped")


class InvalidResult(ValueError):
    """A result line that does not match its type; the message names the field."""


def _line(ok: bool, result: object) -> str:
    return json.dumps({"ok": ok, **dataclasses.asdict(result)}, separators=(",", ":"))  # type: ignore[call-overload]


@dataclass(frozen=True)
class CommandFailed:
    """What any agent command prints when it fails before it can answer its order."""

    error: str
    stale: bool = False  # the command's generation is older than the one this VM serves: fenced off

    def to_line(self) -> str:
        return _line(False, self)


@dataclass(frozen=True)
class CheckpointResult:
    """The checkpoint command's answer, naming the order (job, run, generation, kind) it answers. `ok`: committed,
    with the dump's figures; else `error`, and whether the job is stopped for good on this VM (a failed final dump)
    or has ended (`exit_code`, with where its result was committed or why it could not be, as the status command
    says it: an order that finds the job ended answers with its exit, checkpoints.reported_dump)."""

    ok: bool
    job_id: str
    run_id: str
    generation: int  # the order's
    kind: str
    checkpoint_id: str = ""
    dump_generation: int = 0  # the dump's own (a final dump on this VM's own notice may answer a later order)
    already_taken: bool = False  # another trigger took this final dump; this answer reports it
    seconds: float = 0.0  # dump start to durable
    frozen_seconds: float = 0.0
    bytes_total: int = 0
    bytes_uploaded: int = 0
    gpu_memory_bytes: int | None = None  # the job's GPU device memory, inside bytes_total (None: no GPU or unknown)
    memory_tracking: str = ""
    scratch: str = ""  # where CRIU wrote the images: memory (a tmpfs) or disk
    # The agent's deadline plan after a periodic dump (spotcr_agent.deadline); 0 and "" before it can plan.
    predicted_final_seconds: float = 0.0
    next_interval_s: int = 0
    deadline_risk: str = ""
    error: str = ""
    job_stopped: bool = False
    exit_code: int | None = None  # the job's, when it has ended there
    stale: bool = False
    result: str = ""
    result_error: str = ""
    result_missing: str = ""

    def to_line(self) -> str:
        return _line(self.ok, self)

    def settled_exit(self) -> bool:
        """Whether the job has ended there and its result is stored or given up (StatusResult.settled_exit)."""
        return self.exit_code is not None and bool(self.result or self.result_error)

    def problem(self) -> str | None:
        if self.kind not in KINDS:
            return f"field 'kind' is {self.kind[:32]!r}, not one of {', '.join(KINDS)}"
        if self.ok and not re.fullmatch(CHECKPOINT_ID_PATTERN, self.checkpoint_id):
            return f"field 'checkpoint_id' {self.checkpoint_id[:64]!r} does not match {CHECKPOINT_ID_PATTERN}"
        return None


@dataclass(frozen=True)
class RestoreResult:
    """The restore command's answer, naming the order (job, run, generation, attempt) it answers. `ok`: restored,
    with the restore's figures; else `error`."""

    ok: bool
    job_id: str
    run_id: str
    generation: int
    attempt: str  # the workflow's attempt (commands.RESTORE_ATTEMPTS); empty: a restore run by hand
    checkpoint_id: str = ""  # the one restored; empty: started from the beginning (see `skipped`)
    seconds: float = 0.0
    pid: int = 0
    skipped: str = ""  # why newer checkpoints were not restored (corrupt, incompatible); empty if none were
    error: str = ""
    stale: bool = False
    # From the order to the job running again; `seconds` runs until its last page was in (later when `lazy`: its
    # memory arrived while it ran).
    running_seconds: float = 0.0
    lazy: bool = False

    def to_line(self) -> str:
        return _line(self.ok, self)

    def problem(self) -> str | None:
        if self.attempt not in ("", *RESTORE_ATTEMPTS):
            return f"field 'attempt' is {self.attempt[:32]!r}, not one of {', '.join(RESTORE_ATTEMPTS)} or empty"
        # Empty: nothing was restorable and the job started from the beginning (spotcr:restart-from-scratch).
        if self.checkpoint_id and not re.fullmatch(CHECKPOINT_ID_PATTERN, self.checkpoint_id):
            return f"field 'checkpoint_id' {self.checkpoint_id[:64]!r} does not match {CHECKPOINT_ID_PATTERN}"
        return None


@dataclass(frozen=True)
class StatusResult:
    """The status command's answer: the agent's view of the job. The control plane ends a job from its exit code and
    where its result was committed, or why it could not be (exits.reported_exit), never from JobExited alone."""

    job_id: str
    run_id: str
    instance_id: str
    storage: str
    mode: str
    generation: int
    job_status: str  # JOB_STATUSES
    job_pid: int
    job_alive: bool
    exit_code: int | None
    result: str
    result_error: str
    result_missing: str  # the declared result files (spotcr:result) the job did not leave, comma-separated
    last_checkpoint: str | None
    final_dumps: dict[str, str]  # generation -> running | done | failed
    criu_logs: list[dict[str, str]] = field(default_factory=list)  # the newest kept CRIU logs: {"log", "error"}
    criu_logs_error: str = ""  # why they could not be read

    def to_line(self) -> str:
        return _line(True, self)  # a status that cannot be read fails as CommandFailed

    def problem(self) -> str | None:
        if self.job_status not in JOB_STATUSES:
            return f"field 'job_status' is {self.job_status[:32]!r}, not one of {', '.join(JOB_STATUSES)}"
        return None

    def settled_exit(self) -> bool:
        """Whether the job has exited and its result is stored or given up: an end the control plane may take."""
        return self.job_status == "exited" and bool(self.result or self.result_error)


Result = TypeVar("Result", CheckpointResult, RestoreResult, StatusResult)


def result_line(stdout: str) -> dict[str, Any]:
    """The last JSON object line a command printed."""
    for raw in reversed(stdout.strip().splitlines()):
        line = raw.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError as error:
                raise InvalidResult(f"the result line is not JSON: {error}") from error
            if not isinstance(value, dict):
                raise InvalidResult("the result line is not a JSON object")
            return value
    raise InvalidResult("the command printed no result line")


def _parse(cls: type[Result], stdout: str) -> Result | CommandFailed:
    document = result_line(stdout)
    what = cls.__name__
    ok = document.get("ok")
    if not isinstance(ok, bool):
        raise InvalidResult(f"{what}: field 'ok' is {ok!r}, not true or false")
    if not ok and set(document) <= {"ok", "error", "stale"}:
        return from_fields(CommandFailed, document, "CommandFailed", InvalidResult)
    if not ok and cls is StatusResult:
        raise InvalidResult(f"{what}: field 'ok' is false, yet the line has more than error and stale")
    result = from_fields(cls, document, what, InvalidResult)
    problem = result.problem()
    if problem:
        raise InvalidResult(f"{what}: {problem}")
    return result


def parse_checkpoint(stdout: str) -> CheckpointResult | CommandFailed:
    """The checkpoint command's result from its stdout; raises InvalidResult naming the field that is wrong."""
    return _parse(CheckpointResult, stdout)


def parse_restore(stdout: str) -> RestoreResult | CommandFailed:
    """The restore command's result from its stdout; raises InvalidResult naming the field that is wrong."""
    return _parse(RestoreResult, stdout)


def parse_status(stdout: str) -> StatusResult | CommandFailed:
    """The status command's result from its stdout; raises InvalidResult naming the field that is wrong."""
    return _parse(StatusResult, stdout)
