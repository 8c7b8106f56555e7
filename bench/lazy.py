"""Lazy restore against today's whole restore, per job size, in one run (issue 24's targets).

For each size a job (bench/lazyjob.py: half-random memory, read again and again once told to go) is dumped once
and committed to a directory store on local disk; then the agent's own Restorer restores it twice from the store:
whole (every chunk fetched, then `criu restore`) and lazily (lazy.py). For each: restore order to the job running
again, to its last page in, and the job's progress (MiB of its memory read per second) while pages still stream
against after. Target: the 4 GiB job runs again at most 1.5x as late as the 256 MiB job, lazily.

    python -m bench lazy [--sizes 0.25,4] [--measure-s 4] [--dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.pipeline import describe_machine

BENCH = Path(__file__).resolve().parent
JOB = BENCH / "lazyjob.py"
RESULTS = BENCH / "results"
TARGET_RATIO = 1.5
CHECKPOINT_ID = "1795293235815-g1-final"


def dump(gib: float, base: Path) -> tuple[Path, Path]:
    """Start the job, wait for its memory, dump it; its images and work dir."""
    from spotcr_agent.criu import Criu

    work = base / "work"
    work.mkdir(parents=True)
    launcher = subprocess.Popen(
        ["unshare", "-p", "-f", "setsid", sys.executable, str(JOB), str(gib)],
        cwd=work,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    while not (work / "ready").exists():
        if time.monotonic() > deadline or launcher.poll() is not None:
            raise RuntimeError("the benchmark's job did not fill its memory")
        time.sleep(0.05)
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    Criu().dump(int(children[0]), base / "images", base / "dump-logs", leave_running=False)
    launcher.wait(timeout=60)
    return base / "images", work


def restore(store: Any, work: Path, base: Path, generation: int, *, lazy: bool, measure_s: float) -> dict[str, Any]:
    """Restore the checkpoint (whole or lazily), let the job run, measure; the figures."""
    from spotcr_agent.criu import Criu
    from spotcr_agent.host import read_host
    from spotcr_agent.lazy import kill_tree
    from spotcr_agent.restore import Restorer
    from spotcr_agent.state import StateFile

    criu = Criu()
    host = read_host(criu.version())
    running_at: list[float] = []

    def on_running(pid: int) -> None:
        running_at.append(time.time())
        (work / "go").write_text("")

    restorer = Restorer(
        job_id="bench-lazy",
        workdir=work,
        scratch_dir=base / "scratch",
        state=StateFile(base / "state"),
        store=store,
        criu=criu,
        host=lambda: host,
        lazy=lazy,
        on_running=on_running,
    )
    outcome = restorer.restore(generation)
    all_pages_at = time.time()
    if not lazy:
        (work / "go").write_text("")
        running_at.append(all_pages_at)
    time.sleep(measure_s)
    kill_tree(outcome.pid)
    progress = [tuple(map(float, line.split())) for line in (work / "progress").read_text().splitlines()]
    return {
        "running_s": outcome.running_seconds,
        "all_pages_s": outcome.seconds,
        "lazy": outcome.lazy,
        "rate_while_streaming_mib_s": _rate(progress, running_at[0], all_pages_at) if lazy else None,
        "rate_after_mib_s": _rate(progress, all_pages_at, all_pages_at + measure_s),
    }


def _rate(progress: list[tuple[float, ...]], start: float, end: float) -> float | None:
    """MiB of memory read per second between two wall-clock times (from the job's own progress lines)."""
    inside = [(at, mib) for at, mib in progress if start <= at <= end]
    before = [mib for at, mib in progress if at < start]
    if not inside:
        return None
    base = before[-1] if before else 0.0
    last_at, last_mib = inside[-1]
    return round((last_mib - base) / max(last_at - start, 1e-3), 1)


def run_size(gib: float, root: Path, measure_s: float) -> dict[str, Any]:
    from spotcr_agent.criu import Criu
    from spotcr_agent.host import read_host
    from spotcr_agent.store import CheckpointMeta, CheckpointStore

    base = root / f"{gib:g}gib"
    images, work = dump(gib, base)
    (base / "store").mkdir()
    store = CheckpointStore.for_directory(base / "store", "bench-lazy")
    host = read_host(Criu().version())
    meta = CheckpointMeta(
        job_id="bench-lazy",
        checkpoint_id=CHECKPOINT_ID,
        generation=1,
        kind="final",
        criu_version=host.criu_version,
        kernel=host.kernel,
        arch=host.arch,
        cpu_flags=host.cpu_flags,
    )
    committed = store.commit(images, meta)
    shutil.rmtree(images)
    figures: dict[str, Any] = {"gib": gib, "images_mib": round(committed.bytes_total / (1 << 20))}
    figures["whole"] = restore(store, work, base, 2, lazy=False, measure_s=measure_s)
    (work / "progress").unlink(missing_ok=True)
    figures["lazy"] = restore(store, work, base, 3, lazy=True, measure_s=measure_s)
    return figures


def markdown(result: dict[str, Any]) -> str:
    rows = [
        "| job | restore | order to running again | order to last page in | job's sweep while pages stream | after |",
        "|---|---|---|---|---|---|",
    ]
    for size in result["sizes"]:
        for kind in ("whole", "lazy"):
            f = size[kind]
            streaming = f"{f['rate_while_streaming_mib_s']} MiB/s" if f["rate_while_streaming_mib_s"] else "-"
            rows.append(
                f"| {size['gib']:g} GiB | {kind} | {f['running_s']:.2f} s | {f['all_pages_s']:.2f} s | {streaming} | "
                f"{f['rate_after_mib_s']} MiB/s |"
            )
    verdict = result["target"]
    machine = result["machine"]
    return "\n".join(
        [
            "# Lazy restore (python -m bench lazy)",
            "",
            f"Machine: {machine['cpus']} CPUs ({machine['cpu']}), {machine['memory_gib']} GiB, Linux "
            f"{machine['kernel']}, CRIU {machine['criu']}; load before {machine['load_before']}, after "
            f"{machine['load_after']}. Store: a directory on local disk. {machine['kind']}.",
            "",
            *rows,
            "",
            "The job sweeps its memory again and again, reading one byte of each page: its rate is MiB of memory"
            " swept per second, its rate while its pages stream is to be read against its rate once they are all in.",
            "",
            f"Target: {verdict['text']}",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench lazy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.25,4", help="job sizes in GiB, comma-separated")
    parser.add_argument("--measure-s", type=float, default=4.0, help="how long the job runs after each restore")
    parser.add_argument("--dir", type=Path, default=None, help="where images and stores go (default: a temp dir)")
    parser.add_argument("--out", default="lazy", help="results file name under bench/results/")
    args = parser.parse_args(argv)
    machine = describe_machine()
    root = Path(tempfile.mkdtemp(prefix="spotcr-bench-lazy-", dir=args.dir))
    try:
        sizes = []
        for gib in (float(s) for s in args.sizes.split(",")):
            sizes.append(run_size(gib, root, args.measure_s))
            print(json.dumps(sizes[-1]), flush=True)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(root)
    machine["load_after"] = os.getloadavg()
    small, large = sizes[0]["lazy"]["running_s"], sizes[-1]["lazy"]["running_s"]
    ratio = large / small if small else float("inf")
    met = ratio <= TARGET_RATIO
    text = (
        f"the {sizes[-1]['gib']:g} GiB job runs again {large:.2f} s after the order, {ratio:.2f}x the "
        f"{sizes[0]['gib']:g} GiB job's {small:.2f} s (at most {TARGET_RATIO}x): {'met' if met else 'NOT met'}"
    )
    result = {"machine": machine, "sizes": sizes, "target": {"ratio": round(ratio, 2), "met": met, "text": text}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(result))
    print(markdown(result))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
