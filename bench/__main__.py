"""`make bench` / `python -m bench [NAME|all] [options]`: benchmarks, NAME one of BENCHMARKS below or gpu.

With no name, the store benchmark runs (issue 23's targets, 2 GiB jobs); `all` runs every benchmark but gpu.

Benchmarks print figures and write them under bench/results/; they are not tests.
"""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHMARKS = {
    "store": "bench.store",  # the checkpoint store against issue 23's targets: requests per GiB, ratios to the floor
    "pipeline": "bench.pipeline",  # the final dump against the notice, per core count and storage, against the floor
    "checkpoint": "bench.checkpoint",  # checkpoint speed: s3fs baseline vs spotcr's store, final and after a periodic
    "final-dump": "bench.final_dump",  # final dump: stream into the store as CRIU writes, or dump then ship
    "interruption": "bench.interruption",  # interruption warning to final-dump command, through the real handler
    "reclaim": "bench.reclaim",  # a wave of N jobs warned within seconds, all recovered at once
    "lazy": "bench.lazy",  # restore order to job running again and to its last page in: lazy against whole
    "nodes": "bench.nodes",  # a job over 2 and 3 VMs: coordinated freeze and final dump against one node's
}
# Only on a machine with an NVIDIA GPU, so not part of "all".
GPU_BENCHMARKS = {"gpu": "bench.gpu"}  # GPU jobs: final dump and restore against device memory held


def run(name: str, argv: list[str]) -> int:
    return int(importlib.import_module({**BENCHMARKS, **GPU_BENCHMARKS}[name]).main(argv))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="spotcr benchmarks: print figures and write bench/results/<name>.json and .md.",
        epilog="Options after the benchmark name go to it: python -m bench checkpoint --help",
    )
    parser.add_argument("benchmark", nargs="?", default="store", choices=[*BENCHMARKS, *GPU_BENCHMARKS, "all"])
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options for the chosen benchmark")
    args = parser.parse_args(argv)
    if args.benchmark != "all":
        return run(args.benchmark, args.options)
    if args.options:
        parser.error("options go to one benchmark: python -m bench checkpoint --sizes 1")
    return max(run(name, []) for name in BENCHMARKS)


if __name__ == "__main__":
    sys.exit(main())
