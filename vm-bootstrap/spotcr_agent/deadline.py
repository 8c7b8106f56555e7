"""The final dump's deadline: predict it from the job's own periodic dumps, and plan the interval to meet it.

Every periodic dump measures the pipeline to the job's storage (CRIU's dump; the store reading, chunking and
hashing every byte; compressing and uploading the new ones) and how much of the job changed since its parent
checkpoint (the bytes of chunks the parent did not hold: exactly what a final dump would send). Without
soft-dirty tracking a final dump reads all of memory and sends what changed since the last periodic one, so

    final dump = detection + memory / CRIU rate + memory / scan rate + changed bytes / send rate

where the changed share grows with the time since the last periodic checkpoint at the job's measured dirty rate
(linear, capped at all of memory: never less than a job rewriting random pages would need). The stages are
summed, not overlapped, so the prediction errs long where they overlap; it has no fixed cost, so it errs short
for a job small enough that the dump's fixed work outweighs its bytes (the pipeline benchmark measures both).
The worst moment for the notice is just before the next periodic dump commits (the changed share is then
largest), or as a periodic dump starts (the final dump waits for it: one CRIU at a time). The plan keeps the
job's interval when that fits the notice less the margin, shortens it when it does not, and says so, with the
figures, when even the shortest interval cannot fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from spotcr_contracts.tags import DEFAULT_DEADLINE_MARGIN_S, SPOT_NOTICE_S

AWS_NOTICE_S = SPOT_NOTICE_S
DEFAULT_MARGIN_S = DEFAULT_DEADLINE_MARGIN_S  # spotcr:deadline-margin: what the plan keeps free of the notice
SHORTEST_INTERVAL_S = 60  # the control plane's scheduler looks for due jobs once a minute
# The daemon polls IMDS for the notice this often (daemon.POLL_S): a poll costs nothing on the VM's own link, and a
# wave's final-dump commands can take longer than AWS's suggested 5 s to arrive (bench/results/reclaim-100.md).
NOTICE_DETECTION_S = 0.5
KEEP_SAMPLES = 5
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Sample:
    """What one periodic dump measured. Busy seconds are summed over the store's threads."""

    checkpoint_id: str
    bytes_total: int  # bytes the checkpoint describes (CRIU's images and the job's files)
    bytes_new: int  # raw bytes of the chunks this commit sent
    bytes_changed: int  # raw bytes of the chunks the parent checkpoint did not hold
    since_parent_s: float  # from the parent checkpoint's freeze to this one's; 0 without a parent
    criu_s: float  # CRIU's dump: the job frozen
    store_s: float  # the store's commit, start to manifest
    read_s: float = 0.0  # reading and chunking (one thread)
    hash_s: float = 0.0
    compress_s: float = 0.0
    upload_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Sample:
        return cls(**data)

    @classmethod
    def of(cls, outcome: Any, since_parent_s: float) -> Sample:
        """From a periodic dump's CheckpointOutcome."""
        return cls(
            checkpoint_id=outcome.checkpoint_id,
            bytes_total=outcome.bytes_total,
            bytes_new=outcome.bytes_new,
            bytes_changed=outcome.bytes_changed,
            since_parent_s=since_parent_s,
            criu_s=outcome.criu_seconds,
            store_s=outcome.store_seconds,
            read_s=outcome.read_seconds,
            hash_s=outcome.hash_seconds,
            compress_s=outcome.compress_seconds,
            upload_s=outcome.upload_seconds,
        )

    @property
    def periodic_s(self) -> float:
        return self.criu_s + self.store_s

    def split_store(self) -> tuple[float, float]:
        """The commit's wall seconds spent on every byte (read, chunk, hash) and on new bytes (compress, upload),
        in proportion to the busy seconds of each stage."""
        scan, send = self.read_s + self.hash_s, self.compress_s + self.upload_s
        if scan + send <= 0:
            return self.store_s, 0.0
        return self.store_s * scan / (scan + send), self.store_s * send / (scan + send)


