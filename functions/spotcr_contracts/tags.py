"""Instance tags: how a user submits a job, and how spotcr reads it back on both sides.

Every value is validated strictly here; a value that fails names the tag and the reason.
Values never reach a shell: commands become argv lists, everything else typed fields.
"""

from __future__ import annotations

import re
import secrets
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath

PREFIX = "spotcr:"
JOB = "spotcr:job"
STORAGE = "spotcr:storage"
INTERVAL = "spotcr:interval"
FALLBACK_TYPES = "spotcr:fallback-types"
COMMAND = "spotcr:command"
SPEC = "spotcr:spec"
WORKDIR = "spotcr:workdir"
TCP = "spotcr:tcp"
# Files, relative to the work dir and comma-separated, the job must leave: without them its end is not a success.
RESULT = "spotcr:result"
RESTART_FROM_SCRATCH = "spotcr:restart-from-scratch"  # true (default) | false: with no checkpoint, start over
# true (default) | false: a backup runs the job again before its memory has arrived, where its kernel can
# (userfaultfd); false: it downloads the whole checkpoint first.
LAZY_RESTORE = "spotcr:lazy-restore"
# Seconds of the two-minute notice the agent's plan keeps free: periodic dumps come often enough that the predicted
# final dump takes at most the notice less this.
DEADLINE_MARGIN = "spotcr:deadline-margin"
# A job over several VMs (docs/design/multinode.md): on every node the same job tags, the job's node count, and
# this node's index (0..N-1). Node 0 runs the command; the others run its MPI processes.
NODES = "spotcr:nodes"
NODE = "spotcr:node"
ERROR = "spotcr:error"
# Set by spotcr on the VMs it launches: the job's mode there and the generation it serves.
MODE = "spotcr:mode"
GENERATION = "spotcr:generation"
# Set by `spotcr interrupt` on the one instance the stack's FIS experiment templates target, then removed.
INTERRUPT = "spotcr:interrupt"
INTERRUPT_REQUESTED = "requested"
# Set by spotcr on the one instance registered for a run of the job (and on its backups): the run's identity.
# An agent in run mode starts the job only once this tag is on its instance; an instance refused gets ERROR instead.
RUN = "spotcr:run"
# EC2 tags every instance launched from a launch template with its id; only EC2 writes aws: tags.
LAUNCH_TEMPLATE = "aws:ec2launchtemplate:id"
# On the volumes and snapshots spotcr creates: the stack whose roles may attach, move and delete them (its roles
# write the key only while creating one; the users' policy must not allow writing it).
STACK = "spotcr:stack"
# The job's own tags, which its submitter writes (docs/submitting.md's tag table); every other spotcr tag is spotcr's.
USER_TAGS = (
    JOB,
    COMMAND,
    SPEC,
    STORAGE,
    INTERVAL,
    FALLBACK_TYPES,
    WORKDIR,
    TCP,
    RESULT,
    RESTART_FROM_SCRATCH,
    DEADLINE_MARGIN,
    LAZY_RESTORE,
    NODES,
    NODE,
)
# Tags that may differ between the nodes of one job: every other job tag must be the same on all of them.
PER_NODE_TAGS = (NODE,)
RUN_ID_PATTERN = r"^r-[0-9a-f]{16}$"
# A job's name (spotcr:job), its id everywhere: safe as an S3 prefix, an STS session tag value and a store name.
JOB_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"

STORAGES = ("s3", "ebs", "efs", "fsx")
# What a restore does with the job's TCP connections: established (the old VM's address is kept on the backup's
# loopback, so listeners and connections within the job come back; others are reset) or close (always closed).
TCP_POLICIES = ("established", "close")
DEFAULT_TCP = "established"
MODES = ("run", "restore")
DEFAULT_STORAGE = "s3"
DEFAULT_INTERVAL_S = 300
MIN_INTERVAL_S = 10
MAX_INTERVAL_S = 86_400
SPOT_NOTICE_S = 120  # EC2's spot interruption warning comes two minutes before the action
DEFAULT_DEADLINE_MARGIN_S = 30
MAX_DEADLINE_MARGIN_S = 110
MAX_FALLBACK_TYPES = 8
MAX_RESULT_FILES = 16
MAX_NODES = 16  # a node list of 16 addresses fits one tag value and one agent's port fan-out
MAX_TAG_VALUE = 256

