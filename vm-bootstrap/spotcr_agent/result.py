"""A finished job's result: its final work dir, committed to storage that outlives the VM, all or nothing.

Layout under `<run>/result/` (store.run_prefix: `jobs/<job>/runs/<run>/`, so each run of a job name keeps its own
result and a name reused later never overwrites an earlier run's): each commit writes its files under its own
`<attempt>/` and then one `manifest.json` naming that attempt with every file's size and SHA-256. The manifest is
written last, in one put (an S3 PUT, or a rename on a file system), so a reader either finds no manifest or a complete
result; files of an attempt that no manifest names (a commit cut short) are deleted by the next commit.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from spotcr_contracts.layout import result_prefix

from .checkpoint import workdir_files
from .store.backends import Backend

VERSION = 1
MANIFEST = "manifest.json"


class ResultError(RuntimeError):
    """A committed result cannot be read back whole; the message names the file and why."""


@dataclass(frozen=True)
class ResultManifest:
    job_id: str
    exit_code: int
    generation: int
    attempt: str
    files: dict[str, dict[str, Any]]  # path relative to the work dir -> {"size": int, "sha256": str}

    def to_json(self) -> bytes:
        document = {"version": VERSION, **self.__dict__}
        return json.dumps(document, indent=1, sort_keys=True).encode()


def missing_files(workdir: Path, declared: tuple[str, ...]) -> list[str]:
    """The declared result files (spotcr:result) that a commit of the work dir would not hold."""
    present = {name.removeprefix("workdir/") for name in workdir_files(workdir)}
    return [name for name in declared if PurePosixPath(name).as_posix() not in present]


def commit_result(
    backend: Backend,
    job_id: str,
    workdir: Path,
    exit_code: int,
    generation: int,
    *,
    run_id: str = "",
    clock: Callable[[], float] = time.time,
) -> str:
    """Upload every regular file of the work dir, then the manifest that makes them the result; its location."""
    prefix = result_prefix(job_id, run_id)
    attempt = f"{int(clock() * 1000):013d}-g{generation}"
    files: dict[str, dict[str, Any]] = {}
    for name, path in sorted(workdir_files(workdir).items()):
        relative = name.removeprefix("workdir/")
        data = path.read_bytes()
        backend.put(f"{prefix}{attempt}/{relative}", data)
        files[relative] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    backend.flush()  # every file durable before the manifest refers to it
    manifest = ResultManifest(job_id, exit_code, generation, attempt, files)
    backend.put(prefix + MANIFEST, manifest.to_json())
    backend.flush()
    leftovers = [
        obj.key
        for obj in backend.scan(prefix)
        if obj.key != prefix + MANIFEST and not obj.key.startswith(f"{prefix}{attempt}/")
    ]
    if leftovers:
        backend.delete(leftovers)
    return backend.describe(prefix + MANIFEST)


def read_manifest(backend: Backend, job_id: str, run_id: str = "") -> ResultManifest:
    document = json.loads(backend.get(result_prefix(job_id, run_id) + MANIFEST))
    if document.get("version") != VERSION:
        raise ResultError(f"result manifest of job {job_id}: version {document.get('version')!r} is not {VERSION}")
    document.pop("version")
    return ResultManifest(**document)


def fetch_result_file(backend: Backend, job_id: str, name: str, run_id: str = "") -> bytes:
    """One file of the run's committed result (a path relative to the work dir), checked against the manifest."""
    manifest = read_manifest(backend, job_id, run_id)
    entry = manifest.files.get(name)
    if entry is None:
        raise ResultError(f"the result of job {job_id} has no {name} (it has {len(manifest.files)} file(s))")
    data = backend.get(f"{result_prefix(job_id, run_id)}{manifest.attempt}/{name}")
    if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ResultError(f"the result of job {job_id}: {name} does not match its manifest")
    return data