@dataclass(frozen=True)
class Rates:
    """The job's pipeline to its storage, and how fast it dirties its memory."""

    criu_bps: float  # image bytes per second CRIU dumps
    scan_bps: float  # bytes per second the store reads, chunks and hashes
    send_bps: float  # new bytes per second the store compresses and uploads
    dirty_per_s: float | None  # share of the job's bytes that changes per second; None: not measured yet
    periodic_s: float  # a periodic dump, freeze to commit

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> Rates | None:
        """The slowest of the recent dumps for each stage, and the fastest dirtying: the plan errs long."""
        usable = [s for s in samples if s.bytes_total > 0 and s.criu_s > 0 and s.store_s > 0]
        if not usable:
            return None
        criu = min(s.bytes_total / s.criu_s for s in usable)
        scan = min(s.bytes_total / max(s.split_store()[0], 1e-6) for s in usable)
        sends = [s.bytes_new / s.split_store()[1] for s in usable if s.bytes_new > 0 and s.split_store()[1] > 0]
        dirty = [s.bytes_changed / s.bytes_total / s.since_parent_s for s in usable if s.since_parent_s > 0]
        return cls(
            criu_bps=criu,
            scan_bps=scan,
            send_bps=min(sends) if sends else scan,
            dirty_per_s=max(dirty) if dirty else None,
            periodic_s=max(s.periodic_s for s in usable),
        )

    def changed_share(self, seconds: float) -> float:
        """Share of the job's bytes a final dump sends, `seconds` after the last periodic freeze."""
        if self.dirty_per_s is None:
            return 1.0
        return min(1.0, self.dirty_per_s * max(0.0, seconds))

    def final_dump_s(self, memory_bytes: float, changed_share: float, detection_s: float = NOTICE_DETECTION_S) -> float:
        """Notice to durable for a final dump of this much memory, this share of it changed (order to durable with
        detection_s=0)."""
        return (
            detection_s
            + memory_bytes / self.criu_bps
            + memory_bytes / self.scan_bps
            + memory_bytes * changed_share / self.send_bps
        )

    def worst_final_dump_s(self, memory_bytes: float, interval_s: float) -> float:
        """The final dump's time at the worst moment for the notice, with periodic dumps every interval_s."""
        before_next = self.final_dump_s(memory_bytes, self.changed_share(interval_s + self.periodic_s))
        during = self.periodic_s + self.final_dump_s(memory_bytes, self.changed_share(self.periodic_s))
        return max(before_next, during)

    def largest_memory(self, budget_s: float, changed_share: float) -> float:
        """The most memory whose final dump, this share changed, fits budget_s (extrapolated from these rates)."""
        per_byte = 1 / self.criu_bps + 1 / self.scan_bps + changed_share / self.send_bps
        return max(0.0, (budget_s - NOTICE_DETECTION_S) / per_byte)


@dataclass(frozen=True)
class Plan:
    """The interval the control plane should order periodic dumps at, and why."""

    interval_s: int
    predicted_final_s: float  # worst case at that interval
    budget_s: float  # the notice less the margin
    fits: bool
    reason: str  # why the interval is shorter than the job's, or why even the shortest cannot fit; "" otherwise


def plan(
    samples: Sequence[Sample],
    *,
    interval_s: int,
    notice_s: float = AWS_NOTICE_S,
    margin_s: float = DEFAULT_MARGIN_S,
    shortest_s: int = SHORTEST_INTERVAL_S,
) -> Plan | None:
    """The longest interval up to the job's own whose worst final dump fits the notice less the margin."""
    rates = Rates.of(samples)
    if rates is None:
        return None
    memory = samples[-1].bytes_total
    budget = notice_s - margin_s
    shortest = min(shortest_s, interval_s)
    if rates.worst_final_dump_s(memory, interval_s) <= budget:
        return Plan(interval_s, round(rates.worst_final_dump_s(memory, interval_s), 1), budget, True, "")
    if rates.worst_final_dump_s(memory, shortest) > budget:
        predicted = rates.worst_final_dump_s(memory, shortest)
        reason = _cannot_fit(rates, memory, shortest, predicted, budget)
        return Plan(shortest, round(predicted, 1), budget, False, reason)
    low, high = shortest, interval_s  # fits at low, not at high: the predicted time grows with the interval
    while high - low > 1:
        middle = (low + high) // 2
        if rates.worst_final_dump_s(memory, middle) <= budget:
            low = middle
        else:
            high = middle
    predicted = rates.worst_final_dump_s(memory, low)
    reason = (
        f"periodic checkpoints every {low} s instead of {interval_s} s: the job changes "
        f"{_percent(rates.dirty_per_s)} of its {memory / GiB:.2f} GiB per second, and at {interval_s} s a final "
        f"dump would take about {rates.worst_final_dump_s(memory, interval_s):.0f} s, more than the {budget:.0f} s "
        f"the {notice_s:.0f} s notice leaves after the {margin_s:.0f} s margin"
    )
    return Plan(low, round(predicted, 1), budget, True, reason)


