"""Checkpoint speed: the original research's s3fs-fuse method against spotcr's store, with CRIU to tmpfs as floor.

For each job size, against one local S3 endpoint (moto on loopback), side by side in one run:
  (a) CRIU dumping straight into an s3fs-fuse mount of the endpoint (the job frozen the whole time)
  (b) spotcr's final dump to durable, nothing stored before (CRIU streams into the store as it writes)
  (p) spotcr's periodic dump: CRIU to local scratch (the only frozen part), then shipped
  (c) spotcr's final dump right after that periodic one, the job having dirtied 5% of its memory since
  (d) the floor: CRIU dumping to tmpfs (not durable)
plus restore times, and the store alone (commit and fetch MiB/s against the endpoint and a local directory).
(b), (p) and (c) run the agent's own Checkpointer, Criu and runner: what a job VM runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spotcr_agent.checkpoint import CheckpointOutcome

MiB = 1 << 20
GiB = 1 << 30
BENCH = Path(__file__).resolve().parent
MEMJOB = BENCH / "memjob.py"
CRIU = shutil.which("criu", path=f"/usr/local/sbin:{os.environ.get('PATH', '')}") or "criu"
BUCKET = "spotcr-bench"
MOTO_NOTE = "moto is a mock that ingests only about 70 MiB/s here: real S3 (or MinIO) would make (b) faster still"


@dataclass
class Figures:
    """Seconds for one case at one size; None where a case does not apply or was not measured."""

    durable: float | None = None  # dump start to durable in the store
    frozen: float | None = None  # the job could not run
    restore: float | None = None  # store to running job (fetch + CRIU restore)
    fetch: float | None = None
    bytes_total: int | None = None
    bytes_sent: int | None = None
    note: str = ""

    @classmethod
    def of(cls, outcome: CheckpointOutcome) -> Figures:
        """The figures spotcr's own checkpoint reports."""
        return cls(
            durable=outcome.seconds,
            frozen=outcome.frozen_seconds,
            bytes_total=outcome.bytes_total,
            bytes_sent=outcome.bytes_uploaded,
        )


@dataclass
class SizeResult:
    gib: float
    cases: dict[str, Figures] = field(default_factory=dict)
    store: dict[str, float] = field(default_factory=dict)  # MiB/s of the store alone


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1.0, 2.0], help="job sizes in GiB (default 1 2)")
    parser.add_argument("--dirty", type=float, default=0.05, help="share of memory dirtied before (c) (0.05)")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/spotcr-bench"), help="scratch dir, local disk")  # noqa: S108
    parser.add_argument("--tmpfs", type=Path, default=Path("/dev/shm/spotcr-bench"), help="tmpfs dir for (d)")  # noqa: S108
    parser.add_argument("--results", type=Path, default=BENCH / "results", help="where checkpoint.json/.md go")
    parser.add_argument("--skip-s3fs", action="store_true", help="leave out (a), the s3fs-fuse baseline")
    parser.add_argument(
        "--s3fs-restore", action="store_true", help="also restore straight from the s3fs mount (minutes per GiB)"
    )
    return parser.parse_args(argv)


def criu_unusable(benchmark: str) -> bool:
    """True, having said why, where this benchmark cannot run CRIU (it needs root); else checks `criu check`."""
    if os.geteuid() != 0:
        print(f"bench {benchmark}: CRIU needs root", file=sys.stderr)
        return True
    subprocess.run([CRIU, "check"], check=True, capture_output=True)
    return False


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if criu_unusable("checkpoint"):
        return 2
    if not args.skip_s3fs:
        ensure_s3fs()
    print(f"spotcr checkpoint benchmark: sizes {args.sizes} GiB, {args.dirty:.0%} dirtied before (c)")
    print(f"note: {MOTO_NOTE}")
    results = []
    for gib in args.sizes:
        shutil.rmtree(args.work, ignore_errors=True)
        result = bench_size(gib, args)
        results.append(result)
        print_size(result)
    shutil.rmtree(args.work, ignore_errors=True)
    write_results(results, args)
    return 0


