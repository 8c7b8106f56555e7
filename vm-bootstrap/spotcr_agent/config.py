"""The agent's configuration: `/etc/spotcr/agent.json`, written by `spotcr-agent bootstrap`.

Built once at the edge (the CLI); logic modules receive the typed object and never read the
environment. Only paths and endpoints may be overridden from the environment.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotcr_contracts.tags import DEFAULT_TCP, MODES, STORAGES, TCP_POLICIES

from .carry import IMAGE_DIRS, LOCAL_DIRS
from .criu import DEFAULT_GHOST_LIMIT_MB
from .deadline import AWS_NOTICE_S, DEFAULT_MARGIN_S

DEFAULT_CONFIG_PATH = Path("/etc/spotcr/agent.json")
DEFAULT_STATE_DIR = Path("/var/lib/spotcr")
DEFAULT_MOUNT_POINT = Path("/mnt/spotcr")
DEFAULT_IMDS_ENDPOINT = "http://169.254.169.254"
LAUNCHER = "/opt/spotcr/bin/spotcr-launch"  # installed beside spotcr-agent (install-artifact.sh)
CONFIG_ENV = "SPOTCR_AGENT_CONFIG"
IMDS_ENV = "SPOTCR_IMDS_ENDPOINT"
STATE_DIR_ENV = "SPOTCR_STATE_DIR"
DEFAULT_LOCAL_FILES_LIMIT_MB = 8192


class ConfigError(ValueError):
    """The agent's configuration file is missing or wrong; the message says which field."""


def default_workdir(job_id: str) -> Path:
    # Not under the state dir: the job's open files must sit at the same path on every VM.
    return Path("/var/lib/spotcr/work") / job_id


