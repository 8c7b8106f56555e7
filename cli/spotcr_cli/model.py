"""The planning model behind `spotcr plan`: formulas only, no I/O.

Two models live here:
- the original research's long-running model (HADS-CheckRec, Teylo et al. 2020): a run of W hours of work,
  checkpointed every H hours, each checkpoint stopping the job for S seconds (CRIU writing straight to the
  storage, as the research measured it), G GB kept for a month;
- spotcr's planner: the Young/Daly interval for the job's periodic checkpoints, the final dump projected
  against the two-minute notice, the expected overhead, and what a user pays on each storage: the VM, the
  requests (S3 PUTs and GETs, EFS's per-GB throughput) and the storage the retention keeps.

docs/planning.md states every formula and default below, with its source.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from spotcr_agent.config import AgentConfig
from spotcr_agent.store.store import GRACE_SECONDS
from spotcr_contracts.tags import INTERVAL, MAX_INTERVAL_S, MAX_NODES, MIN_INTERVAL_S, STORAGES
from spotcr_functions.config import Settings

MIB_PER_GIB = 1024.0
HOURS_PER_MONTH = 730.0  # AWS bills GB-month as 730 hours
SECONDS_PER_DAY = 86400.0
NOTICE_S = 120.0  # the spot interruption warning comes two minutes before the action (REFERENCE.md)


# How long the control plane waits for the final dump: the notice less the time to order it (its one home).
FINAL_DUMP_BUDGET_S = float(Settings.final_dump_wait_s)


class PlanInputError(ValueError):
    """A plan input is out of range or unknown; the message names it."""


@dataclass(frozen=True)
class Source:
    value: float
    source: str


# Storage write/read rates per VM (MiB/s) when no probe result is given. Sources: /work/shared/REFERENCE.md.
DEFAULT_WRITE_MIB_S: Mapping[str, Source] = {
    "s3": Source(
        35.3,
        "S3 via s3fs-fuse, 1 VM: Rodamilans & Borin 2020 (36 MB/s in HADS-CheckRec); a lower bound "
        "for spotcr's parallel PUTs: run `spotcr probe`",
    ),
    "ebs": Source(125.0, "EBS gp3 baseline, 125 MiB/s (AWS); HADS-CheckRec measured ~139 MB/s on EBS SSD"),
    "efs": Source(90.6, "EFS, 1 VM: Rodamilans & Borin 2020 (~98 MB/s in HADS-CheckRec)"),
    "fsx": Source(173.2, "FSx for Lustre 1.2 TiB, 1 VM: Rodamilans & Borin 2020"),
}
DEFAULT_READ_MIB_S: Mapping[str, Source] = {
    storage: Source(rate.value, "no published read figure: taken equal to the write rate")
    for storage, rate in DEFAULT_WRITE_MIB_S.items()
}
DEFAULT_LOCAL_DUMP_MIB_S = Source(
    1190.0, "CRIU periodic dump to local scratch, job frozen 0.86 s for 1 GiB: bench/results/README.md, case (p)"
)
DEFAULT_PIPELINE_MIB_S = Source(
    217.0,
    "the agent's chunk+hash+compress+put path into a directory, 0.5 GiB in 2.36 s on 2 loaded cores: "
    "bench/results/README.md, final-dump",
)
DEFAULT_BOOT_S = Source(
    90.0,
    "backup VM from RunInstances to a registered SSM Agent: running in 5-20 s, SSM Agent 30 s to minutes "
    "(REFERENCE.md, AWS facts)",
)
# USD per GB-month, us-east-1. S3, EBS and EFS: the research's prices (REFERENCE.md). FSx: AWS's price list.
DEFAULT_STORAGE_PRICE: Mapping[str, Source] = {
    "s3": Source(0.023, "S3 Standard, HADS-CheckRec (April 2020)"),
    "ebs": Source(0.10, "EBS SSD per provisioned GB, HADS-CheckRec (April 2020)"),
    "efs": Source(0.30, "EFS frequent access, HADS-CheckRec (April 2020)"),
    "fsx": Source(0.14, "FSx for Lustre SCRATCH_2 per provisioned GB, AWS price list us-east-1 (not in the research)"),
}


@dataclass(frozen=True)
class RequestPrice:
    """What a storage charges for its use, beside the GB-month: USD per 1,000 PUTs and GETs, per GB written and read."""

    put_per_1000: float
    get_per_1000: float
    write_per_gb: float
    read_per_gb: float
    source: str


# List prices, us-east-1, as published by AWS in 2026 (unchanged since the research's April 2020 for S3).
REQUEST_PRICE: Mapping[str, RequestPrice] = {
    "s3": RequestPrice(
        0.005, 0.0004, 0.0, 0.0, "S3 Standard PUT $0.005 and GET $0.0004 per 1,000: aws.amazon.com/s3/pricing (2026)"
    ),
    "ebs": RequestPrice(
        0.0,
        0.0,
        0.0,
        0.0,
        "EBS: no request charge; the snapshot that moves a volume to another zone at a recovery is deleted once "
        "restored ($0.05 per GB-month for minutes): not counted",
    ),
    "efs": RequestPrice(
        0.0,
        0.0,
        0.06,
        0.03,
        "EFS Elastic Throughput (the stack's mode): $0.06 per GB written, $0.03 per GB read: "
        "aws.amazon.com/efs/pricing (2026)",
    ),
    "fsx": RequestPrice(0.0, 0.0, 0.0, 0.0, "FSx for Lustre: throughput is included in the GB-month price"),
}
# S3 requests per GiB of new checkpoint data, counted at the endpoint by `make bench` (bench/results/store.md): the
# store packs chunks into 32 MiB objects, so a full 2 GiB final dump wrote 35 objects (17.5 PUTs per GiB); its
# restore read them back in ranged GETs of at most 8 MiB, 160 for 2 GiB (80 per GiB). Update from `make bench`.
S3_PUTS_PER_GIB = Source(17.5, "32 MiB packs: 35 objects for 2 GiB, counted at the endpoint (bench/results/store.md)")
S3_GETS_PER_GIB = Source(80.0, "ranged reads of at most 8 MiB: 160 for 2 GiB (bench/results/store.md)")
# Retention: the agent keeps its newest keep_checkpoints, and any older one whose successor is younger than the
# store's grace (a restore may still read it).
KEEP_CHECKPOINTS = AgentConfig.keep_checkpoints
PRUNE_GRACE_S = GRACE_SECONDS
# The stack's versioned bucket bills what the store deletes for this many days more: noncurrent_version_days in
# infra/settings.py, its default (tests/cli/test_plan.py checks the two agree).
NONCURRENT_VERSION_DAYS = 1

# Storage billed by provisioned size, not by bytes stored: the stack's defaults.
PROVISIONED_GIB: Mapping[str, Source] = {
    "ebs": Source(100.0, "ebs_volume_gib, the stack's default EBS volume"),
    "fsx": Source(1200.0, "fsx_storage_gib, the stack's default FSx size"),
}

# AWS Spot Instance Advisor "frequency of interruption": the share of instances interrupted in a month.
# A band counts as its upper edge (">20%" as 25%), and a monthly share p becomes a rate per hour,
# lambda = -ln(1 - p) / 730, so that 1 - exp(-lambda * 730) = p.
BANDS: Mapping[str, float] = {"<5%": 0.05, "5-10%": 0.10, "10-15%": 0.15, "15-20%": 0.20, ">20%": 0.25}


def band_rate_per_hour(band: str) -> float:
    share = BANDS[band]
    return -math.log(1.0 - share) / HOURS_PER_MONTH


def parse_rate(text: str) -> tuple[float, str]:
    """An interruption rate: a number of interruptions per hour, or a Spot Instance Advisor band."""
    cleaned = text.strip().replace(" ", "")
    if cleaned in BANDS:
        return band_rate_per_hour(cleaned), f"Spot Instance Advisor band {cleaned} per month"
    if re.fullmatch(r"[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?", cleaned):
        rate = float(cleaned)
        if rate <= 0:
            raise PlanInputError(f"interruption rate must be above 0 per hour, got {text!r}")
        return rate, "given, per hour"
    raise PlanInputError(
        f"interruption rate {text[:32]!r} is neither a number per hour nor a Spot Instance Advisor band "
        f"({', '.join(BANDS)})"
    )


def parse_rewritten(text: str, memory_gib: float) -> float:
    """GiB the job rewrites between two periodic checkpoints: a share of its memory (5% or 0.05) or GiB (3.2GiB)."""
    positive("--memory-gib", memory_gib)
    cleaned = text.strip().replace(" ", "")
    number = r"[0-9]*\.?[0-9]+"
    if re.fullmatch(number + r"(GiB|%)?", cleaned):
        if cleaned.endswith("GiB"):
            gib = float(cleaned[:-3])
        else:
            share = float(cleaned[:-1]) / 100.0 if cleaned.endswith("%") else float(cleaned)
            if share > 1:
                raise PlanInputError(f"--rewritten-per-interval {text!r}: a share of the memory is at most 100%")
            gib = share * memory_gib
        if gib <= memory_gib:
            return gib
        raise PlanInputError(f"--rewritten-per-interval {text!r} is more than the job's {memory_gib:g} GiB")
    raise PlanInputError(
        f"--rewritten-per-interval {text[:32]!r}: expected a share of the memory (5% or 0.05) or GiB (3.2GiB)"
    )


def check_storage(storage: str) -> str:
    if storage not in STORAGES:
        raise PlanInputError(f"unknown storage {storage[:32]!r}; one of {', '.join(STORAGES)}")
    return storage


def positive(name: str, value: float, *, zero_ok: bool = False) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise PlanInputError(f"{name} must be {'0 or more' if zero_ok else 'above 0'}, got {value}")
    return value


@dataclass(frozen=True)
class ResearchRun:
    """The research's long-running model, exactly:

    checkpoints   = ceil(W / H)            one at the end of every interval, the last (shorter) one included
    total_hours   = W + checkpoints * S / 3600   the job is stopped while each checkpoint is written
    total_cost    = total_hours * P + G * X      the VM for the whole run, G GB kept for the month
    """

    work_hours: float
    interval_hours: float
    dump_seconds: float
    stored_gb: float
    vm_price_hour: float
    storage_price_gb_month: float

    def __post_init__(self) -> None:
        positive("--work-hours", self.work_hours)
        positive("--interval-hours", self.interval_hours)
        positive("--dump-seconds", self.dump_seconds, zero_ok=True)
        positive("--stored-gb", self.stored_gb, zero_ok=True)
        positive("--vm-price-hour", self.vm_price_hour, zero_ok=True)
        positive("--storage-price-gb-month", self.storage_price_gb_month, zero_ok=True)

    @property
    def checkpoints(self) -> int:
        return math.ceil(self.work_hours / self.interval_hours)

    def to_json(self) -> dict[str, Any]:
        checkpoint_hours = self.checkpoints * self.dump_seconds / 3600.0
        total_hours = self.work_hours + checkpoint_hours
        vm_cost = total_hours * self.vm_price_hour
        storage_cost = self.stored_gb * self.storage_price_gb_month
        return {
            "model": "research",
            "inputs": asdict(self),
            "checkpoints": self.checkpoints,
            "checkpoint_hours": checkpoint_hours,
            "total_hours": total_hours,
            "checkpoint_share": checkpoint_hours / total_hours,
            "vm_cost": vm_cost,
            "storage_cost": storage_cost,
            "total_cost": vm_cost + storage_cost,
        }


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young (1974): T = sqrt(2 C M)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly (2006), the higher-order refinement of Young's interval (work between checkpoints):

    T = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C   for C < 2M, else T = M.
    """
    if checkpoint_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - checkpoint_s