def _cannot_fit(rates: Rates, memory: float, shortest: int, predicted: float, budget: float) -> str:
    read_all = NOTICE_DETECTION_S + memory / rates.criu_bps + memory / rates.scan_bps
    return (
        f"the final dump cannot fit the notice: even with periodic checkpoints every {shortest} s it would take "
        f"about {predicted:.0f} s against {budget:.0f} s (the notice less the margin); CRIU and reading the job's "
        f"{memory / GiB:.2f} GiB alone take {read_all:.0f} s (CRIU {rates.criu_bps / MiB:.0f} MiB/s, store "
        f"{rates.scan_bps / MiB:.0f} MiB/s, upload {rates.send_bps / MiB:.0f} MiB/s); the job may lose its work "
        f"since the last checkpoint: give it less memory, faster storage or a larger instance, or accept it"
    )


def cannot_fit(
    samples: Sequence[Sample],
    since_freeze_s: float,
    seconds_left: float,
    dirty_seen: Sequence[float] = (),
    dirty_at_least: float = 0.0,
) -> str:
    """Why a final dump begun now cannot be durable in the seconds the notice has left, even at the best this job's
    periodic dumps measured; "" when it may fit, or nothing was measured here yet.

    The bound is the least the dump can take: each stage at the fastest rate measured, the stages fully
    overlapped (the slowest alone counts), and the slowest dirtying measured since the last freeze (none when
    not measured). A dump this refuses could not have fitted at any rate the job has shown; one it lets begin may
    still miss. Only for a dump that reads all of memory (no dirty-page tracking). `dirty_seen`: dirty rates the
    job showed outside the samples (a periodic commit stopped for the final dump: inflight.py); `dirty_at_least`: a
    rate the job is known to have reached since the last freeze (memsample.py), which the slowest cannot undercut."""
    usable = [s for s in samples if s.bytes_total > 0 and s.criu_s > 0 and s.store_s > 0]
    if not usable:
        return ""
    memory = usable[-1].bytes_total
    criu_s = memory / max(s.bytes_total / s.criu_s for s in usable)
    scan_s = memory / max(s.bytes_total / max(s.split_store()[0], 1e-6) for s in usable)
    dirty = [s.bytes_changed / s.bytes_total / s.since_parent_s for s in usable if s.since_parent_s > 0]
    dirty += dirty_seen
    sends = [s.bytes_new / s.split_store()[1] for s in usable if s.bytes_new > 0 and s.split_store()[1] > 0]
    share = min(1.0, max(min(dirty) if dirty else 0.0, dirty_at_least) * max(0.0, since_freeze_s))
    send_s = memory * share / max(sends) if sends else 0.0
    least = max(criu_s, scan_s, send_s)
    if least <= seconds_left:
        return ""
    return (
        f"the final dump cannot fit the {max(seconds_left, 0.0):.1f} s the notice has left: at the fastest this "
        f"job's periodic dumps measured it takes at least {least:.1f} s for its {memory / GiB:.2f} GiB (CRIU "
        f"{criu_s:.1f} s, reading and hashing {scan_s:.1f} s, sending the {share:.0%} changed since the last "
        f"checkpoint {send_s:.1f} s, all overlapped), so it is not begun: the backup restores the newest checkpoint "
        "now rather than when the notice runs out"
    )


def _percent(share: float | None) -> str:
    return "all" if share is None else f"{share:.2%}"


def remember(samples: Iterable[dict[str, Any]], sample: Sample) -> list[dict[str, Any]]:
    """The newest KEEP_SAMPLES samples as the agent's state keeps them."""
    return [*samples, sample.to_json()][-KEEP_SAMPLES:]


def checkpoint_seconds(checkpoint_id: str) -> float:
    """The unix time a checkpoint's id names (taken right before its freeze)."""
    return int(checkpoint_id.split("-", 1)[0]) / 1000


def since_parent(checkpoint_id: str, parent: str | None) -> float:
    if not parent:
        return 0.0
    return max(0.0, checkpoint_seconds(checkpoint_id) - checkpoint_seconds(parent))