def bench_size(gib: float, args: argparse.Namespace) -> SizeResult:
    from spotcr_agent.criu import Criu
    from spotcr_agent.store import CheckpointStore

    result = SizeResult(gib)
    criu = Criu(CRIU)
    work = args.work
    with contextlib.ExitStack() as cleanup:
        endpoint = cleanup.enter_context(moto_server())
        os.environ |= {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        print(f"\n== {gib:g} GiB job (moto at {endpoint}) ==")

        # Job B: (d) floor and (a) s3fs with --leave-running, then (b) its final dump.
        job_b = cleanup.enter_context(memory_job(work / "job-b", gib, args.dirty))
        result.cases["d"] = floor_to_tmpfs(criu, job_b.pid, args.tmpfs)
        if not args.skip_s3fs:
            result.cases["a"] = s3fs_dump(criu, job_b.pid, endpoint, work, args.s3fs_restore)
        store_b = CheckpointStore.for_s3(BUCKET, f"bench-b-{gib:g}g".replace(".", "-"))
        final_b = checkpointer(job_b, work / "job-b", store_b, work / "agent-b").checkpoint("final", 1)
        result.cases["b"] = Figures.of(final_b)
        print(f"(b) spotcr final dump: durable in {final_b.seconds:.2f} s, {final_b.bytes_uploaded / MiB:.0f} MiB sent")
        restore_from_store(criu, store_b, final_b.checkpoint_id, work / "restore-b", result.cases["b"])

        # Job C: (p) a periodic dump, 5% of memory dirtied, then (c) its final dump.
        job_c = cleanup.enter_context(memory_job(work / "job-c", gib, args.dirty))
        store_c = CheckpointStore.for_s3(BUCKET, f"bench-c-{gib:g}g".replace(".", "-"))
        agent_c = checkpointer(job_c, work / "job-c", store_c, work / "agent-c")
        periodic = agent_c.checkpoint("periodic", 1)
        result.cases["p"] = Figures.of(periodic)
        print(f"(p) spotcr periodic: frozen {periodic.frozen_seconds:.2f} s, durable in {periodic.seconds:.2f} s")
        dirty(work / "job-c")
        final_c = agent_c.checkpoint("final", 1)
        result.cases["c"] = Figures.of(final_c)
        print(
            f"(c) spotcr final after periodic: durable in {final_c.seconds:.2f} s, "
            f"{final_c.bytes_uploaded / MiB:.1f} MiB sent of {final_c.bytes_total / MiB:.0f} MiB"
        )
        restored = restore_from_store(criu, store_c, final_c.checkpoint_id, work / "restore-c", result.cases["c"])
        result.store = store_alone(restored / "images", work)
        shutil.rmtree(work / "restore-c", ignore_errors=True)
    return result


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's ThreadedMotoServer on loopback, in its own process so it does not share our GIL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (
        "import time\nfrom moto.server import ThreadedMotoServer\n"
        f"ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False).start()\ntime.sleep(1e9)\n"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the moto server did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


@contextlib.contextmanager
def memory_job(workdir: Path, gib: float, dirty_share: float) -> Iterator[Any]:
    """The job, started as the agent starts jobs (own session and PID namespace, no terminal)."""
    from spotcr_agent.runner import start_job

    job = start_job((sys.executable, str(MEMJOB), str(gib), str(dirty_share)), workdir, {"PATH": os.defpath})
    try:
        wait_for(workdir / "ready", 300, f"the {gib:g} GiB job to fill its memory")
        yield job
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.pid, signal.SIGKILL)
        if job.launcher is not None:
            job.launcher.wait()


def checkpointer(job: Any, workdir: Path, store: Any, agent_dir: Path, *, memory_scratch: bool = True) -> Any:
    from spotcr_agent.checkpoint import Checkpointer
    from spotcr_agent.criu import Criu
    from spotcr_agent.host import read_host
    from spotcr_agent.state import StateFile

    state = StateFile(agent_dir / "state")
    with state.locked() as current:
        current.job_id = store.job_id
        current.generation = 1
        current.job_pid = job.pid
        current.job_start_time = job.start_time
        current.job_status = "running"
    criu = Criu(CRIU)
    return Checkpointer(
        job_id=store.job_id,
        workdir=workdir,
        scratch_dir=agent_dir / "scratch",
        state=state,
        store=store,
        criu=criu,
        host=lambda: read_host(criu.version()),
        memory_scratch_dir=agent_dir / "memory-scratch" if memory_scratch else None,
    )


def dirty(workdir: Path) -> None:
    (workdir / "dirty-done").unlink(missing_ok=True)
    (workdir / "dirty-request").write_text("1")
    wait_for(workdir / "dirty-done", 120, "the job to dirty its memory")


def floor_to_tmpfs(criu: Any, pid: int, tmpfs: Path) -> Figures:
    shutil.rmtree(tmpfs, ignore_errors=True)
    try:
        seconds = criu.dump(pid, tmpfs / "images", tmpfs / "logs", leave_running=True)
        restore = timed_restore(criu, tmpfs / "images", tmpfs / "restore-logs")
        size = sum(p.stat().st_size for p in (tmpfs / "images").iterdir())
    finally:
        shutil.rmtree(tmpfs, ignore_errors=True)
    print(f"(d) CRIU to tmpfs: {seconds:.2f} s frozen, restore {restore:.2f} s, images {size / MiB:.0f} MiB")
    return Figures(frozen=seconds, restore=restore, bytes_total=size, note="tmpfs: not durable")


