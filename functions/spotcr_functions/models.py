"""The job record (one item of the registry) and the EC2 events the handlers accept."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from decimal import Decimal
from typing import Any, Literal

from aws_lambda_powertools.utilities.parser.models import EventBridgeModel
from pydantic import BaseModel, ConfigDict, Field
from spotcr_contracts.nodes import NodeRecord
from spotcr_contracts.protocol import ACTIVE, ENDED, Status  # noqa: F401 (the record's statuses, re-exported)

INSTANCE_ID_PATTERN = r"^i-[0-9a-f]{8,17}$"


@dataclass(frozen=True)
class JobRecord:
    """One job in the registry. `generation` is the fencing token, bumped once per interruption."""

    job_id: str
    status: Status
    generation: int
    instance_id: str
    az: str
    subnet_id: str
    vpc_id: str
    instance_type: str
    storage: str
    interval_s: int
    tags: Mapping[str, str]  # the job's spotcr tags, as a backup VM carries them
    fallback_types: tuple[str, ...] = ()
    # The job's current instance's AMI: a backup restores only on the image the checkpoint was taken on, so it
    # launches from this one, not from the template's (resolved again at every deploy).
    image_id: str = ""
    image_warning: str | None = None  # why the newest backup launched from the template's image instead
    # This run's identity (spotcr:run), minted at registration: a name reused after COMPLETED or FAILED is a new run
    # that never sees the earlier run's checkpoints; events and commands of another run never move this one.
    run_id: str = ""
    volume_id: str | None = None
    access_point_arn: str | None = None  # the job's EFS access point (efs storage), deleted when the job ends
    checkpoint_id: str | None = None  # newest committed
    previous_checkpoint_id: str | None = None
    checkpoint_instance_id: str | None = None  # the instance that committed checkpoint_id
    # The sequence of the newest dump order (periodic, or the final dump a warning orders): minted by the write that
    # orders it, carried in the command into the checkpoint's id; checkpoints are ordered by (generation, sequence).
    dump_sequence: int = 0
    restore_ordered_at: str | None = None  # ISO time the recovery ordered a restore: the old instance's dumps are late
    # Unix seconds: while RUNNING/CHECKPOINTING the next periodic dump; while PENDING the deadline to start by.
    next_checkpoint_at: int | None = None
    recovering_from: str | None = None  # the instance whose interruption bumped the generation
    interrupted_at: str | None = None  # ISO time of the warning (or of the missed-warning state change)
    backup_instance_id: str | None = None
    backup_az: str | None = None
    handover_snapshot_id: str | None = None
    handover_volume_id: str | None = None
    exit_code: int | None = None
    result: str | None = None  # where the finished job's result (its final work dir) is stored
    reason: str | None = None
    # The agent's deadline plan, from its newest periodic dump: the interval periodic dumps are ordered at (the
    # job's own or shorter), the predicted final dump's seconds, and why it cannot fit the notice (None: it fits).
    planned_interval_s: int | None = None
    predicted_final_dump_s: int | None = None
    final_dump_risk: str | None = None
    # A job over several VMs (docs/design/multinode.md): its node count (0: a single-VM job), the nodes registered
    # so far (every one once it runs), and the run's launch key, which signs the agents' port. `instance_id` is
    # node 0's instance, the coordinator, once node 0 registered (before that: the first node's).
    node_count: int = 0
    nodes: tuple[NodeRecord, ...] = ()
    launch_key: str | None = None
    # While such a job recovers: the index of the node whose instance (recovering_from) was warned or lost, and
    # whose share the backup takes over with its address.
    interrupted_node: int | None = None
    updated_at: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)  # token_* and event_* attributes

    @classmethod
    def from_item(cls, item: Mapping[str, Any]) -> JobRecord:
        names = {f.name for f in fields(cls)} - {"extra"}
        values: dict[str, Any] = {k: _plain(v) for k, v in item.items() if k in names}
        values["status"] = Status(values["status"])
        values["fallback_types"] = tuple(values.get("fallback_types", ()))
        nodes = values.get("nodes") or {}
        values["nodes"] = tuple(sorted((NodeRecord.from_item(n) for n in nodes.values()), key=lambda n: n.index))
        values["extra"] = {k: _plain(v) for k, v in item.items() if k not in names}
        return cls(**values)

    def to_item(self) -> dict[str, Any]:
        item = {k: v for k, v in asdict(self).items() if v is not None and k != "extra"}
        item["status"] = str(self.status)
        item["fallback_types"] = list(self.fallback_types)
        item["tags"] = dict(self.tags)
        for name in ("node_count", "nodes"):
            item.pop(name)
        if self.node_count:
            item["node_count"] = self.node_count
            item["nodes"] = {str(node.index): node.to_item() for node in self.nodes}
        return item

    def node_of(self, instance_id: str) -> NodeRecord | None:
        """The node this instance holds, if any."""
        return next((node for node in self.nodes if node.instance_id == instance_id), None)

    def node(self, index: int) -> NodeRecord:
        """The node of this index (KeyError naming it when the record lists none)."""
        found = next((node for node in self.nodes if node.index == index), None)
        if found is None:
            raise KeyError(f"job {self.job_id} lists no node {index}")
        return found

    @property
    def lost_nodes(self) -> dict[int, LostNode]:
        """The other nodes lost while this recovery runs, before its restore was ordered, by index."""
        found = {}
        for attribute, value in self.extra.items():
            if attribute.startswith(LOST_NODE_PREFIX) and isinstance(value, dict):
                found[int(attribute.removeprefix(LOST_NODE_PREFIX))] = LostNode.from_item(value)
        return dict(sorted(found.items()))

    def node_0_instance(self) -> str:
        """The instance that holds node 0 now (a recovery moves it before it orders the restore); the job's own
        instance for a single-VM job."""
        node = next((node for node in self.nodes if node.index == 0), None)
        return node.instance_id if node else self.instance_id

    def backups(self) -> tuple[str, ...]:
        """Every backup this recovery launched: the interrupted node's (or the one VM's), and each lost node's."""
        lost = (node.backup for node in self.lost_nodes.values())
        return tuple(backup for backup in (self.backup_instance_id, *lost) if backup)

    def token(self, key: str) -> dict[str, Any] | None:
        value = self.extra.get(token_attribute(key))
        return value if isinstance(value, dict) else None

    def arrival(self, key: str) -> dict[str, Any] | None:
        value = self.extra.get(event_attribute(key))
        return value if isinstance(value, dict) else None


