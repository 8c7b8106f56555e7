"""Commands the cloud side sends to a job VM through SSM Run Command.

Each command is one SSM document with typed, pattern-checked parameters that reach the agent
as environment variables (interpolationType ENV_VAR), never spliced into a shell line.
infra/ builds the documents from here, functions/ sends them, the rehearsal runs them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spotcr_contracts.tags import JOB_ID_PATTERN, RUN_ID_PATTERN

AGENT_BIN = "/opt/spotcr/bin/spotcr-agent"
# <the committing VM's time in unix ms>-g<generation>[-s<sequence>]-<kind>: the generation and the sequence are the
# control plane's; a dump the control plane ordered carries the order's sequence, one nobody ordered the highest
# sequence its VM was given (Agent.fence), and no sequence only on a VM that was never given one.
CHECKPOINT_ID_PATTERN = r"^[0-9]{13}-g[0-9]{1,10}(-s[0-9]{1,10})?-(periodic|final)$"


def checkpoint_id(unix_ms: int, generation: int, kind: str, sequence: int | None = None) -> str:
    """A checkpoint's id: the VM's time (for people), the control plane's generation and sequence (for order)."""
    ordered = f"-s{sequence}" if sequence is not None else ""
    return f"{unix_ms:013d}-g{generation}{ordered}-{kind}"


def checkpoint_generation(checkpoint_id: str) -> int:
    """The generation a checkpoint was taken at (the dump order's, minted by the control plane)."""
    return int(checkpoint_id.split("-")[1].removeprefix("g"))


def checkpoint_order(checkpoint_id: str) -> tuple[int, int, int, str]:
    """The one order of a job run's checkpoints, oldest to newest: (generation, sequence), both minted by the control
    plane, never a VM's clock; at one (generation, sequence) a final dump ranks after a periodic one.

    The job record mints a sequence each time it orders a dump (a periodic dump, the final dump a warning orders)
    and each time it orders a restore (Registry.close_generation), so a later order always ranks higher, and a
    backup, which serves the generation of the recovery that launched it, ranks every dump it takes after every
    dump of the instance it replaced. A dump nobody ordered (the final dump on the agent's own IMDS notice, one a
    person ran) carries the highest sequence its VM was given: after that VM's own dumps, before any later order.
    Only dumps of one VM can tie on all three; the VM's time in their ids then decides."""
    parts = checkpoint_id.split("-")
    sequence = int(parts[2].removeprefix("s")) if len(parts) == 4 else 0
    return checkpoint_generation(checkpoint_id), sequence, int(parts[-1] == "final"), checkpoint_id


@dataclass(frozen=True)
class Parameter:
    name: str
    description: str
    pattern: str
    default: str | None = None


@dataclass(frozen=True)
class Command:
    """An agent subcommand and the document parameters that become its flags."""

    name: str  # the agent subcommand, and the document's short name
    description: str
    parameters: tuple[Parameter, ...]
    flags: Mapping[str, str]  # parameter name -> agent flag

    def agent_argv(self, values: Mapping[str, str]) -> list[str]:
        """The agent's argv for these parameter values, checked as SSM checks them."""
        argv = [AGENT_BIN, self.name]
        for parameter in self.parameters:
            value = values.get(parameter.name, parameter.default)
            if value is None:
                raise ValueError(f"{self.name}: parameter {parameter.name} is required")
            if not re.fullmatch(parameter.pattern, value):
                raise ValueError(f"{self.name}: parameter {parameter.name}={value[:64]!r} fails {parameter.pattern}")
            if value:
                argv += [self.flags[parameter.name], value]
        return argv

    def document(self) -> dict[str, object]:
        """The SSM Command document (schema 2.2)."""
        flags = " ".join(
            f'${{SSM_{p.name}:+{self.flags[p.name]}}} ${{SSM_{p.name}:+"$SSM_{p.name}"}}' for p in self.parameters
        )
        parameters: dict[str, object] = {}
        for p in self.parameters:
            spec: dict[str, object] = {
                "type": "String",
                "description": p.description,
                "allowedPattern": p.pattern,
                "interpolationType": "ENV_VAR",
            }
            if p.default is not None:
                spec["default"] = p.default
            parameters[p.name] = spec
        return {
            "schemaVersion": "2.2",
            "description": self.description,
            "parameters": parameters,
            "mainSteps": [
                {
                    "action": "aws:runShellScript",
                    "name": self.name,
                    "precondition": {"StringEquals": ["platformType", "Linux"]},
                    "inputs": {"timeoutSeconds": "900", "runCommand": [f"exec {AGENT_BIN} {self.name} {flags}"]},
                }
            ],
        }