def s3fs_dump(criu: Any, pid: int, endpoint: str, work: Path, restore: bool) -> Figures:
    mount = work / "s3fs"
    mount.mkdir(parents=True, exist_ok=True)
    passwd = work / "s3fs.passwd"
    passwd.write_text("bench:bench\n")
    passwd.chmod(0o600)
    options = f"url={endpoint},use_path_request_style,passwd_file={passwd},parallel_count=16,multipart_size=32"
    subprocess.run(["s3fs", BUCKET, str(mount), "-o", options], check=True)
    try:
        wait_mounted(mount)
        seconds = criu.dump(pid, mount / "a-images", work / "a-logs", leave_running=True)
        size = sum(p.stat().st_size for p in (mount / "a-images").iterdir())
        figures = Figures(durable=seconds, frozen=seconds, bytes_total=size, bytes_sent=size)
        if restore:
            figures.restore = timed_restore(criu, mount / "a-images", work / "a-restore-logs")
        else:
            figures.note = "restore from the mount not measured (--s3fs-restore)"
    finally:
        subprocess.run(["fusermount", "-u", str(mount)], check=False)
    print(f"(a) CRIU into s3fs-fuse: {seconds:.2f} s, job frozen throughout, {size / MiB:.0f} MiB sent")
    return figures


def restore_from_store(criu: Any, store: Any, checkpoint_id: str, dest: Path, figures: Figures) -> Path:
    """What a backup VM does: fetch the checkpoint, then CRIU restores it (in a fresh PID namespace)."""
    started = time.monotonic()
    store.fetch(checkpoint_id, dest)
    figures.fetch = time.monotonic() - started
    figures.restore = figures.fetch + timed_restore(criu, dest / "images", dest / "restore-logs")
    print(f"    restore: fetch {figures.fetch:.2f} s, total {figures.restore:.2f} s")
    return dest


def timed_restore(criu: Any, images: Path, logs: Path) -> float:
    started = time.monotonic()
    pid = criu.restore(images, logs)
    seconds = time.monotonic() - started
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # PID 1 of the restored namespace: the whole copy goes
    return float(seconds)


def store_alone(images: Path, work: Path) -> dict[str, float]:
    """The store without CRIU: full commit and fetch of the same images, to the endpoint and to a directory."""
    from spotcr_agent.store import CheckpointMeta, CheckpointStore

    size = sum(p.stat().st_size for p in images.rglob("*") if p.is_file()) / MiB
    figures = {}
    stores = {
        "s3": CheckpointStore.for_s3(BUCKET, "bench-store"),
        "dir": CheckpointStore.for_directory(work / "store-dir", "bench-store"),
    }
    (work / "store-dir").mkdir(parents=True, exist_ok=True)
    for name, store in stores.items():
        meta = CheckpointMeta("bench-store", f"{int(time.time() * 1000)}-g1-final", 1, "final")
        commit = store.commit(images, meta)
        figures[f"{name}_commit_mib_s"] = size / commit.seconds
        started = time.monotonic()
        store.fetch(meta.checkpoint_id, work / f"fetch-{name}")
        figures[f"{name}_fetch_mib_s"] = size / (time.monotonic() - started)
        shutil.rmtree(work / f"fetch-{name}", ignore_errors=True)
    shutil.rmtree(work / "store-dir", ignore_errors=True)
    print(
        "    store alone, MiB/s: commit {s3_commit_mib_s:.0f} to moto, {dir_commit_mib_s:.0f} to a directory; "
        "fetch {s3_fetch_mib_s:.0f} from moto, {dir_fetch_mib_s:.0f} from a directory".format(**figures)
    )
    return figures


def ensure_s3fs() -> None:
    if shutil.which("s3fs") and shutil.which("fusermount"):
        return
    print("installing s3fs (apt-get install -y s3fs)")
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(["apt-get", "install", "-y", "-qq", "s3fs"], env=env, check=False).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "s3fs"], env=env, check=True)


def wait_mounted(mount: Path) -> None:
    deadline = time.monotonic() + 20
    while not os.path.ismount(mount):
        if time.monotonic() > deadline:
            raise RuntimeError(f"s3fs did not mount {mount}")
        time.sleep(0.1)


def wait_for(path: Path, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what} ({path})")
        time.sleep(0.05)


def ratio(slow: float | None, fast: float | None) -> float | None:
    return slow / fast if slow and fast else None


def ratios(result: SizeResult) -> dict[str, float | None]:
    c = result.cases
    get = lambda key, attr: getattr(c[key], attr) if key in c else None  # noqa: E731
    return {
        "a_over_c_durable": ratio(get("a", "durable"), get("c", "durable")),
        "a_over_b_durable": ratio(get("a", "durable"), get("b", "durable")),
        "a_over_p_frozen": ratio(get("a", "frozen"), get("p", "frozen")),
        "a_over_d": ratio(get("a", "durable"), get("d", "frozen")),
        "b_over_d": ratio(get("b", "durable"), get("d", "frozen")),
        "c_over_d": ratio(get("c", "durable"), get("d", "frozen")),
        "p_frozen_over_d": ratio(get("p", "frozen"), get("d", "frozen")),
        "c_sent_share": ratio(get("c", "bytes_sent"), get("b", "bytes_sent")),
    }


