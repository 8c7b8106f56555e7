"""The suite's workloads: real third-party programs, each seeded and a few seconds long, and what each holds.

`holds` are probe checks (tests/workloads/probe.py) that must all be true when the job is checkpointed, so a
pass means the feature really was in the checkpoint (the sort had spilled, the connection was established).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PROGRAMS = Path(__file__).parent / "programs"
PYTHON = sys.executable  # the venv's: numpy comes from requirements/dev.lock
NUMPY = str(Path(str(importlib.util.find_spec("numpy").origin)).resolve().parent)  # type: ignore[union-attr]
STEPS, PACE_MS = 30, 200


@dataclass(frozen=True)
class Workload:
    name: str
    command: Callable[[Path], tuple[str, ...]]  # given the directory of built programs
    holds: tuple[str, ...]
    results: tuple[str, ...] = ("result.txt",)  # files of the work dir compared byte for byte
    env: dict[str, str] = field(default_factory=dict)
    first_dump_at: int = 8  # progress steps before the periodic checkpoint, then the final dump 5 steps later
    # A limitation not yet lifted: the exact words it fails with. The test fails on any other failure, and once
    # the workload passes, so that the entry is removed with the fix.
    known_failure: str = ""
    refused: str = ""  # for REFUSED: words the failed checkpoint must say


def _args(steps: int = STEPS) -> tuple[str, str]:
    return str(steps), str(PACE_MS)


WORKLOADS = (
    Workload(
        "jvm-default-flags",
        lambda built: ("java", "-cp", str(built / "java"), "Work", *_args()),
        holds=("maps:/tmp/hsperfdata_root/", "threads:8"),
    ),
    Workload(
        "go-goroutines",
        lambda built: (str(built / "goroutines"), *_args()),
        holds=("threads:3",),
    ),
    Workload(
        "numpy-openblas-threads",
        lambda built: (PYTHON, str(PROGRAMS / "numpy_threads.py"), *_args()),
        holds=("threads:2", "maps:" + NUMPY),  # OpenBLAS starts one thread per core (2 on CI)
    ),
    Workload(
        "openmp-c",
        lambda built: (str(built / "openmp"), *_args()),
        holds=("threads:2",),
        env={"OMP_NUM_THREADS": "4"},
    ),
    Workload(
        "node-http-server",
        lambda built: ("node", str(PROGRAMS / "http_server.js"), *_args()),
        holds=("tcp-vm:8088",),
        results=("result.txt",),
    ),
    Workload(
        "redis-with-client",
        lambda built: (PYTHON, str(PROGRAMS / "redis_client.py"), *_args()),
        holds=("tcp:6399", "processes:redis-server:1"),  # on loopback, which every VM has: kept established
    ),
    Workload(
        "sort-pipeline-spills-to-tmp",
        lambda built: ("bash", str(PROGRAMS / "sort_pipeline.sh"), PYTHON, *_args()),
        holds=("spilled:/tmp:sort", "open:/tmp/pipeline.log"),
        results=("result.txt", "log.txt"),
    ),
    Workload(
        "python-unlinked-tempfile-and-pool",
        lambda built: (PYTHON, str(PROGRAMS / "tempfile_pool.py"), *_args()),
        holds=(f"unlinked:/tmp:{(1 << 20) + 1}", "processes:python:3"),
    ),
    Workload(
        "mpich-two-ranks",
        lambda built: ("mpiexec", "-n", "2", str(built / "mpi"), *_args()),
        # UCX's shared memory between the ranks, and its TCP transport listening on the VM's own address, which
        # no other VM has: the restore keeps that address on the backup's loopback.
        holds=("processes:mpi:2", "maps:/SYSV", "listen-vm:"),
    ),
    Workload(
        "openmpi-two-ranks",
        lambda built: (
            *("mpiexec.openmpi", "--allow-run-as-root", "--oversubscribe", "-n", "2"),
            *(str(built / "mpi-openmpi"), *_args()),
        ),
        # Its shared memory between the ranks (vader), and mpirun's session dir in /tmp, which holds a FIFO
        holds=("processes:mpi-openmpi:2", "maps:/dev/shm/vader_segment", "open:/tmp/ompi."),
    ),
    # Jobs with mount namespaces of their own (MPI launchers, sandboxes, containers): every one of them must find
    # the restoring VM's files, so the result is compared on the backup, where every write must have landed.
    Workload(
        "unshare-mount-proc",
        lambda built: ("unshare", "--mount", "--mount-proc", str(built / "goroutines"), *_args()),
        holds=("threads:3",),
    ),
    Workload(
        "bind-mount-of-workdir",
        lambda built: ("bash", str(PROGRAMS / "bind_workdir.sh"), str(built / "goroutines"), *_args()),
        holds=("threads:3",),
        results=("data/result.txt", "data/progress.log"),
    ),
    Workload(
        "mpich-in-own-mount-namespace",
        lambda built: ("unshare", "--mount", "--mount-proc", "mpiexec", "-n", "2", str(built / "mpi"), *_args()),
        holds=("processes:mpi:2", "maps:/SYSV", "listen-vm:"),
    ),
    Workload(
        "sqlite-wal",
        lambda built: (PYTHON, str(PROGRAMS / "sqlite_job.py"), *_args(), "wal"),
        holds=("open:{workdir}/data.db-wal", "maps:{workdir}/data.db-shm"),
    ),
)


# Programs whose state cannot be carried: the checkpoint must fail and name the cause (`refused`), no checkpoint
# is reported complete, and the job runs on unharmed.
REFUSED = (
    Workload(
        # Node 20's libuv with UV_USE_IO_URING=1 holds the same (Debian 12's Node 18 has no io_uring): the
        # refusal's workaround names Node's switch either way.
        "c-holding-io-uring",
        lambda built: (str(built / "io_uring"), *_args()),
        holds=("open:anon_inode:[io_uring]",),
        refused="UV_USE_IO_URING=0",
    ),
    Workload(
        "sqlite-rollback-journal",
        lambda built: (PYTHON, str(PROGRAMS / "sqlite_job.py"), *_args()),
        holds=("open:{workdir}/data.db",),
        # SQLite keeps the inode number of its database file and refuses to write once the path names another
        # inode (SQLITE_READONLY_DBMOVED); every restored file is a new inode. WAL mode does not check this.
        refused="PRAGMA journal_mode=WAL",
    ),
)
