"""The final dump against the notice: spotcr's pipeline per core count and storage, as ratios to the floor.

`python -m bench pipeline [--sizes 0.25] [--cores 1 2] [--stores dir s3] [--dirty 0.01 0.05 0.2]`: for each
core count (the benchmark pins itself and its jobs to that many cores with sched_setaffinity, as taskset does),
each storage (a directory store on local disk; S3 on loopback: MinIO when SPOTCR_BENCH_MINIO names its binary,
`minio` is on PATH or bench/install-minio.sh built it, else moto's server, labelled) and each job size, it measures
in one run:

  floor      CRIU dumping the job to tmpfs (not durable)
  full       spotcr's final dump of a job nothing was stored for, notice to durable
  frozen     a periodic dump's freeze: images to a memory scratch (now) and to the disk scratch (before), on the
             job's second and third dumps
  after N%   spotcr's final dump right after a periodic one, N% of memory rewritten in between
  predicted  the deadline model's prediction (spotcr_agent.deadline) from the first periodic dump's figures, less
             the model's second of notice detection: the benchmark orders the final dump, no notice is detected
  where      where the final dump's time went: CRIU, reading and chunking, hashing, compression, upload
  largest    the largest job memory whose final dump fits the 120 s notice, extrapolated from the measured rates

Every figure of a row comes from the same run as its floor. Writes bench/results/pipeline.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.checkpoint import CRIU, checkpointer, criu_unusable, dirty, memory_job, moto_server

MiB = 1 << 20
GiB = 1 << 30
BENCH = Path(__file__).resolve().parent
BUCKET = "spotcr-bench"
NOTICE_S = 120.0
# Seqera Fusion Snapshots' published estimates (REFERENCE.md): job memory, seconds, instance.
FUSION = ((32, 45, "c6id.4xlarge"), (64, 70, "c6id.8xlarge, 12.5 Gbit/s"), (128, 105, "m6id.8xlarge"))
MINIO_BUILT = Path.home() / ".cache/spotcr/minio/minio"  # where bench/install-minio.sh builds it


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench pipeline", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.25], help="job sizes in GiB (0.25; try 0.5 1)")
    parser.add_argument("--cores", type=int, nargs="+", default=[1, 2], help="core counts to pin to (1 2)")
    parser.add_argument("--stores", nargs="+", default=["dir", "s3"], choices=["dir", "s3"])
    parser.add_argument("--dirty", type=float, nargs="+", default=[0.01, 0.05, 0.2], help="shares rewritten")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/spotcr-pipeline"), help="local disk dir")  # noqa: S108
    parser.add_argument("--tmpfs", type=Path, default=Path("/dev/shm/spotcr-pipeline"), help="tmpfs dir (floor)")  # noqa: S108
    parser.add_argument("--results", type=Path, default=BENCH / "results")
    parser.add_argument("--name", default="pipeline", help="results file name: <results>/<name>.json and .md")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if criu_unusable("pipeline"):
        return 2
    machine = describe_machine()
    print(f"spotcr pipeline benchmark: sizes {args.sizes} GiB, cores {args.cores}, stores {args.stores}")
    print(f"machine: {machine['cpus']} cores ({machine['cpu']}), load average {machine['load_before']}")
    rows = []
    all_cpus = sorted(os.sched_getaffinity(0))
    with contextlib.ExitStack() as servers:
        s3 = servers.enter_context(s3_server(args.work)) if "s3" in args.stores else None
        for cores in args.cores:
            os.sched_setaffinity(0, all_cpus[:cores])  # children (CRIU, the job) and new threads inherit it
            try:
                for store_kind in args.stores:
                    for gib in args.sizes:
                        row = bench_one(gib, cores, store_kind, s3, args)
                        rows.append(row)
                        print_row(row)
            finally:
                os.sched_setaffinity(0, all_cpus)
    shutil.rmtree(args.work, ignore_errors=True)
    machine["load_after"] = os.getloadavg()
    write_results(rows, machine, args)
    return 0


def bench_one(gib: float, cores: int, store_kind: str, s3: dict[str, str] | None, args: argparse.Namespace) -> dict:
    from spotcr_agent import deadline
    from spotcr_agent.criu import Criu

    label = s3["label"] if store_kind == "s3" and s3 else "directory on local disk"
    print(f"\n== {gib:g} GiB job, {cores} core(s), {label} ==")
    work = args.work / f"{store_kind}-{cores}c-{gib:g}g"
    shutil.rmtree(work, ignore_errors=True)
    row: dict[str, Any] = {"gib": gib, "cores": cores, "store": store_kind, "store_label": label, "after": {}}
    criu = Criu(CRIU)
    rates = None
    for share in args.dirty:
        job_dir = work / f"job-{share:g}"
        with memory_job(job_dir, gib, share) as job:
            store = make_store(store_kind, work, f"pipe-{cores}c-{int(gib * 1024)}m-{int(share * 100)}")
            agent = checkpointer(job, job_dir, store, work / f"agent-{share:g}")
            if rates is None:
                row["floors"] = [floor(criu, job.pid, args.tmpfs)]
            periodic = agent.checkpoint("periodic", 1)
            if rates is None:
                sample = deadline.Sample.of(periodic, 0.0)
                rates = deadline.Rates.of([sample])
                row["periodic_sample"] = sample.to_json()
                # The freeze compared on the job's 2nd and 3rd dumps (a process's first dump is slower).
                on_disk = checkpointer(job, job_dir, store, work / f"agent-{share:g}", memory_scratch=False)
                row["frozen_disk"] = on_disk.checkpoint("periodic", 1).frozen_seconds
                again = agent.checkpoint("periodic", 1)
                row["frozen_memory"] = again.frozen_seconds
                row["periodic_scratch"] = again.scratch
            dirty(job_dir)
            final = agent.checkpoint("final", 1)
            assert rates is not None
            predicted = rates.final_dump_s(final.bytes_total, final.bytes_changed / final.bytes_total, detection_s=0)
            row["after"][f"{share:g}"] = figures(final) | {"predicted": round(predicted, 2)}
            print(
                f"  final after a periodic, {share:.0%} rewritten: {final.seconds:.2f} s "
                f"(predicted {predicted:.2f} s), {final.bytes_uploaded / MiB:.1f} MiB sent"
            )
    with memory_job(work / "job-full", gib, 0.0) as job:
        row["floors"].append(floor(criu, job.pid, args.tmpfs))
        row["floor"] = min(row["floors"])  # CRIU to tmpfs, measured on two of the row's jobs: the faster
        store = make_store(store_kind, work, f"pipe-{cores}c-{int(gib * 1024)}m-full")
        final = checkpointer(job, work / "job-full", store, work / "agent-full").checkpoint("final", 1)
        assert rates is not None
        row["full"] = figures(final) | {
            "predicted": round(rates.final_dump_s(final.bytes_total, 1.0, detection_s=0), 2)
        }
    assert rates is not None
    row["rates_mib_s"] = {
        "criu": round(rates.criu_bps / MiB, 1),
        "scan": round(rates.scan_bps / MiB, 1),
        "send": round(rates.send_bps / MiB, 1),
    }
    row["largest_gib"] = {
        "full": round(rates.largest_memory(NOTICE_S, 1.0) / GiB, 2),
        **{f"{share:g}": round(rates.largest_memory(NOTICE_S, share) / GiB, 2) for share in args.dirty},
    }
    shutil.rmtree(work, ignore_errors=True)
    return row


def figures(outcome: Any) -> dict[str, Any]:
    return {
        "seconds": outcome.seconds,
        "bytes_total": outcome.bytes_total,
        "bytes_uploaded": outcome.bytes_uploaded,
        "bytes_changed": outcome.bytes_changed,
        "criu": outcome.criu_seconds,
        "read": outcome.read_seconds,
        "hash": outcome.hash_seconds,
        "compress": outcome.compress_seconds,
        "upload": outcome.upload_seconds,
        "scratch": outcome.scratch,
    }


def floor(criu: Any, pid: int, tmpfs: Path) -> float:
    shutil.rmtree(tmpfs, ignore_errors=True)
    try:
        seconds = float(criu.dump(pid, tmpfs / "images", tmpfs / "logs", leave_running=True))
    finally:
        shutil.rmtree(tmpfs, ignore_errors=True)
    print(f"  floor: CRIU to tmpfs {seconds:.2f} s")
    return round(seconds, 3)


@contextlib.contextmanager
def agent_scratch(mount_at: Path, pid: int, size: int) -> Iterator[Path]:
    """A tmpfs mounted at `mount_at` as the agent mounts its memory scratch (spotcr_agent.scratch: large pages where
    they fit, HUGE_PAGES), sized `size`; unmounted after, and the disk scratch beside it removed."""
    from spotcr_agent import scratch

    disk = mount_at.parent / f"{mount_at.name}-disk"
    disk.mkdir(parents=True, exist_ok=True)
    with scratch.dump_scratch(disk, mount_at, pid, room=lambda _pid, _workdir: size) as (where, kind):
        if kind != "memory":
            raise RuntimeError(f"no tmpfs could be mounted at {mount_at} as the agent's memory scratch")
        yield where
    shutil.rmtree(disk, ignore_errors=True)


def scratch_floor(criu: Any, pid: int, mount_at: Path, size: int) -> float:
    """CRIU dumping the job to a tmpfs mounted as the agent mounts its memory scratch (agent_scratch), sized `size`:
    the floor with the scratch's own advantage in it."""
    with agent_scratch(mount_at, pid, size) as where:
        seconds = float(criu.dump(pid, where / "images", where / "logs", leave_running=True))
    print(f"  floor in the agent's scratch tmpfs: CRIU {seconds:.2f} s")
    return round(seconds, 3)