LABELS = {
    "a": "(a) CRIU into s3fs-fuse (original method)",
    "b": "(b) spotcr final dump",
    "p": "(p) spotcr periodic dump",
    "c": "(c) spotcr final dump after a periodic one",
    "d": "(d) floor: CRIU to tmpfs",
}


def print_size(result: SizeResult) -> None:
    r = ratios(result)
    print(f"-- {result.gib:g} GiB: ratios --")
    for key, value in r.items():
        if value is not None:
            print(f"    {key}: {value:.2f}")
    if r["a_over_c_durable"] is not None:
        verdict = "met" if r["a_over_c_durable"] >= 10 else "NOT met"
        print(f"    (c) is {r['a_over_c_durable']:.1f}x faster than (a) to durable: target 10x {verdict}")


def fmt(value: float | None, unit: str = "s") -> str:
    return "n/a" if value is None else f"{value:.2f} {unit}"


RATIO_TEXT = {
    "a_over_c_durable": "(c) reaches durable {:.1f}x sooner than (a)",
    "a_over_b_durable": "(b) {:.1f}x sooner than (a)",
    "a_over_p_frozen": "a periodic dump (p) freezes the job {:.1f}x shorter than (a)",
    "a_over_d": "against the floor (d): (a) {:.1f}x",
    "b_over_d": "(b) {:.1f}x",
    "c_over_d": "(c) {:.1f}x",
    "p_frozen_over_d": "(p) frozen {:.1f}x",
}
STORE_TEXT = {
    "s3_commit_mib_s": "commit {:.0f} MiB/s to moto",
    "dir_commit_mib_s": "{:.0f} to a directory",
    "s3_fetch_mib_s": "fetch {:.0f} from moto",
    "dir_fetch_mib_s": "{:.0f} from a directory",
}


def markdown(doc: dict[str, Any]) -> str:
    """The README table, from the figures written to checkpoint.json."""
    sizes = doc["sizes"]
    heads = []
    for size in sizes:
        heads += [f"{size['gib']:g} GiB: durable", "frozen", "restore", "sent"]
    lines = ["| case | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for key, label in LABELS.items():
        if not any(key in size["cases"] for size in sizes):
            continue
        cells = []
        for size in sizes:
            f = size["cases"].get(key, {})
            sent = f.get("bytes_sent")
            cells += [fmt(f.get("durable")), fmt(f.get("frozen")), fmt(f.get("restore"))]
            cells.append("n/a" if sent is None else f"{sent / MiB:.0f} MiB")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    for size in sizes:
        q = size["ratios"]
        parts = [text.format(q[name]) for name, text in RATIO_TEXT.items() if q.get(name) is not None]
        if q.get("c_sent_share") is not None:
            parts.append(f"(c) sent {q['c_sent_share']:.1%} of the bytes (b) sent")
        store = [text.format(size["store"][name]) for name, text in STORE_TEXT.items() if name in size["store"]]
        lines.append(f"- {size['gib']:g} GiB: " + "; ".join(parts) + ". Store alone: " + ", ".join(store) + ".")
    lines += [
        "",
        "Final dumps stop the job, so their frozen time runs until durable; a periodic dump freezes the job only",
        "while CRIU writes to local scratch. Restore = fetch from the store + CRIU restore (for (d): from tmpfs).",
        f"Ratios compare figures from one run. Note: {doc['note']}.",
        f"Measured {doc['at']} on {doc['machine']['cpus']} cores, Linux "
        f"{doc['machine']['kernel']}, {doc['dirtied_share']:.0%} of memory dirtied between (p) and (c).",
    ]
    return "\n".join(lines) + "\n"


def write_results(results: list[SizeResult], args: argparse.Namespace) -> None:
    args.results.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "checkpoint",
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "kernel": os.uname().release, "criu": CRIU},
        "note": MOTO_NOTE,
        "dirtied_share": args.dirty,
        "sizes": [
            {"gib": r.gib, "cases": {k: vars(f) for k, f in r.cases.items()}, "ratios": ratios(r), "store": r.store}
            for r in results
        ],
    }
    (args.results / "checkpoint.json").write_text(json.dumps(doc, indent=2) + "\n")
    table = markdown(doc)
    (args.results / "checkpoint.md").write_text(table)
    print("\n" + table)
    print(f"written: {args.results / 'checkpoint.json'}, {args.results / 'checkpoint.md'}")
