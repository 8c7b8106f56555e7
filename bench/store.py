"""The checkpoint store against issue 23's targets, in one run, ratios against the floor measured in it.

`python -m bench store [--gib 2] [--dirty 0.05] [--runs 3] [--record-baseline]` (what `make bench` runs): --runs rounds
of three jobs of the same size (bench/memjob.py), each dumped by CRIU to tmpfs first (the floor: the fastest of all
kept), then one of the first three figures below; each of those is the fastest of its runs, as the floor is, so that
a busy moment of a shared machine weighs on neither side of a ratio more than on the other:

  after      a periodic dump into a directory store, 5% of memory rewritten, then the final dump: its time and the
             bytes it sent (against the baseline recorded in bench/results/store-baseline.json)
  full dir   a full final dump into a directory store on local disk
  full S3    a full final dump into MinIO on loopback (moto's server, labelled, without a MinIO binary): the requests
             and objects the endpoint saw, per GiB of new data, by MinIO's own counters (by a counting proxy in
             front of moto's server; bench/s3count.py)
  restore    the store's fetch of the last round's S3 checkpoint, then a plain parallel download (boto3, a thread
             pool as wide as the store's) of the same objects and ranges the fetch asked the endpoint for
  at least   the least each full final dump could take on these cores: its CRIU's and the endpoint's CPU, plus the
             store's per-byte work (for S3 with each pack's CRC32) measured alone on one thread on CRIU's images of
             the first full job (store_work), spread over every core

Writes bench/results/<name>.json and .md with the machine. --record-baseline writes this run's bytes sent after the
periodic dump, with the commit and the store's tree it came from, as the baseline later runs compare with.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from bench.checkpoint import CRIU, checkpointer, criu_unusable, dirty, memory_job
from bench.pipeline import (
    BUCKET,
    GiB,
    MiB,
    agent_scratch,
    describe_machine,
    figures,
    floor,
    make_store,
    s3_server,
    scratch_floor,
)
from bench.s3count import MinioCount, Request, Tally, counting_proxy

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
BASELINE = BENCH / "results" / "store-baseline.json"
STORE_SOURCE = "vm-bootstrap/spotcr_agent/store"
DOWNLOAD_WORKERS = 16  # CheckpointStore.for_s3's default fetch threads


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench store", description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="job size in GiB (2, as the targets say)")
    parser.add_argument("--dirty", type=float, default=0.05, help="share rewritten between periodic and final")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/spotcr-store-bench"), help="local disk dir")  # noqa: S108
    parser.add_argument("--tmpfs", type=Path, default=Path("/dev/shm/spotcr-store-bench"), help="tmpfs (floor)")  # noqa: S108
    parser.add_argument("--results", type=Path, default=BENCH / "results")
    parser.add_argument("--name", default="store", help="results file name: <results>/<name>.json and .md")
    parser.add_argument("--runs", type=int, default=3, help="rounds; each figure is the fastest of its runs (3)")
    parser.add_argument("--record-baseline", action="store_true", help=f"write this run's bytes sent to {BASELINE}")
    args = parser.parse_args(argv)
    if args.gib <= 0 or not 0 < args.dirty < 1:
        parser.error(f"--gib must be positive and --dirty between 0 and 1, not {args.gib:g} and {args.dirty:g}")
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, not {args.runs}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if criu_unusable("store"):
        return 2
    machine = describe_machine()
    source = store_source()
    print(f"spotcr store benchmark (issue 23's targets): {args.gib:g} GiB jobs, {args.dirty:.0%} rewritten")
    print(f"machine: {machine['cpus']} cores ({machine['cpu']}), load average {machine['load_before']}")
    shutil.rmtree(args.work, ignore_errors=True)
    with s3_server(args.work) as s3, request_count(s3) as count:
        run = measure(args, count, s3["endpoint"], s3["minio_pid"]) | {"s3_label": s3["label"], "counted_by": count.by}
    shutil.rmtree(args.work, ignore_errors=True)
    machine["load_after"] = os.getloadavg()
    doc = {
        "benchmark": "store",
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m bench store " + " ".join(argv),
        "machine": machine,
        "store_source": source,
        "gib": args.gib,
        "dirty": args.dirty,
        "run": run,
    }
    if args.record_baseline:
        record_baseline(doc)
    doc["rows"] = target_rows(doc, load_baseline())
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    table = markdown(doc)
    (args.results / f"{args.name}.md").write_text(table)
    print("\n" + table)
    print(f"written: {args.results / args.name}.json and .md")
    return 0


class Count(Protocol):
    by: str  # how: "the endpoint" (MinIO's own counters) or "proxy" (in front of moto's server)

    def take(self) -> Tally: ...
    def watch(self, client: Any) -> None: ...


@contextlib.contextmanager
def request_count(s3: dict[str, Any]) -> Iterator[Count]:
    """MinIO's own counters when MinIO serves; otherwise a counting proxy the store's client is pointed at."""
    import boto3

    if s3["minio_pid"] is not None:
        yield MinioCount(s3["endpoint"], BUCKET, boto3.client("s3", endpoint_url=s3["endpoint"]))
        return
    with counting_proxy(s3["endpoint"]) as (endpoint, tally):
        os.environ["AWS_ENDPOINT_URL"] = endpoint  # the store's client and the plain download go through the count
        yield ProxyCount(tally)


@dataclass
class ProxyCount:
    tally: Tally
    by: str = "proxy"

    def take(self) -> Tally:
        return self.tally.take()

    def watch(self, client: Any) -> None:
        """The proxy sees every GET already."""


def measure(args: argparse.Namespace, count: Count, direct: str, s3_pid: int | None) -> dict[str, Any]:
    """Every figure of the run; direct: the S3 endpoint itself (the proxy's upstream when a proxy counts); s3_pid:
    the endpoint's process when it is MinIO, whose CPU seconds the full S3 dump reports."""
    from spotcr_agent.criu import Criu

    bench = Round(args, Criu(CRIU), count, s3_pid)
    samples: dict[str, list[dict[str, Any]]] = {"after": [], "full_dir": [], "full_s3": []}
    for number in range(1, args.runs + 1):
        samples["after"].append(bench.after(number))
        samples["full_dir"].append(bench.full(number, "dir")[0])
        full_s3, store, checkpoint_id = bench.full(number, "s3")
        samples["full_s3"].append(full_s3)
    run = bench.run
    for figure, runs in samples.items():
        run[figure] = min(runs, key=lambda sample: sample["seconds"]) | {"runs": [r["seconds"] for r in runs]}
    run["periodic"] = run["after"].pop("periodic")

    print("\n== restore from S3: the store's fetch, then a plain parallel download of the same objects ==")
    started = time.monotonic()
    store.fetch(checkpoint_id, args.work / "restore")
    seconds = round(time.monotonic() - started, 3)
    fetched = count.take()
    run["fetch"] = {"seconds": seconds, "requests": fetched.summary()}
    shutil.rmtree(args.work / "restore", ignore_errors=True)
    run["download"] = plain_download(fetched.gets, args.work / "download", os.environ["AWS_ENDPOINT_URL"])
    if os.environ["AWS_ENDPOINT_URL"] != direct:
        run["download_direct"] = plain_download(fetched.gets, args.work / "download", direct)  # what the proxy costs
    count.take()
    run["floor"] = min(run["floors"])
    run["scratch_floor"] = min(run["scratch_floors"])
    print(f"  fetch {run['fetch']['seconds']:.2f} s, plain download {run['download']['seconds']:.2f} s")
    return run


@dataclass
class Round:
    """The rounds' figures, each on a job of its own whose floors are measured first (into `run`, every round's)."""

    args: argparse.Namespace
    criu: Any
    count: Count
    s3_pid: int | None
    run: dict[str, Any] = field(default_factory=lambda: {"floors": [], "scratch_floors": []})

    def after(self, number: int) -> dict[str, Any]:
        """A periodic dump into a directory store, the job's memory rewritten in part, then the final dump."""
        args, work = self.args, self.args.work
        print(f"\n== round {number}: after a periodic dump, {args.dirty:.0%} rewritten: directory store ==")
        workdir = work / f"job-after-{number}"  # each round's job a dir of its own: its `ready` file is its own
        with memory_job(workdir, args.gib, args.dirty) as job:
            floors(self.run, self.criu, job.pid, args)
            store = make_store("dir", work, f"store-{number}-after")
            agent = checkpointer(job, workdir, store, work / f"agent-after-{number}")
            periodic = figures(agent.checkpoint("periodic", 1))
            dirty(workdir)
            after = figures(agent.checkpoint("final", 1)) | {"periodic": periodic}
        print(f"  final: {after['seconds']:.2f} s, {after['bytes_uploaded'] / MiB:.1f} MiB sent")
        return after

    def full(self, number: int, kind: str) -> tuple[dict[str, Any], Any, str]:
        """A full final dump into a directory store ("dir") or S3 ("s3"): its figures (for S3 with the requests the
        endpoint saw, and its CPU seconds), the store and the checkpoint (the restore reads the last round's)."""
        work, s3 = self.args.work, kind == "s3"
        print(f"\n== round {number}: full final dump: {'S3' if s3 else 'directory store'} ==")
        workdir, store = work / f"job-{kind}-{number}", make_store(kind, work, f"store-{number}-full")
        endpoint = self.s3_pid if s3 else None
        with memory_job(workdir, self.args.gib, 0.0) as job:
            floors(self.run, self.criu, job.pid, self.args)
            if "store_work" not in self.run:
                self.run["store_work"] = store_work(self.criu, job.pid, work / "store-work", scratch_size(self.args))
            agent = checkpointer(job, workdir, store, work / f"agent-{kind}-{number}")
            if s3:
                self.count.watch(store.backend.client)
                self.count.take()
            before = cpu_seconds(endpoint)
            final = agent.checkpoint("final", 1)
            full = figures(final) | {"cpu": cpu_used(before, cpu_seconds(endpoint))}
            if s3:
                full["requests"] = self.count.take().summary()
        print(f"  final: {full['seconds']:.2f} s, CPU seconds {full['cpu']}, requests {full.get('requests', '-')}")
        return full, store, final.checkpoint_id


def floors(run: dict[str, Any], criu: Any, pid: int, args: argparse.Namespace) -> None:
    """The job's floor (CRIU to the machine's tmpfs), and CRIU to a tmpfs mounted as the agent's scratch is."""
    run["floors"].append(floor(criu, pid, args.tmpfs))
    run["scratch_floors"].append(scratch_floor(criu, pid, args.work / "scratch-floor", scratch_size(args)))


def scratch_size(args: argparse.Namespace) -> int:
    """A tmpfs for the job's images, with room to spare."""
    return int(args.gib * GiB * 1.2) + (64 << 20)


def store_work(criu: Any, pid: int, mount_at: Path, size: int, passes: int = 2) -> dict[str, float]:
    """The CPU seconds one thread spends on what every byte of a full final dump costs in the store's format,
    however it is pipelined: mapped and cut into chunks, named by its hash (BLAKE3), compressed at the final dump's
    level (store.FAST_LEVEL); and for S3, the CRC32 of the compressed bytes that each pack is sent with
    (backends.crc32_header). Measured on CRIU's images of the job in a tmpfs mounted as the agent's memory scratch
    is (agent_scratch), mapped as the store maps them; each stage the least of `passes`.

    With the CPU that CRIU and the endpoint spent in a dump, it bounds the dump from below on this machine's cores
    (least_seconds): the work could at best be spread over every core, none of it left out."""
    import zstandard
    from spotcr_agent.store.backends import crc32_header
    from spotcr_agent.store.chunking import Chunker, Chunking
    from spotcr_agent.store.manifest import chunk_id
    from spotcr_agent.store.store import FAST_LEVEL, MAP_FLAGS

    best = {"cut": float("inf"), "hash": float("inf"), "compress": float("inf"), "crc": float("inf")}
    with agent_scratch(mount_at, pid, size) as where:
        criu.dump(pid, where / "images", where / "logs", leave_running=True)
        files = [p for p in sorted((where / "images").iterdir()) if p.stat().st_size]
        total = sum(p.stat().st_size for p in files)
        compressor = zstandard.ZstdCompressor(level=FAST_LEVEL)
        for _ in range(passes):
            spent = dict.fromkeys(best, 0.0)
            for path in files:
                with path.open("rb") as file:
                    began = time.thread_time()
                    mapped = mmap.mmap(file.fileno(), 0, flags=MAP_FLAGS, prot=mmap.PROT_READ)
                    chunker = Chunker(Chunking())
                    chunks = chunker.feed(memoryview(mapped)) + chunker.finish()
                    spent["cut"] += time.thread_time() - began
                    for chunk in chunks:
                        began = time.thread_time()
                        chunk_id(chunk)
                        hashed = time.thread_time()
                        compressed = compressor.compress(chunk)
                        done = time.thread_time()
                        crc32_header(compressed)
                        spent["hash"] += hashed - began
                        spent["compress"] += done - hashed
                        spent["crc"] += time.thread_time() - done
                    del chunks, chunker, mapped  # unmapped once no chunk refers to it
            best = {stage: min(best[stage], spent[stage]) for stage in best}
    print(
        f"  the store's per-byte work on one thread, {total / GiB:.2f} GiB of images: "
        + ", ".join(f"{stage} {seconds:.2f}" for stage, seconds in best.items())
        + " CPU s"
    )
    return {stage: round(seconds, 3) for stage, seconds in best.items()} | {"bytes": total}


def least_seconds(sample: dict[str, Any], work: dict[str, float], cores: int) -> float:
    """The least a full final dump can take on `cores` cores: the CPU its CRIU and the endpoint spent in it (the
    endpoint shares the cores when it runs on this machine) and the store's per-byte work (store_work; its packs'
    CRC32 only where they go to S3, the dump with an endpoint), spread over every core with nothing else left."""
    cpu = sample["cpu"]
    return (cpu["criu"] + cpu.get("endpoint", 0.0) + per_byte(work, s3="endpoint" in cpu)) / cores


def per_byte(work: dict[str, float], *, s3: bool) -> float:
    """The store's per-byte CPU seconds (store_work) for a dump into a directory, or into S3."""
    return work["cut"] + work["hash"] + work["compress"] + (work.get("crc", 0.0) if s3 else 0.0)


def cpu_seconds(endpoint_pid: int | None) -> dict[str, float]:
    """CPU seconds so far: this process (the store's threads), its reaped children (CRIU), and the S3 endpoint."""
    times = os.times()
    used = {"store": times.user + times.system, "criu": times.children_user + times.children_system}
    if endpoint_pid is not None:
        fields = Path(f"/proc/{endpoint_pid}/stat").read_text().rpartition(")")[2].split()
        used["endpoint"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return used


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {part: round(after[part] - before[part], 2) for part in before}


def plain_download(gets: list[Request], dest: Path, endpoint: str) -> dict[str, Any]:
    """The objects (and ranges) a fetch read, downloaded to files with a thread pool and nothing else."""
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=DOWNLOAD_WORKERS))
    dest.mkdir(parents=True, exist_ok=True)

    def download(number: int, get: Request) -> int:
        extra = {"Range": get.range} if get.range else {}
        body = client.get_object(Bucket=BUCKET, Key=get.key, **extra)["Body"].read()
        (dest / str(number)).write_bytes(body)
        return len(body)

    started = time.monotonic()
    with ThreadPoolExecutor(DOWNLOAD_WORKERS) as pool:
        sizes = list(pool.map(download, range(len(gets)), gets))
    seconds = time.monotonic() - started
    shutil.rmtree(dest, ignore_errors=True)
    return {"seconds": round(seconds, 3), "objects": len(gets), "bytes": sum(sizes)}