def make_store(kind: str, work: Path, job: str) -> Any:
    from spotcr_agent.store import CheckpointStore

    if kind == "s3":
        return CheckpointStore.for_s3(BUCKET, job)
    (work / "store").mkdir(parents=True, exist_ok=True)
    return CheckpointStore.for_directory(work / "store", job)


@contextlib.contextmanager
def s3_server(work: Path) -> Iterator[dict[str, Any]]:
    """MinIO on loopback when its binary is there; moto's server otherwise (a mock: labelled as such)."""
    minio = os.environ.get("SPOTCR_BENCH_MINIO") or shutil.which("minio") or str(MINIO_BUILT)
    with contextlib.ExitStack() as stack:
        pid: int | None = None  # MinIO's, when it serves
        if minio and Path(minio).is_file():
            endpoint, pid = stack.enter_context(minio_server(minio, work / "minio-data"))
            label = "S3: MinIO on loopback"
            keys = ("minioadmin", "minioadmin")
        else:
            endpoint = stack.enter_context(moto_server())
            label = "S3: moto server on loopback (a mock: no MinIO binary found)"
            keys = ("bench", "bench")
        os.environ |= {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": keys[0],
            "AWS_SECRET_ACCESS_KEY": keys[1],
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield {"endpoint": endpoint, "label": label, "minio_pid": pid}


@contextlib.contextmanager
def minio_server(binary: str, data: Path) -> Iterator[tuple[str, int]]:
    """MinIO serving `data` on a free loopback port: its endpoint and its process id."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    env = os.environ | {
        "MINIO_ROOT_USER": "minioadmin",
        "MINIO_ROOT_PASSWORD": "minioadmin",
        "MINIO_PROMETHEUS_AUTH_TYPE": "public",  # its request counters, read on loopback by bench/s3count.py
    }
    # --no-compat: MinIO gives each object a random ETag instead of the MD5 of its body. S3 computes that MD5 on its
    # own servers; here it took the store's 2 cores, 3.3-6.1 of the endpoint's CPU seconds for a 2 GiB full final
    # dump, 1.8-2.9 without it. The store reads no ETag (each put carries its CRC32, which MinIO still checks).
    argv = [binary, "server", str(data), "--address", f"127.0.0.1:{port}", "--quiet", "--no-compat"]
    server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("MinIO did not start")
            time.sleep(0.2)
        time.sleep(1)
        yield f"http://127.0.0.1:{port}", server.pid
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(data, ignore_errors=True)


def describe_machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line), platform.processor())
    memory = next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if "MemTotal" in line)
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(int(memory) / (1 << 20), 1),
        "kernel": os.uname().release,
        "criu": subprocess.run([CRIU, "--version"], capture_output=True, text=True, check=False).stdout.split()[1],
        "load_before": os.getloadavg(),
        "kind": "polyglot (2 cores, 24 GiB), shared with other sessions' builds and tests",
    }


# Instance types for the README's table: (name, vCPUs, memory GiB, baseline network Gbit/s, as AWS lists them).
INSTANCES = (
    ("m6i.xlarge", 4, 16, 1.5625),
    ("m6i.4xlarge", 16, 64, 6.25),
    ("c6id.8xlarge", 32, 64, 12.5),
    ("m6i.8xlarge", 32, 128, 12.5),
    ("r6i.8xlarge", 32, 256, 12.5),
    ("m6i.16xlarge", 64, 256, 25.0),
)
# The model's inputs for them, from issue 14's 16-core measurements: CRIU 16 GiB to tmpfs in 11.0 s, and the store's
# scan rate such that CRIU then scan reproduce the whole final dump of 16 GiB into a directory store (20.32 s),
# scaled down below 16 vCPUs; upload at the baseline network rate or at 250 MiB/s of zstd-1 per vCPU
# (criu-notes), whichever is lower, counting no gain from compression.
CRIU_GIB_S = 16 / 11.0
SCAN_GIB_S_16 = 1 / (20.32 / 16 - 1 / CRIU_GIB_S)
COMPRESS_MIB_S_PER_VCPU = 250
MARGIN_BUDGET_S = 90.0  # the notice less spotcr:deadline-margin's default


def instance_table() -> str:
    from spotcr_agent.deadline import Rates

    lines = [
        "| instance | vCPUs | memory | network | largest job, full final dump | after a periodic, 5% changed "
        "| 20% changed |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, vcpus, memory, gbit in INSTANCES:
        scan = SCAN_GIB_S_16 * min(1.0, vcpus / 16) * GiB
        send = min(gbit * 1e9 / 8, vcpus * COMPRESS_MIB_S_PER_VCPU * MiB)
        rates = Rates(criu_bps=CRIU_GIB_S * GiB, scan_bps=scan, send_bps=send, dirty_per_s=None, periodic_s=0.0)
        cells = []
        for share in (1.0, 0.05, 0.2):
            largest = rates.largest_memory(MARGIN_BUDGET_S, share) / GiB
            cells.append(f"{min(largest, memory):.0f} GiB" + (" (all of it)" if largest >= memory else ""))
        lines.append(f"| {name} | {vcpus} | {memory} GiB | {gbit:g} Gbit/s | " + " | ".join(cells) + " |")
    lines.append(
        f"\nModel: `deadline.Rates.largest_memory` with a {MARGIN_BUDGET_S:.0f} s budget (the notice less the default "
        f"margin); CRIU {CRIU_GIB_S:.2f} GiB/s; store scan {SCAN_GIB_S_16:.2f} GiB/s at 16 vCPUs and more, "
        f"proportionally less below; upload the lower of the baseline network and {COMPRESS_MIB_S_PER_VCPU} MiB/s "
        "of zstd-1 per vCPU, with no gain counted from compression. Extrapolated, not measured on EC2."
    )
    return "\n".join(lines) + "\n"


def ratio(value: float | None, floor_s: float) -> str:
    return "n/a" if value is None or not floor_s else f"{value:.2f} s ({value / floor_s:.1f}x)"


def print_row(row: dict[str, Any]) -> None:
    print("  " + table_line(row))


HEADER = (
    "| cores | storage | job | floor: CRIU to tmpfs | full final dump (predicted) "
    "| periodic frozen: memory / disk scratch | final after 1% / 5% / 20% (predicted) "
    "| full final dump's time: CRIU / read+chunk / hash / compress / upload "
    "| largest job whose final dump fits 120 s: full / 1% / 5% / 20% |"
)


def table_line(row: dict[str, Any]) -> str:
    f = row["floor"]
    full = row["full"]
    after = " / ".join(
        f"{a['seconds']:.2f} s ({a['seconds'] / f:.1f}x; {a['predicted']:.1f})" for a in row["after"].values()
    )
    where = " / ".join(f"{full[k]:.2f}" for k in ("criu", "read", "hash", "compress", "upload"))
    largest = " / ".join(f"{v:.1f}" for v in row["largest_gib"].values())
    return (
        f"| {row['cores']} | {row['store_label']} | {row['gib']:g} GiB | {f:.2f} s "
        f"| {ratio(full['seconds'], f)} ({full['predicted']:.1f} s) "
        f"| {ratio(row['frozen_memory'], f)} / {ratio(row['frozen_disk'], f)} "
        f"| {after} | {where} s | {largest} GiB |"
    )


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        HEADER,
        "|" + "---|" * 9,
        *(table_line(row) for row in doc["rows"]),
        "",
        "Ratios (x) are against the floor measured in the same row. Predicted: the deadline model "
        "(vm-bootstrap/spotcr_agent/deadline.py) from the first periodic dump's figures and the measured changed "
        "share, order to durable (less the model's 1 s of notice detection). "
        + prediction_check(doc["rows"])
        + " The final dump's time by stage: CRIU's seconds (overlapping the store's reading when streamed), "
        "then the store's busy seconds summed over its threads. Largest job: extrapolated from the measured "
        "rates (CRIU, store scan, upload) to the 120 s notice, not measured at that size.",
        "Fusion Snapshots publishes (estimates, NVMe instances): "
        + "; ".join(f"{gib} GiB in about {s} s ({where})" for gib, s, where in FUSION)
        + ", about 1.2 GiB/s; users cap job memory by hand.",
        f"Measured {doc['at']} on {m['cpus']} cores ({m['cpu']}), {m['memory_gib']} GiB, Linux {m['kernel']}, "
        f"CRIU {m['criu']}; {m['kind']}: load average {m['load_before'][0]:.1f} before the run and "
        f"{m['load_after'][0]:.1f} after. Core counts by sched_setaffinity (as taskset).",
    ]
    return "\n".join(lines) + "\n"


def prediction_check(rows: list[dict[str, Any]]) -> str:
    """Measured against predicted over every final dump of the run: above 1, the model erred short."""
    ratios = [d["seconds"] / d["predicted"] for r in rows for d in (r["full"], *r["after"].values()) if d["predicted"]]
    if not ratios:
        return ""
    return f"Measured/predicted over the {len(ratios)} final dumps: {min(ratios):.2f} to {max(ratios):.2f}."


def write_results(rows: list[dict[str, Any]], machine: dict[str, Any], args: argparse.Namespace) -> None:
    args.results.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"benchmark": "pipeline", "at": datetime.now(UTC).isoformat(timespec="seconds")}
    doc["machine"] = machine
    doc["rows"] = rows
    doc["command"] = "python -m bench pipeline " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["pipeline"] else [])
    (args.results / f"{args.name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    table = markdown(doc) + "\n" + instance_table()
    (args.results / f"{args.name}.md").write_text(table)
    print("\n" + table)
    print(f"written: {args.results / args.name}.json and .md")