@dataclass(frozen=True)
class Rates:
    """Throughputs for one storage, MiB/s, each with where it came from."""

    write: Source
    read: Source
    pipeline: Source
    local_dump: Source

    @property
    def effective_write(self) -> float:
        """The final dump and the upload go through the agent's pipeline into the storage: the slower bounds it."""
        return min(self.write.value, self.pipeline.value)


@dataclass(frozen=True)
class JobPlanInput:
    memory_gib: float
    dirty_gib_per_min: float
    rate_per_hour: float  # one VM's interruptions per hour
    rate_source: str
    work_hours: float
    vm_price_hour: float
    on_demand_price_hour: float | None = None
    stored_gib: float | None = None  # None: what the retention keeps (see checkpoint_costs)
    rewritten_gib: float | None = None  # new data per periodic checkpoint; None: min(memory, dirty rate * interval)
    storage_price: Mapping[str, Source] = field(default_factory=lambda: dict(DEFAULT_STORAGE_PRICE))
    boot: Source = DEFAULT_BOOT_S
    interval_s: float | None = None  # None: Daly's interval
    # A job over several VMs: this many nodes, each with `memory_gib` and the VM price; the job is interrupted
    # whenever any node is (job_rate_per_hour).
    nodes: int = 1

    @property
    def job_rate_per_hour(self) -> float:
        """The job's interruptions per hour: any of its nodes' (independent, so N times one VM's)."""
        return self.rate_per_hour * self.nodes

    def __post_init__(self) -> None:
        positive("--memory-gib", self.memory_gib)
        positive("--dirty-gib-per-min", self.dirty_gib_per_min, zero_ok=True)
        positive("--interruption-rate", self.rate_per_hour)
        positive("--work-hours", self.work_hours)
        positive("--vm-price-hour", self.vm_price_hour, zero_ok=True)
        if self.on_demand_price_hour is not None:
            positive("--on-demand-price-hour", self.on_demand_price_hour, zero_ok=True)
        if self.stored_gib is not None:
            positive("--stored-gib", self.stored_gib, zero_ok=True)
        if self.rewritten_gib is not None:
            positive("--rewritten-per-interval", self.rewritten_gib, zero_ok=True)
        if self.interval_s is not None:
            positive("--interval", self.interval_s)
        if not 1 <= self.nodes <= MAX_NODES:
            raise PlanInputError(f"--nodes must be from 1 to {MAX_NODES}, got {self.nodes}")