def store_source() -> dict[str, Any]:
    """Which store was measured: the commit, the last commit that changed the store, its source tree, any edits."""

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "store_commit": git("log", "-1", "--format=%H", "--", STORE_SOURCE),
        "store_tree": git("rev-parse", f"HEAD:{STORE_SOURCE}"),
        "store_edited": bool(git("status", "--porcelain", "--", STORE_SOURCE)),
    }


def record_baseline(doc: dict[str, Any]) -> None:
    baseline = {
        "at": doc["at"],
        **doc["store_source"],
        "gib": doc["gib"],
        "dirty": doc["dirty"],
        "bytes_sent_after_periodic": doc["run"]["after"]["bytes_uploaded"],
    }
    BASELINE.write_text(json.dumps(baseline, indent=2) + "\n")
    print(f"baseline written: {BASELINE}")


def load_baseline() -> dict[str, Any] | None:
    return json.loads(BASELINE.read_text()) if BASELINE.exists() else None


def target_rows(doc: dict[str, Any], baseline: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Issue 23's table: each figure measured in this run, its target, and whether it is met."""
    run, gib, share = doc["run"], doc["gib"], f"{doc['dirty']:.0%}"
    f = run["floor"]
    s3 = run["full_s3"]
    new_gib = s3["bytes_changed"] / GiB
    counted = s3["requests"]
    per_gib = counted["total"] / new_gib
    rows = [
        row(
            "S3 requests per GiB of new checkpoint data",
            f"{per_gib:.0f} ({counted['PUT'] / new_gib:.0f} PUTs, {counted['objects_written']} objects written "
            f"for {new_gib:.2f} GiB; {describe_requests(counted)})",
            "at most 40",
            per_gib <= 40,
        ),
        ratio_row(f"full final dump, {gib:g} GiB, directory store", run["full_dir"], f, 2.0, least(doc, "full_dir")),
        ratio_row(f"full final dump, {gib:g} GiB, {run['s3_label']}", s3, f, 2.5, least(doc, "full_s3")),
        ratio_row(f"final after a periodic, {share} rewritten, {gib:g} GiB, directory", run["after"], f, 1.2),
        bytes_row(run["after"]["bytes_uploaded"], doc, baseline),
        row(
            f"restore of {gib:g} GiB from {run['s3_label']}",
            f"fetch {run['fetch']['seconds']:.2f} s ({describe_requests(run['fetch']['requests'])}), "
            f"{run['fetch']['seconds'] / run['download']['seconds']:.2f}x a plain parallel download of the same "
            f"{run['download']['objects']} objects ({run['download']['bytes'] / MiB:.0f} MiB) in "
            f"{run['download']['seconds']:.2f} s{proxy_cost(run)}",
            "reported, against a plain parallel download of the same bytes",
            True,
        ),
    ]
    return rows


def proxy_cost(run: dict[str, Any]) -> str:
    direct = run.get("download_direct")
    return f" ({direct['seconds']:.2f} s without the counting proxy)" if direct else ""


def row(figure: str, measured: str, target: str, met: bool | None) -> dict[str, Any]:
    return {"figure": figure, "measured": measured, "target": target, "met": met}


def ratio_row(
    figure: str, sample: dict[str, Any], floor_s: float, target: float, least_s: float | None = None
) -> dict[str, Any]:
    """A figure's fastest run against the floor; every run's seconds beside it, and the least it could take here
    (least_seconds) where the run measured it."""
    seconds, runs = sample["seconds"], sample.get("runs", [sample["seconds"]])
    of = f", the fastest of {', '.join(f'{r:.2f}' for r in runs)} s" if len(runs) > 1 else ""
    ratio = seconds / floor_s
    bound = f"; at least {max(least_s, floor_s) / floor_s:.1f}x on these cores" if least_s is not None else ""
    return row(figure, f"{ratio:.1f}x ({seconds:.2f} s{of}){bound}", f"at most {target:g}x", ratio <= target)


def least(doc: dict[str, Any], figure: str) -> float | None:
    """least_seconds of a full final dump, if the run measured the store's per-byte work and the dump's CPU."""
    run, cores = doc["run"], doc.get("machine", {}).get("cpus")
    if "store_work" not in run or not cores or "cpu" not in run[figure]:
        return None
    return least_seconds(run[figure], run["store_work"], cores)


def least_line(doc: dict[str, Any]) -> str:
    """How the rows' "at least" bounds are made, with the parts they add up."""
    run, cores = doc["run"], doc.get("machine", {}).get("cpus")
    work = run.get("store_work")
    if not work or not cores:
        return ""
    parts = []
    for figure, where in (("full_dir", "directory"), ("full_s3", run["s3_label"])):
        bound = least(doc, figure)
        if bound is not None:
            cpu = run[figure]["cpu"]
            endpoint = f" + the endpoint {cpu['endpoint']:.2f}" if "endpoint" in cpu else ""
            parts.append(
                f"{where} {bound:.2f} s ({bound / run['floor']:.1f}x: CRIU {cpu['criu']:.2f}{endpoint} + the store's "
                f"per-byte work {per_byte(work, s3='endpoint' in cpu):.2f} CPU s, over {cores} cores)"
            )
    return (
        "At least: what each full final dump would take if its CPU were spread over every core with nothing else "
        "left: the CPU its CRIU and the endpoint (on these cores too) spent in the fastest run, and the work every "
        f"byte costs in the store's format, measured alone on one thread on CRIU's images of the job "
        f"({work['bytes'] / GiB:.2f} GiB, the least of two passes): cutting into chunks {work['cut']:.2f}, BLAKE3 "
        f"{work['hash']:.2f}, zstd at the final dump's level {work['compress']:.2f}, and for S3 the CRC32 each pack "
        f"is sent with {work.get('crc', 0.0):.2f} CPU s. " + "; ".join(parts) + "."
    )


def bytes_row(sent: int, doc: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any]:
    figure = f"bytes sent after a periodic, {doc['dirty']:.0%} rewritten"
    measured = f"{sent / MiB:.1f} MiB"
    if baseline is None:
        return row(figure, measured, "at most 1.5x today's (no baseline: run with --record-baseline)", None)
    if (baseline["gib"], baseline["dirty"]) != (doc["gib"], doc["dirty"]):
        target = f"at most 1.5x today's (the baseline is for {baseline['gib']:g} GiB, {baseline['dirty']:.0%})"
        return row(figure, measured, target, None)
    before = baseline["bytes_sent_after_periodic"]
    target = f"at most 1.5x today's ({before / MiB:.1f} MiB, the store of commit {baseline['store_commit'][:10]})"
    return row(figure, f"{measured} ({sent / before:.2f}x)", target, sent <= 1.5 * before)


def describe_requests(counted: dict[str, int]) -> str:
    kinds = [f"{counted[kind]} {kind}" for kind in ("PUT", "GET", "LIST", "HEAD", "DELETE", "POST") if counted[kind]]
    return ", ".join(kinds) or "no requests"


def scratch_floor_line(doc: dict[str, Any]) -> str:
    """The same dumps against CRIU into a tmpfs mounted as the agent's memory scratch is (large pages where they
    fit): the floor with the scratch's own speed-up in it, which the rows' floor (the machine's /dev/shm) lacks."""
    run = doc["run"]
    if not run.get("scratch_floors"):
        return ""
    f = run["scratch_floor"]
    ratios = (
        f"directory full {run['full_dir']['seconds'] / f:.1f}x, "
        f"{run['s3_label']} full {run['full_s3']['seconds'] / f:.1f}x, "
        f"after a periodic {run['after']['seconds'] / f:.1f}x"
    )
    return (
        f"Against CRIU dumping to a tmpfs mounted as the agent's memory scratch is (large pages where they fit, "
        f"spotcr_agent.scratch.HUGE_PAGES), {f:.2f} s (the fastest of "
        f"{', '.join(f'{s:.2f}' for s in run['scratch_floors'])} s): {ratios}."
    )


def cpu_line(run: dict[str, Any], cores: int) -> str:
    """Where the full final dumps' CPU went: the store, CRIU, and the S3 endpoint sharing the same cores."""
    parts = []
    for figure, where in (("full_dir", "directory"), ("full_s3", run["s3_label"])):
        cpu = run[figure].get("cpu")
        if cpu:
            spent = ", ".join(f"{name} {seconds:.1f}" for name, seconds in cpu.items())
            parts.append(f"{where}: {spent} in {run[figure]['seconds']:.2f} s")
    if not parts:
        return ""
    return (
        f"CPU seconds of the full final dumps ({cores} cores give {cores} a second; the endpoint runs on them too): "
        + "; ".join(parts)
        + "."
    )


COUNTED_BY = {
    "the endpoint": "S3 requests are MinIO's own count of the requests it served (its metrics, read before and "
    "after each figure; bench/s3count.py): nothing stands between the store and the endpoint.",
    "proxy": "S3 requests are counted by a proxy in front of the endpoint (bench/s3count.py), which every S3 request "
    "of the run goes through; the plain download runs again straight to the endpoint: the difference is what the "
    "proxy costs the S3 figures.",
}


def markdown(doc: dict[str, Any]) -> str:
    m, run, source = doc["machine"], doc["run"], doc["store_source"]
    verdict = {True: "met", False: "not met", None: "not measured"}
    edited = " (with uncommitted edits)" if source["store_edited"] else ""
    lines = [
        "| figure | measured | target | met |",
        "|---|---|---|---|",
        *(f"| {r['figure']} | {r['measured']} | {r['target']} | {verdict[r['met']]} |" for r in doc["rows"]),
        "",
        f"Ratios against the floor measured in the same run: CRIU dumping a {doc['gib']:g} GiB job to tmpfs, "
        f"{run['floor']:.2f} s (the fastest of {', '.join(f'{s:.2f}' for s in run['floors'])} s, one per job). "
        f"{COUNTED_BY[run.get('counted_by', 'proxy')]} New data: the raw bytes of the chunks the checkpoint did not "
        "share with a parent; objects written: the keys new in the bucket. The restore's plain download runs right "
        "after the fetch, on the objects and ranges the fetch asked for.",
        scratch_floor_line(doc),
        cpu_line(run, m["cpus"]),
        least_line(doc),
        f"Store: {STORE_SOURCE} as of commit {source['store_commit'][:10]} (tree {source['store_tree'][:10]}{edited}), "
        f"measured at commit {source['commit'][:10]}.",
        f"Measured {doc['at']} on {m['cpus']} cores ({m['cpu']}), {m['memory_gib']} GiB, Linux {m['kernel']}, "
        f"CRIU {m['criu']}; {m['kind']}: load average {m['load_before'][0]:.1f} before the run and "
        f"{m['load_after'][0]:.1f} after. Command: `{doc['command'].strip()}`.",
    ]
    return "\n".join(lines) + "\n"
