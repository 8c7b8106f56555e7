"""Final dump: stream images into the store while CRIU writes them, or dump to local scratch and then ship?

`python -m bench.final_dump [--gib 0.5] [--rounds 2] [--s3]`: runs bench/memjob.py under the real agent,
takes its final dump both ways, and prints seconds from dump start to durable (the figure that counts when
the VM has two minutes left), with the ratio stream / dump-then-ship. Writes bench/results/final_dump.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from spotcr_agent.agent import Agent, base_job_env
from spotcr_agent.config import AgentConfig
from spotcr_agent.store import CheckpointStore

MEMJOB = Path(__file__).with_name("memjob.py")
RESULTS = Path(__file__).with_name("results")


class _Quiet:
    def publish(self, event: object) -> bool:
        return True


def _one(root: Path, mode: str, gib: float, store: CheckpointStore, storage: str) -> dict[str, float]:
    config = AgentConfig(
        job_id=store.job_id,
        instance_id="i-bench",
        storage=storage,
        bucket="bench",
        generation=1,
        workdir=root / "work",
        state_dir=root / "state",
        command=(sys.executable, str(MEMJOB), str(gib), "0.05"),
        final_dump=mode,
        local_dirs=(),  # the benchmark's job runs on this host, whose /tmp is everyone's, not a job VM's own
    )
    agent = Agent(config=config, publisher=_Quiet(), job_env=base_job_env(os.environ), store_factory=lambda _: store)
    agent.start_job()
    deadline = time.monotonic() + 300
    while not (config.workdir / "ready").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("memjob did not fill its memory in 300 s")
        time.sleep(0.05)
    outcome = agent.checkpoint("final", 1)
    return {"seconds": outcome.seconds, "bytes_total": outcome.bytes_total, "bytes_uploaded": outcome.bytes_uploaded}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.final_dump", description=__doc__)
    parser.add_argument("--gib", type=float, default=0.5, help="job memory in GiB")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--s3", action="store_true", help="S3 at AWS_ENDPOINT_URL, bucket spotcr-bench")
    args = parser.parse_args(argv)
    figures: dict[str, list[float]] = {"stream": [], "dump-then-ship": []}
    with tempfile.TemporaryDirectory(prefix="spotcr-bench-", dir="/var/tmp") as tmp:
        for round_ in range(args.rounds):
            for mode, runs in figures.items():
                root = Path(tmp) / f"{mode}-{round_}"
                job = f"bench-{mode.replace('-', '')}-{round_}"
                if args.s3:
                    store = CheckpointStore.for_s3("spotcr-bench", job)
                else:
                    (root / "store").mkdir(parents=True)
                    store = CheckpointStore.for_directory(root / "store", job)
                result = _one(root, mode, args.gib, store, "s3" if args.s3 else "efs")
                runs.append(result["seconds"])
                mib = int(result["bytes_total"]) >> 20
                print(f"{mode:15s} round {round_}: {result['seconds']:.2f} s to durable, {mib} MiB")
    stream, ship = statistics.median(figures["stream"]), statistics.median(figures["dump-then-ship"])
    summary = {
        "gib": args.gib,
        "backend": "s3" if args.s3 else "directory",
        "median_seconds": {"stream": stream, "dump-then-ship": ship},
        "ratio_stream_over_dump_then_ship": round(stream / ship, 3),
        "runs": figures,
    }
    print(json.dumps(summary, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"final_dump_{summary['backend']}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