JOB_NAME = re.compile(JOB_ID_PATTERN)
_INSTANCE_TYPE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9]+$")
_S3_URI = re.compile(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/([A-Za-z0-9!_.*'()/-]{1,900})$")
_WORKDIR = re.compile(r"^/[A-Za-z0-9._/-]{0,200}$")
_RUN_ID = re.compile(RUN_ID_PATTERN)
_ASCII_NUMBER = re.compile(r"^[0-9]{1,10}$")  # str.isdigit() also accepts superscripts and full-width digits
# Restore replaces the work dir with the checkpoint's: it must be the job's own directory, never one the system
# needs. These, and anything under the first group, are refused.
SYSTEM_TREES = ("/proc", "/sys", "/dev", "/boot", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/usr")
SYSTEM_DIRS = ("/", "/home", "/opt", "/root", "/run", "/srv", "/tmp", "/var", "/var/lib", "/var/lib/spotcr", "/mnt")  # noqa: S108
_SHELL_SYNTAX = re.compile(r"[;&|<>`$\\]|\$\(")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class InvalidJobTags(ValueError):
    """A job's tags cannot be used; the message names the tag and what is wrong."""

    def __init__(self, tag: str, reason: str) -> None:
        super().__init__(f"{tag}: {reason}")
        self.tag = tag
        self.reason = reason


@dataclass(frozen=True)
class JobSpec:
    """What a user asked for, read from the instance's tags."""

    job_id: str
    storage: str = DEFAULT_STORAGE
    interval_s: int = DEFAULT_INTERVAL_S
    fallback_types: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    spec_uri: str | None = None
    workdir: str | None = None
    mode: str = "run"
    generation: int = 0
    tcp: str = DEFAULT_TCP
    restart_from_scratch: bool = True
    lazy_restore: bool = True
    deadline_margin_s: int = DEFAULT_DEADLINE_MARGIN_S
    run_id: str = ""  # spotcr:run, set by spotcr once the job is registered (empty on a user's instance before)
    result_files: tuple[str, ...] = ()  # spotcr:result
    nodes: int = 1  # spotcr:nodes: 1 is a single-VM job
    node_index: int = 0  # spotcr:node
    extra: Mapping[str, str] = field(default_factory=dict)
    # The user's spotcr:command as written: re-quoting it (shlex.join) can make a valid tag too long.
    command_tag: str = field(default="", compare=False, repr=False)

    def to_tags(self) -> dict[str, str]:
        """The tags that describe this job, as a backup VM must carry them."""
        tags = {
            JOB: self.job_id,
            STORAGE: self.storage,
            INTERVAL: str(self.interval_s),
            MODE: self.mode,
            GENERATION: str(self.generation),
        }
        if self.fallback_types:
            tags[FALLBACK_TYPES] = ",".join(self.fallback_types)
        if self.command:
            tags[COMMAND] = self.command_tag or shlex.join(self.command)
        if self.spec_uri:
            tags[SPEC] = self.spec_uri
        if self.workdir:
            tags[WORKDIR] = self.workdir
        if self.tcp != DEFAULT_TCP:
            tags[TCP] = self.tcp
        if not self.restart_from_scratch:
            tags[RESTART_FROM_SCRATCH] = "false"
        if not self.lazy_restore:
            tags[LAZY_RESTORE] = "false"
        if self.deadline_margin_s != DEFAULT_DEADLINE_MARGIN_S:
            tags[DEADLINE_MARGIN] = str(self.deadline_margin_s)
        if self.run_id:
            tags[RUN] = self.run_id
        if self.result_files:
            tags[RESULT] = ",".join(self.result_files)
        if self.nodes > 1:
            tags[NODES] = str(self.nodes)
            tags[NODE] = str(self.node_index)
        return tags


def new_run_id() -> str:
    """A fresh run identity, minted by the control plane when it registers a job (a VM never mints its job's run;
    the probe mints one for its own scratch objects under a job's prefix)."""
    return "r-" + secrets.token_hex(8)


def is_job(tags: Mapping[str, str]) -> bool:
    return JOB in tags


def launched_by_spotcr(tags: Mapping[str, str]) -> bool:
    """A backup spotcr launched (and may terminate), never an instance the user launched."""
    return tags.get(MODE) == "restore"


def parse_job_tags(tags: Mapping[str, str]) -> JobSpec:
    """Read a job from instance tags; raises InvalidJobTags naming the first bad tag."""
    for key, value in tags.items():
        if key.startswith(PREFIX):
            if len(value) > MAX_TAG_VALUE:
                raise InvalidJobTags(key, f"value is {len(value)} characters, at most {MAX_TAG_VALUE}")
            if _CONTROL.search(value):
                raise InvalidJobTags(key, "value contains control characters")
    if JOB not in tags:
        raise InvalidJobTags(JOB, "missing")
    job_id = tags[JOB]
    if not JOB_NAME.fullmatch(job_id):
        raise InvalidJobTags(JOB, "must be 1-63 of a-z, 0-9 and '-', starting with a letter or digit")
    storage = tags.get(STORAGE, DEFAULT_STORAGE)
    if storage not in STORAGES:
        raise InvalidJobTags(STORAGE, f"unknown storage {storage[:32]!r}; one of {', '.join(STORAGES)}")
    interval_s = _parse_int(tags, INTERVAL, DEFAULT_INTERVAL_S, MIN_INTERVAL_S, MAX_INTERVAL_S)
    generation = _parse_int(tags, GENERATION, 0, 0, 10**9)
    mode = tags.get(MODE, "run")
    if mode not in MODES:
        raise InvalidJobTags(MODE, f"unknown mode {mode[:32]!r}; one of {', '.join(MODES)}")
    fallback_types = _parse_fallback_types(tags.get(FALLBACK_TYPES, ""))
    command = parse_command(tags[COMMAND]) if COMMAND in tags else ()
    spec_uri = tags.get(SPEC)
    if spec_uri is not None and not _S3_URI.match(spec_uri):
        raise InvalidJobTags(SPEC, "must be s3://bucket/key with a DNS-style bucket name")
    nodes, node_index = _parse_nodes(tags)
    if not command and spec_uri is None:
        raise InvalidJobTags(COMMAND, f"a job needs {COMMAND} or {SPEC}")
    workdir = tags.get(WORKDIR)
    tcp = tags.get(TCP, DEFAULT_TCP)
    if tcp not in TCP_POLICIES:
        raise InvalidJobTags(TCP, f"unknown policy {tcp[:32]!r}; one of {', '.join(TCP_POLICIES)}")
    if workdir is not None and (problem := workdir_problem(workdir)):
        raise InvalidJobTags(WORKDIR, problem)
    restart = _parse_bool(tags, RESTART_FROM_SCRATCH, default=True)
    lazy_restore = _parse_bool(tags, LAZY_RESTORE, default=True)
    margin = _parse_int(tags, DEADLINE_MARGIN, DEFAULT_DEADLINE_MARGIN_S, 0, MAX_DEADLINE_MARGIN_S)
    run_id = _parse_run(tags)
    result_files = parse_result_files(tags[RESULT]) if RESULT in tags else ()
    extra = {k: v for k, v in tags.items() if not k.startswith(PREFIX)}
    return JobSpec(
        job_id=job_id,
        storage=storage,
        interval_s=interval_s,
        fallback_types=fallback_types,
        command=command,
        spec_uri=spec_uri,
        workdir=workdir,
        mode=mode,
        generation=generation,
        tcp=tcp,
        restart_from_scratch=restart,
        lazy_restore=lazy_restore,
        deadline_margin_s=margin,
        run_id=run_id,
        result_files=result_files,
        nodes=nodes,
        node_index=node_index,
        extra=extra,
        command_tag=tags.get(COMMAND, ""),
    )


def workdir_problem(workdir: str) -> str | None:
    """Why a path cannot be a job's work dir (restore replaces that whole tree), or None when it can."""
    if not _WORKDIR.match(workdir) or "/../" in workdir + "/" or "/./" in workdir + "/":
        return "must be an absolute path of letters, digits, '.', '_', '-' and '/'"
    normal = workdir.rstrip("/") or "/"
    while "//" in normal:
        normal = normal.replace("//", "/")
    if normal in SYSTEM_DIRS or any(normal == t or normal.startswith(t + "/") for t in SYSTEM_TREES):
        return f"{workdir!r} is a system directory; restore replaces the work dir, so use the job's own (e.g. /opt/job)"
    return None


def result_path_problem(name: str) -> str | None:
    """Why a name cannot be a result file of the job (a path relative to its work dir), or None when it can."""
    path = PurePosixPath(name)
    if not name.strip() or path.is_absolute() or ".." in path.parts or "," in name or _CONTROL.search(name):
        return f"{name[:64]!r} must be a path relative to the job's work dir, without '..' or ','"
    return None


def parse_result_files(value: str, tag: str = RESULT) -> tuple[str, ...]:
    """The result files a job declares, comma-separated; each must be a path relative to its work dir."""
    return check_result_files(tuple(part.strip() for part in value.split(",")), tag)


def check_result_files(names: tuple[str, ...], tag: str = RESULT) -> tuple[str, ...]:
    """The result files a job declares (its tag, or its spec's list): at most MAX_RESULT_FILES paths, each relative
    to its work dir; raises InvalidJobTags naming `tag`."""
    if len(names) > MAX_RESULT_FILES:
        raise InvalidJobTags(tag, f"at most {MAX_RESULT_FILES} files")
    for name in names:
        if problem := result_path_problem(name):
            raise InvalidJobTags(tag, problem)
    return names


def parse_command(value: str, tag: str = COMMAND) -> tuple[str, ...]:
    """Split a command into argv; shell syntax is refused because no shell will ever see it."""
    if _CONTROL.search(value):
        raise InvalidJobTags(tag, "command contains control characters")
    match = _SHELL_SYNTAX.search(value)
    if match:
        raise InvalidJobTags(
            tag,
            f"command uses shell syntax {match.group(0)!r}; spotcr runs argv without a shell: "
            "put a script in the job's work dir or a job spec",
        )
    try:
        argv = tuple(shlex.split(value))
    except ValueError as error:
        raise InvalidJobTags(tag, f"command does not parse: {error}") from error
    if not argv:
        raise InvalidJobTags(tag, "command is empty")
    return argv


def _parse_int(tags: Mapping[str, str], tag: str, default: int, low: int, high: int) -> int:
    raw = tags.get(tag)
    if raw is None:
        return default
    if not _ASCII_NUMBER.match(raw):
        raise InvalidJobTags(tag, f"must be a whole number, got {raw[:32]!r}")
    value = int(raw)
    if not low <= value <= high:
        raise InvalidJobTags(tag, f"must be between {low} and {high}, got {value}")
    return value


def _parse_nodes(tags: Mapping[str, str]) -> tuple[int, int]:
    """spotcr:nodes and spotcr:node: both or neither; the index below the count. Every storage serves such a job:
    S3, EFS and FSx shared by its nodes, EBS one volume per node."""
    if (NODES in tags) != (NODE in tags):
        present, missing = (NODES, NODE) if NODES in tags else (NODE, NODES)
        raise InvalidJobTags(missing, f"a job over several VMs has both {NODES} and {NODE}; {present} is set alone")
    nodes = _parse_int(tags, NODES, 1, 1, MAX_NODES)
    node_index = _parse_int(tags, NODE, 0, 0, nodes - 1)
    return nodes, node_index


def same_job(first: Mapping[str, str], other: Mapping[str, str]) -> str | None:
    """Why two nodes' tags are not one job's (the first job tag that differs), or None when they are."""
    for key in sorted(set(first) | set(other)):
        if key in USER_TAGS and key not in PER_NODE_TAGS and first.get(key) != other.get(key):
            return f"{key} differs between the job's nodes: every node carries the same job tags but {NODE}"
    return None


def _parse_run(tags: Mapping[str, str]) -> str:
    run_id = tags.get(RUN, "")
    if run_id and not _RUN_ID.match(run_id):
        raise InvalidJobTags(RUN, f"is set by spotcr as r- and 16 hex digits, got {run_id[:32]!r}")
    return run_id


def _parse_bool(tags: Mapping[str, str], tag: str, *, default: bool) -> bool:
    raw = tags.get(tag)
    if raw is None:
        return default
    if raw not in ("true", "false"):
        raise InvalidJobTags(tag, f"must be true or false, got {raw[:32]!r}")
    return raw == "true"


def _parse_fallback_types(raw: str) -> tuple[str, ...]:
    if not raw:
        return ()
    types = tuple(part.strip() for part in raw.split(","))
    if len(types) > MAX_FALLBACK_TYPES:
        raise InvalidJobTags(FALLBACK_TYPES, f"at most {MAX_FALLBACK_TYPES} instance types")
    for instance_type in types:
        if not _INSTANCE_TYPE.match(instance_type):
            raise InvalidJobTags(FALLBACK_TYPES, f"{instance_type[:32]!r} is not an instance type like m5.large")
    return types