def plan_storage(job: JobPlanInput, storage: str, rates: Rates) -> dict[str, Any]:
    """The plan for one storage. Times in seconds, work in seconds of the job's own progress.

    C  = memory / local dump rate          the job's freeze per periodic checkpoint (images go to local scratch,
                                           the upload runs while the job does)
    U  = memory / effective write rate      a full upload; the interval must be longer than it
    M  = 1 / rate                           mean time between interruptions
    T  = Daly(C, M)                         the interval (Young's sqrt(2CM) is shown beside it)
    final dump after t seconds of work since the last checkpoint:
       F(t) = memory / local dump rate + min(memory, dirty * t) / effective write rate
       it fits when F(t) <= budget (the notice less the control plane's margin); t_fit solves F(t) = budget
    expected work lost per interruption, the interruption uniform over the interval:
       L = (T^2 - t_fit^2) / (2 T) when t_fit < T, else 0        (Young/Daly assume L = T / 2: no final dump)
    restart R = final dump (or a failed one: the budget) + boot + memory / read rate
    overhead per hour of work = C / T + rate * (L + R)       (first order: time lost, as a share of the work)
    cost of the run = run hours * VM price + requests + storage kept             (see checkpoint_costs)
    A job of N nodes: memory is one node's, every node dumps and restores its own at once (so C, F, R are one
    node's), rate is N times one VM's (a job is interrupted when any node is), and the VM price, the requests and
    the storage kept are N times one node's.
    """
    memory_mib = job.memory_gib * MIB_PER_GIB
    mtbf_s = 3600.0 / job.job_rate_per_hour
    freeze_s = memory_mib / rates.local_dump.value
    upload_s = memory_mib / rates.effective_write
    young_s = young_interval_s(freeze_s, mtbf_s)
    daly_s = daly_interval_s(freeze_s, mtbf_s)
    interval_s = job.interval_s if job.interval_s is not None else daly_s
    dirty_mib_s = job.dirty_gib_per_min * MIB_PER_GIB / 60.0
    worst_changed_mib = min(memory_mib, dirty_mib_s * interval_s)
    final_worst_s = freeze_s + worst_changed_mib / rates.effective_write
    final_first_s = freeze_s + memory_mib / rates.effective_write
    room_mib = (FINAL_DUMP_BUDGET_S - freeze_s) * rates.effective_write
    if room_mib <= 0:
        fit_s = 0.0
    elif room_mib >= memory_mib or dirty_mib_s == 0:
        fit_s = math.inf
    else:
        fit_s = room_mib / dirty_mib_s
    lost_s = (interval_s**2 - fit_s**2) / (2.0 * interval_s) if fit_s < interval_s else 0.0
    restore_s = memory_mib / rates.read.value
    final_s = final_worst_s if final_worst_s <= FINAL_DUMP_BUDGET_S else FINAL_DUMP_BUDGET_S
    restart_s = final_s + job.boot.value + restore_s
    per_work_s = freeze_s / interval_s + (lost_s + restart_s) / mtbf_s
    no_final_per_work_s = freeze_s / interval_s + (interval_s / 2.0 + job.boot.value + restore_s) / mtbf_s
    run_hours = job.work_hours * (1.0 + per_work_s)
    checkpoints = checkpoint_costs(job, storage, interval_s, run_hours)
    vm_cost = run_hours * job.vm_price_hour * job.nodes
    result: dict[str, Any] = {
        "storage": storage,
        "rates_mib_s": {
            "write": asdict(rates.write),
            "read": asdict(rates.read),
            "pipeline": asdict(rates.pipeline),
            "local_dump": asdict(rates.local_dump),
        },
        "checkpoint_freeze_s": freeze_s,
        "full_upload_s": upload_s,
        "interval": {
            "method": "Daly 2006 higher-order" if job.interval_s is None else "given",
            "seconds": interval_s,
            "young_s": young_s,
            "daly_s": daly_s,
            "shorter_than_upload": interval_s < upload_s,
            # The tag to submit the job with; the scheduler runs every minute, so it takes whole minutes in effect.
            "tag": {INTERVAL: str(min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, round(interval_s))))},
        },
        "final_dump": {
            "budget_s": FINAL_DUMP_BUDGET_S,
            "notice_s": NOTICE_S,
            "worst_s": final_worst_s,
            "first_s": final_first_s,
            "fits": final_worst_s <= FINAL_DUMP_BUDGET_S,
            "first_fits": final_first_s <= FINAL_DUMP_BUDGET_S,
            "fits_until_s": None if math.isinf(fit_s) else fit_s,
        },
        "expected_lost_work_per_interruption_s": lost_s,
        "restart_s": restart_s,
        "overhead": per_work_s,
        "overhead_without_final_dump": no_final_per_work_s,
        "run_hours": run_hours,
        **checkpoints,
        "vm_cost": vm_cost,
        "total_cost": vm_cost + checkpoints["requests_cost"] + checkpoints["storage_cost"],
    }
    result["per_day"]["vm_cost"] = 24.0 * job.vm_price_hour * job.nodes
    if job.on_demand_price_hour is not None:
        result["on_demand_cost"] = job.work_hours * job.on_demand_price_hour * job.nodes
    return result