_JOB = Parameter("JobId", "The job's name (spotcr:job).", JOB_ID_PATTERN)
# The run the command is for (the job record's run_id): the agent refuses a command for another run of the same name.
_RUN = Parameter(
    "RunId", "The job's run (spotcr:run); the agent refuses another run's command.", f"^$|{RUN_ID_PATTERN}", ""
)
# Which restore attempt of the generation a restore command is (the workflow's step): the agent's answer names it,
# so a late or duplicated answer to one attempt never resumes another.
RESTORE_ATTEMPTS = ("newest", "previous")
_ATTEMPT = Parameter("Attempt", "The workflow's restore attempt this command is.", r"^$|^(newest|previous)$", "")
_GENERATION = Parameter("Generation", "Fencing token: the agent refuses a stale generation.", r"^[0-9]{1,10}$")
# The order's place in the job's order (checkpoint_order), minted by the control plane with a dump or restore order:
# a dump's goes into its checkpoint's id; a restore's ranks the backup's dumps after the replaced instance's. Empty:
# a command nobody ordered.
_SEQUENCE = Parameter("Sequence", "The control plane's sequence of this order.", r"^$|^[0-9]{1,10}$", "")

CHECKPOINT = Command(
    name="checkpoint",
    description="spotcr: take a periodic (job keeps running) or final (job stops) checkpoint.",
    parameters=(
        _JOB,
        _GENERATION,
        Parameter("Kind", "periodic or final.", r"^(periodic|final)$"),
        _RUN,
        _SEQUENCE,
    ),
    flags={
        "JobId": "--job",
        "Generation": "--generation",
        "Kind": "--kind",
        "RunId": "--run",
        "Sequence": "--sequence",
    },
)
RESTORE = Command(
    name="restore",
    description="spotcr: restore the job from a committed checkpoint (empty: the newest).",
    parameters=(
        _JOB,
        _GENERATION,
        Parameter("CheckpointId", "Checkpoint to restore; empty for the newest.", f"^$|{CHECKPOINT_ID_PATTERN}", ""),
        _RUN,
        _ATTEMPT,
        _SEQUENCE,
    ),
    flags={
        "JobId": "--job",
        "Generation": "--generation",
        "CheckpointId": "--checkpoint",
        "RunId": "--run",
        "Attempt": "--attempt",
        "Sequence": "--sequence",
    },
)
RELEASE = Command(
    name="release",
    description="spotcr: stop using the job's storage (unmount an EBS volume) so it can move.",
    parameters=(_JOB, _GENERATION, _RUN),
    flags={"JobId": "--job", "Generation": "--generation", "RunId": "--run"},
)
STATUS = Command(
    name="status",
    description="spotcr: print the agent's view of the job as JSON.",
    parameters=(_JOB,),
    flags={"JobId": "--job"},
)


@dataclass(frozen=True)
class FinalDumpOrder:
    """One job's final dump in a FINAL_DUMP command, which orders a wave's final dumps with one SendCommand to many
    instances: SendCommand gives every instance the same parameters, so each agent takes the order of its own
    instance (the other fields are the checkpoint command's: the job, its run, the fencing generation and the
    order's sequence)."""

    instance_id: str
    job_id: str
    run_id: str
    generation: int
    sequence: int

    def text(self) -> str:
        return f"{self.instance_id}:{self.job_id}:{self.run_id}:{self.generation}:{self.sequence}"

    @classmethod
    def parse(cls, text: str) -> FinalDumpOrder:
        if not re.fullmatch(_ORDER, text):
            raise ValueError(f"final-dump order {text[:100]!r} does not match {_ORDER}")
        instance_id, job_id, run_id, generation, sequence = text.split(":")
        return cls(instance_id, job_id, run_id, int(generation), int(sequence))