LOST_NODE_PREFIX = "lost_node_"


@dataclass(frozen=True)
class LostNode:
    """A node of a job over several VMs lost while another node's recovery runs, before its restore was ordered
    (a wave warns several nodes at once): the same restore brings it back, on a backup of its own that takes over
    its address (docs/design/multinode.md). Kept in the record as lost_node_<index>."""

    instance_id: str  # the node's instance that was warned or lost
    backup: str = ""  # its backup, once launched (its ready report is kept by instance: Registry.note_ready)

    @classmethod
    def from_item(cls, item: Mapping[str, Any]) -> LostNode:
        return cls(str(item["instance_id"]), str(item.get("backup") or ""))


def lost_node_attribute(index: int) -> str:
    return f"{LOST_NODE_PREFIX}{index}"


def token_attribute(key: str) -> str:
    return "token_" + key.replace("-", "_")


def event_attribute(key: str) -> str:
    return "event_" + key.replace("-", "_")


def _plain(value: Any) -> Any:
    """DynamoDB numbers come back as Decimal; the record holds ints and floats."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class _Detail(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class InstanceDetail(_Detail):
    instance_id: str = Field(alias="instance-id", pattern=INSTANCE_ID_PATTERN)


class InterruptionDetail(InstanceDetail):
    # AWS defines exactly these three; anything else is not an interruption warning this parser knows.
    instance_action: Literal["terminate", "stop", "hibernate"] = Field(alias="instance-action")


class StateChangeDetail(InstanceDetail):
    state: str


class TagChangeDetail(_Detail):
    service: str
    resource_type: str = Field(alias="resource-type")
    changed_tag_keys: list[str] = Field(alias="changed-tag-keys")
    tags: dict[str, str] = Field(default_factory=dict)


class ExecutionStatusDetail(_Detail):
    execution_arn: str = Field(alias="executionArn")
    state_machine_arn: str = Field(alias="stateMachineArn")
    name: str
    status: Literal["RUNNING", "SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED", "PENDING_REDRIVE"]
    input: str | None = None
    error: str | None = None
    cause: str | None = None


class RecoveryEnded(EventBridgeModel):
    """Step Functions Execution Status Change of an execution that ended without running its Catch."""

    detail: ExecutionStatusDetail


class InterruptionWarning(EventBridgeModel):
    """EC2 Spot Instance Interruption Warning, and EC2 Capacity Reservation Instance Interruption Warning (same
    detail: instance-id, instance-action, plus instance-termination-time and azId, which recovery does not need)."""

    detail: InterruptionDetail


class RebalanceRecommendation(EventBridgeModel):
    detail: InstanceDetail


class StateChange(EventBridgeModel):
    detail: StateChangeDetail


class TagChange(EventBridgeModel):
    detail: TagChangeDetail

    def instance_id(self) -> str | None:
        for arn in self.resources:
            candidate = arn.rsplit("/", 1)[-1]
            if arn.startswith("arn:aws") and ":instance/" in arn and candidate.startswith("i-"):
                return candidate
        return None