def checkpoint_costs(job: JobPlanInput, storage: str, interval_s: float, run_hours: float) -> dict[str, Any]:
    """What the checkpoints cost on one storage beside the VM: requests and the storage kept, per day and per run.

    N  = new data per periodic checkpoint, GiB: given, else min(memory, dirty rate * T)
    written per day = N * 86400 / T;  read per day = memory * 24 * rate   (every interruption restores the image)
    a run writes the first full image, then N per checkpoint, and reads the image once per interruption
    S3: PUTs = GiB written * objects per GiB, GETs = GiB read * objects per GiB; EFS: a price per GB written and read
    kept checkpoints K = max(keep_checkpoints, ceil(grace / T) + 1)   (an older one stays while its successor is
                                                                      younger than the store's grace)
    kept GiB = min(K * memory, memory + (K - 1) * N)   one full image, and what each later one changed
    S3 also bills what the store deleted for noncurrent_version_days (a versioned bucket): + written per day * days
        (each deleted GiB is billed that many days, partly after the run: steady state * run time counts it exactly)
    billed GiB = kept (or --stored-gib), at least the provisioned size on EBS and FSx
    storage per day = billed GiB * price per GB-month * 24 / 730          (AWS bills "GB" here as GiB)
    A job of N nodes writes, reads and keeps N nodes' worth (rate: the job's, N times one VM's).
    """
    nodes, memory = job.nodes, job.memory_gib
    rewritten = job.rewritten_gib is not None
    new_gib = (
        job.rewritten_gib if job.rewritten_gib is not None else min(memory, job.dirty_gib_per_min * interval_s / 60)
    )
    written_day = nodes * new_gib * SECONDS_PER_DAY / interval_s
    read_day = nodes * memory * 24.0 * job.job_rate_per_hour
    kept_checkpoints = max(KEEP_CHECKPOINTS, math.ceil(PRUNE_GRACE_S / interval_s) + 1)
    kept_gib = nodes * min(kept_checkpoints * memory, memory + (kept_checkpoints - 1) * new_gib)
    noncurrent_gib = written_day * NONCURRENT_VERSION_DAYS if storage == "s3" else 0.0
    stored_gib = job.stored_gib if job.stored_gib is not None else kept_gib + noncurrent_gib
    billed_gib = max(stored_gib, PROVISIONED_GIB[storage].value) if storage in PROVISIONED_GIB else stored_gib
    price = job.storage_price[storage]
    request = REQUEST_PRICE[storage]
    puts_per_gib, gets_per_gib = (S3_PUTS_PER_GIB.value, S3_GETS_PER_GIB.value) if storage == "s3" else (0.0, 0.0)

    def requests_cost(written_gib: float, read_gib: float) -> float:
        return written_gib * (puts_per_gib * request.put_per_1000 / 1000.0 + request.write_per_gb) + read_gib * (
            gets_per_gib * request.get_per_1000 / 1000.0 + request.read_per_gb
        )

    written_run = nodes * (memory + new_gib * run_hours * 3600.0 / interval_s)
    read_run = nodes * memory * run_hours * job.job_rate_per_hour
    result: dict[str, Any] = {
        "new_gib_per_checkpoint": {
            "value": new_gib,
            "source": "given" if rewritten else "the dirty rate over the interval, at most the memory",
        },
        "kept": {
            "checkpoints": kept_checkpoints,
            "gib": kept_gib,
            "noncurrent_gib": noncurrent_gib,
            "rule": f"the newest {KEEP_CHECKPOINTS} (keep_checkpoints) and those younger than "
            f"{PRUNE_GRACE_S:.0f} s after their successor (the store's grace)"
            + (f"; S3 keeps deleted versions {NONCURRENT_VERSION_DAYS} days" if storage == "s3" else ""),
        },
        "storage_billed_gib": billed_gib,
        "storage_price_gb_month": asdict(price),
        "request_price": asdict(request),
        "per_day": {
            "written_gib": written_day,
            "read_gib": read_day,
            "puts": written_day * puts_per_gib,
            "gets": read_day * gets_per_gib,
            "requests_cost": requests_cost(written_day, read_day),
            "storage_cost": billed_gib * price.value * 24.0 / HOURS_PER_MONTH,
        },
        "requests_cost": requests_cost(written_run, read_run),
        "storage_cost": billed_gib * price.value * run_hours / HOURS_PER_MONTH,
    }
    if storage == "s3":
        result["requests_per_gib"] = {"puts": asdict(S3_PUTS_PER_GIB), "gets": asdict(S3_GETS_PER_GIB)}
    if storage in PROVISIONED_GIB:
        result["kept"]["provisioned_gib"] = PROVISIONED_GIB[storage].value
    return result