# SendCommand takes at most 50 instance ids. We found no documented length limit for a String parameter's value, so
# a command's orders are kept under a conservative 4 KiB: 50 orders of typical names (about 70 characters each), or
# 32 of the longest (124).
ORDERS_MAX = 50
ORDERS_MAX_CHARS = 4096
_ORDER = (
    r"i-[0-9a-f]{8,17}:" + JOB_ID_PATTERN.strip("^$") + ":(" + RUN_ID_PATTERN.strip("^$") + ")?:[0-9]{1,10}:[0-9]{1,10}"
)
FINAL_DUMP = Command(
    name="final-dump",
    description="spotcr: take the final checkpoint (the job stops) this instance's order names.",
    parameters=(
        Parameter(
            "Orders",
            "Comma list of final-dump orders (instance:job:run:generation:sequence); each agent takes its own.",
            f"^{_ORDER}(,{_ORDER}){{0,{ORDERS_MAX - 1}}}$",
        ),
    ),
    flags={"Orders": "--orders"},
)


def orders_value(orders: Sequence[FinalDumpOrder]) -> str:
    """The Orders parameter of one FINAL_DUMP command."""
    return ",".join(order.text() for order in orders)


def parse_orders(value: str) -> list[FinalDumpOrder]:
    """A FINAL_DUMP command's orders; ValueError names the one that is malformed."""
    return [FinalDumpOrder.parse(text) for text in value.split(",")]


def order_batches(orders: Sequence[FinalDumpOrder]) -> list[list[FinalDumpOrder]]:
    """Orders split into FINAL_DUMP commands: at most ORDERS_MAX instances and ORDERS_MAX_CHARS each."""
    batches: list[list[FinalDumpOrder]] = []
    size = 0
    for order in orders:
        if not batches or len(batches[-1]) == ORDERS_MAX or size + len(order.text()) + 1 > ORDERS_MAX_CHARS:
            batches.append([])
            size = 0
        batches[-1].append(order)
        size += len(order.text()) + 1
    return batches


COMMANDS: dict[str, Command] = {c.name: c for c in (CHECKPOINT, FINAL_DUMP, RESTORE, RELEASE, STATUS)}


def document_setting(command_name: str) -> str:
    """The FunctionSettings field naming a command's SSM document (final-dump: final_dump_document)."""
    return command_name.replace("-", "_") + "_document"


def document_output(command_name: str) -> str:
    """The stack output naming a command's SSM document (final-dump: FinalDumpDocument)."""
    return "".join(part.capitalize() for part in command_name.split("-")) + "Document"


# What SSM says of one command on one instance (GetCommandInvocation's Status, and the status-change event's).
COMMAND_RUNNING = ("Pending", "InProgress", "Delayed")
COMMAND_SUCCEEDED = "Success"
COMMAND_FAILED = (
    "Failed",
    "Cancelled",
    "TimedOut",
    "Undeliverable",
    "Terminated",
    "DeliveryTimedOut",
    "ExecutionTimedOut",
)


# Sent by the user's `spotcr probe`, never by a function: its document is a construct of its own (infra/probe.py),
# kept out of COMMANDS so that no function is granted it.
PROBE = Command(
    name="probe",
    description="spotcr: measure this VM's storage write/read rates and the agent's checkpoint pipeline (JSON).",
    parameters=(
        Parameter(
            "Streams", "Parallel streams per configuration, comma-separated.", r"^[0-9]{1,3}(,[0-9]{1,3}){0,7}$", "1,4"
        ),
        Parameter("BlockKiB", "Block sizes in KiB, comma-separated.", r"^[0-9]{1,5}(,[0-9]{1,5}){0,7}$", "64,1024"),
        Parameter("SizeMiB", "MiB each stream writes per configuration.", r"^[0-9]{1,5}$", "8"),
        Parameter("PipelineMiB", "MiB of synthetic images through the store; 0 skips it.", r"^[0-9]{1,5}$", "16"),
    ),
    flags={"Streams": "--streams", "BlockKiB": "--block-kib", "SizeMiB": "--size-mib", "PipelineMiB": "--pipeline-mib"},
)