@dataclass(frozen=True)
class AgentConfig:
    job_id: str
    instance_id: str
    storage: str
    generation: int
    mode: str = "run"
    run_id: str = ""  # spotcr:run when the VM booted with it (a backup); a primary learns it from its tags later
    region: str = ""
    availability_zone: str = ""
    event_bus: str = ""
    bucket: str = ""  # s3 storage
    mount_point: Path = DEFAULT_MOUNT_POINT  # ebs, efs, fsx storage
    ebs_volume_id: str = ""  # ebs: the volume to find as an NVMe device; empty: the one non-root EBS volume
    efs_id: str = ""  # efs: file system id (fs-...)
    efs_isolation: bool = False  # efs: mount only the job's own access point, with IAM (mount.efs, vended credentials)
    fsx_dns: str = ""  # fsx: file system DNS name
    fsx_mount_name: str = ""  # fsx: Lustre mount name
    # Where the agent gets S3 credentials for its run of jobs/<job>/ only (signed with the instance role); empty:
    # the AWS environment's own credentials (an agent run by hand, tests).
    store_credentials_url: str = ""
    final_dump: str = "stream"  # stream (store reads images as CRIU writes them) | dump-then-ship
    command: tuple[str, ...] = ()
    workdir: Path = Path()
    env: Mapping[str, str] = field(default_factory=dict)
    result_files: tuple[str, ...] = ()  # spotcr:result (or the spec's): files the job must leave in its work dir
    interval_s: int = 300
    state_dir: Path = DEFAULT_STATE_DIR
    scratch_dir: Path = Path()  # local dir (ideally tmpfs) for periodic dumps; default <state_dir>/scratch
    # Dumps go to a tmpfs mounted for each (at <state_dir>/memory-scratch) when free memory holds them, so the job
    # is frozen only while CRIU writes to memory; false: always scratch_dir.
    memory_scratch: bool = True
    imds_endpoint: str = DEFAULT_IMDS_ENDPOINT
    criu_bin: str = "criu"
    keep_checkpoints: int = 3
    tcp: str = DEFAULT_TCP  # what a restore does with the job's TCP connections (spotcr:tcp): one of TCP_POLICIES
    ghost_limit_mb: int = DEFAULT_GHOST_LIMIT_MB  # unlinked files the job holds, up to this size each, are carried
    local_dirs: tuple[str, ...] = LOCAL_DIRS  # VM-local places carried whole with every checkpoint
    image_dirs: tuple[str, ...] = IMAGE_DIRS  # the AMI's system: checked at restore, never carried
    local_files_limit_mb: int = DEFAULT_LOCAL_FILES_LIMIT_MB  # a checkpoint fails, naming the biggest, above this
    restart_from_scratch: bool = True  # with no restorable checkpoint, a backup starts the job over
    lazy_restore: bool = True  # spotcr:lazy-restore: the job runs again before its memory has arrived (lazy.py)
    notice_s: int = AWS_NOTICE_S  # the interruption notice the final dump must fit in
    deadline_margin_s: int = DEFAULT_MARGIN_S  # spotcr:deadline-margin: kept free of the notice by the plan
    # A multi-node job (docs/design/multinode.md): every node's address in index order, this node's index, and the
    # run's launch key (hex) that signs the agents' port. Empty: a single-VM job. The bootstrap writes them from the
    # store-credentials answer (bootstrap.fetch_nodes).
    nodes: tuple[str, ...] = ()
    node_index: int = 0
    launch_key: str = ""
    launcher: str = LAUNCHER  # spotcr-launch, which node 0's mpiexec runs as its ssh (launch.py)

    def __post_init__(self) -> None:
        if self.storage not in STORAGES:
            raise ConfigError(f"storage: unknown storage {self.storage!r}; one of {', '.join(STORAGES)}")
        if self.mode not in MODES:
            raise ConfigError(f"mode: unknown mode {self.mode!r}; one of {', '.join(MODES)}")
        if self.storage == "s3" and not self.bucket:
            raise ConfigError("bucket: s3 storage needs a bucket")
        if self.tcp not in TCP_POLICIES:
            raise ConfigError(f"tcp: unknown policy {self.tcp!r}; one of {', '.join(TCP_POLICIES)}")
        if not 0 <= self.deadline_margin_s < self.notice_s:
            raise ConfigError(f"deadline_margin_s: must be from 0 to less than notice_s, got {self.deadline_margin_s}")
        for name in ("ghost_limit_mb", "local_files_limit_mb"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1, got {getattr(self, name)}")
        for name in ("local_dirs", "image_dirs"):
            relative = [d for d in getattr(self, name) if not d.startswith("/") or d.rstrip("/") == ""]
            if relative:
                raise ConfigError(f"{name}: must be absolute directories other than /, got {relative[0]!r}")
        if self.nodes:
            self._check_nodes()
        if self.workdir == Path():
            object.__setattr__(self, "workdir", default_workdir(self.job_id))
        if self.scratch_dir == Path():
            object.__setattr__(self, "scratch_dir", self.state_dir / "scratch")

    def _check_nodes(self) -> None:
        if len(self.nodes) < 2 or len(set(self.nodes)) != len(self.nodes):
            raise ConfigError(f"nodes: a multi-node job has two or more distinct addresses, got {list(self.nodes)}")
        if not 0 <= self.node_index < len(self.nodes):
            raise ConfigError(f"node_index: must be from 0 to {len(self.nodes) - 1}, got {self.node_index}")
        if not re.fullmatch(r"[0-9a-f]{64,}", self.launch_key):
            raise ConfigError("launch_key: a multi-node job needs the run's launch key, 32 bytes or more in hex")

    def to_json(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        for key, value in values.items():
            if isinstance(value, Path):
                values[key] = str(value)
        values["command"] = list(self.command)
        values["env"] = dict(self.env)
        return values

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AgentConfig:  # noqa: PLR0912 (one branch per field type)
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"unknown fields {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for name, value in data.items():
            kind = str(known[name].type)
            if kind == "Path":
                _expect(name, value, str)
                values[name] = Path(value)
            elif kind == "bool":
                if not isinstance(value, bool):
                    raise ConfigError(f"{name}: must be true or false, got {type(value).__name__}")
                values[name] = value
            elif kind == "int":
                _expect(name, value, int)
                values[name] = value
            elif kind == "str":
                _expect(name, value, str)
                values[name] = value
            elif kind == "tuple[str, ...]":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ConfigError(f"{name}: must be a list of strings")
                values[name] = tuple(value)
            else:
                if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                    raise ConfigError(f"{name}: must be an object of strings")
                values[name] = dict(value)
        for name, spec in known.items():
            required = spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING
            if name not in values and required:
                raise ConfigError(f"{name}: missing")
        return cls(**values)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(path)


def _expect(name: str, value: object, kind: type) -> None:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{name}: must be {kind.__name__}, got {type(value).__name__}")


def config_path(environ: Mapping[str, str]) -> Path:
    return Path(environ.get(CONFIG_ENV, str(DEFAULT_CONFIG_PATH)))


def load(environ: Mapping[str, str]) -> AgentConfig:
    """Read agent.json and apply the environment's path and endpoint overrides."""
    path = config_path(environ)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ConfigError(f"{path} does not exist: run `spotcr-agent bootstrap` first") from error
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path} cannot be read: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    config = AgentConfig.from_json(data)
    return with_overrides(config, environ)


def with_overrides(config: AgentConfig, environ: Mapping[str, str]) -> AgentConfig:
    changes: dict[str, Any] = {}
    if IMDS_ENV in environ:
        changes["imds_endpoint"] = environ[IMDS_ENV]
    if STATE_DIR_ENV in environ:
        state_dir = Path(environ[STATE_DIR_ENV])
        changes["state_dir"] = state_dir
        if config.scratch_dir == config.state_dir / "scratch":
            changes["scratch_dir"] = state_dir / "scratch"
    return dataclasses.replace(config, **changes) if changes else config
