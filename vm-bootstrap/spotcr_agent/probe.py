"""`spotcr-agent probe`: how fast this VM writes and reads each storage, and the agent's own checkpoint pipeline.

In the manner of IOR: for each (parallel streams, block size) configuration, every stream writes its own file
(or, on S3, its own objects of one block each) in blocks of that size, made durable (fsync, or the PUT's answer),
then reads it back; the rate is the bytes of all streams over the time from the first start to the last end.
What is read back is hashed and compared with what was written. Then the store's own path (chunk, hash,
compress, put; then fetch) commits a synthetic image set, half random and half zero pages as CRIU's pages
images are, into the same storage, and fetches it back. Everything the probe writes is deleted afterwards.

The result is one JSON object per storage (ProbeResult); `spotcr plan` reads its rates.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from spotcr_contracts.layout import run_prefix

from .store import CheckpointMeta, CheckpointStore
from .store.backends import Backend, DirectoryBackend, S3Backend, Under

FORMAT = 1
MIB = 1024 * 1024
PAGE = 4096
DEFAULT_STREAMS = (1, 4)
DEFAULT_BLOCK_KIB = (64, 1024)
DEFAULT_SIZE_MIB = 8  # per stream and configuration: small, so a probe on a shared 2-core machine is quick
DEFAULT_PIPELINE_MIB = 16
STORAGE_NAMES = ("s3", "ebs", "efs", "fsx", "local")  # local: the VM's scratch dir, where periodic dumps go
PROBE_JOB_PREFIX = "spotcr-probe-"  # a job id under jobs/ for a probe that is not on a job VM


class ProbeError(ValueError):
    """A probe setting or target is wrong; the message names it."""


@dataclass(frozen=True)
class ProbeSettings:
    streams: tuple[int, ...] = DEFAULT_STREAMS
    block_kib: tuple[int, ...] = DEFAULT_BLOCK_KIB
    size_mib: int = DEFAULT_SIZE_MIB
    pipeline_mib: int = DEFAULT_PIPELINE_MIB  # 0: skip the pipeline

    def __post_init__(self) -> None:
        if not self.streams or any(s < 1 or s > 256 for s in self.streams):
            raise ProbeError(f"streams must be 1 to 256, got {self.streams}")
        if not self.block_kib or any(b < 4 or b > 65536 or b % 4 for b in self.block_kib):
            raise ProbeError(f"block sizes must be multiples of 4 KiB from 4 to 65536, got {self.block_kib}")
        if self.size_mib < 1 or self.size_mib > 65536:
            raise ProbeError(f"size per stream must be 1 to 65536 MiB, got {self.size_mib}")
        if self.size_mib * 1024 < max(self.block_kib):
            raise ProbeError(
                f"size per stream ({self.size_mib} MiB) is smaller than a block ({max(self.block_kib)} KiB)"
            )
        if self.pipeline_mib < 0 or self.pipeline_mib > 65536:
            raise ProbeError(f"pipeline size must be 0 to 65536 MiB, got {self.pipeline_mib}")


@dataclass(frozen=True)
class Measurement:
    """One (streams, block size) configuration: bytes and seconds of the write phase and the read phase."""

    streams: int
    block_bytes: int
    bytes_written: int
    bytes_read: int
    write_s: float
    read_s: float
    verified: bool  # every stream read back exactly what it wrote

    @property
    def write_mib_s(self) -> float:
        return self.bytes_written / MIB / max(self.write_s, 1e-9)

    @property
    def read_mib_s(self) -> float:
        return self.bytes_read / MIB / max(self.read_s, 1e-9)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "write_mib_s": self.write_mib_s, "read_mib_s": self.read_mib_s}


@dataclass(frozen=True)
class PipelineMeasurement:
    """The store's commit (chunk, hash, compress, put) and fetch of a synthetic image set."""

    bytes_total: int
    bytes_stored: int
    commit_s: float
    fetch_s: float
    verified: bool

    @property
    def commit_mib_s(self) -> float:
        return self.bytes_total / MIB / max(self.commit_s, 1e-9)

    @property
    def fetch_mib_s(self) -> float:
        return self.bytes_total / MIB / max(self.fetch_s, 1e-9)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "commit_mib_s": self.commit_mib_s, "fetch_mib_s": self.fetch_mib_s}


@dataclass(frozen=True)
class ProbeResult:
    """What `spotcr plan` reads: the best write and read rates over the configurations, and the pipeline's."""

    storage: str
    location: str
    instance_type: str
    measured_at: str
    host: str
    settings: ProbeSettings
    runs: tuple[Measurement, ...]
    pipeline: PipelineMeasurement | None = None
    format: int = FORMAT
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def write_mib_s(self) -> float:
        return max(m.write_mib_s for m in self.runs)

    @property
    def read_mib_s(self) -> float:
        return max(m.read_mib_s for m in self.runs)

    @property
    def pipeline_mib_s(self) -> float | None:
        return self.pipeline.commit_mib_s if self.pipeline else None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "storage": self.storage,
            "location": self.location,
            "instance_type": self.instance_type,
            "measured_at": self.measured_at,
            "host": self.host,
            "settings": asdict(self.settings),
            "write_mib_s": self.write_mib_s,
            "read_mib_s": self.read_mib_s,
            "pipeline_mib_s": self.pipeline_mib_s,
            "runs": [m.to_json() for m in self.runs],
            "pipeline": self.pipeline.to_json() if self.pipeline else None,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProbeResult:
        """A stored probe result, checked: the planner trusts only a complete, readable one."""
        try:
            if data.get("format") != FORMAT:
                raise ProbeError(f"probe result format {data.get('format')!r} is not {FORMAT}")
            storage = str(data["storage"])
            if storage not in STORAGE_NAMES:
                raise ProbeError(f"probe result for unknown storage {storage[:32]!r}")
            runs = tuple(
                Measurement(
                    streams=int(r["streams"]),
                    block_bytes=int(r["block_bytes"]),
                    bytes_written=int(r["bytes_written"]),
                    bytes_read=int(r["bytes_read"]),
                    write_s=float(r["write_s"]),
                    read_s=float(r["read_s"]),
                    verified=bool(r["verified"]),
                )
                for r in data["runs"]
            )
            if not runs:
                raise ProbeError("probe result has no measurements")
            pipeline = data.get("pipeline")
            return cls(
                storage=storage,
                location=str(data["location"]),
                instance_type=str(data["instance_type"]),
                measured_at=str(data["measured_at"]),
                host=str(data.get("host", "")),
                settings=ProbeSettings(
                    streams=tuple(data["settings"]["streams"]),
                    block_kib=tuple(data["settings"]["block_kib"]),
                    size_mib=int(data["settings"]["size_mib"]),
                    pipeline_mib=int(data["settings"]["pipeline_mib"]),
                ),
                runs=runs,
                pipeline=PipelineMeasurement(**{k: pipeline[k] for k in PIPELINE_FIELDS}) if pipeline else None,
            )
        except (KeyError, TypeError, ValueError) as error:
            if isinstance(error, ProbeError):
                raise
            raise ProbeError(f"probe result is incomplete or malformed: {error!r}") from error


PIPELINE_FIELDS = ("bytes_total", "bytes_stored", "commit_s", "fetch_s", "verified")


class _Target(Protocol):
    """Where one configuration's streams write and read: a directory, or S3 objects under a prefix."""

    def write(self, stream: int, block: int, data: bytes) -> int: ...

    def read(self, stream: int, block: int) -> tuple[int, str]: ...

    def clean(self) -> None: ...


class _DirectoryTarget:
    def __init__(self, root: Path) -> None:
        self.dir = root / f".spotcr-probe-{uuid.uuid4().hex[:12]}"
        self.dir.mkdir(parents=True)

    def _path(self, stream: int, block: int) -> Path:
        return self.dir / f"s{stream}-b{block}"

    def write(self, stream: int, block: int, data: bytes) -> int:
        view = memoryview(data)
        fd = os.open(self._path(stream, block), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for start in range(0, len(view), block):
                os.write(fd, view[start : start + block])
            os.fsync(fd)
            # Reads should come from the storage, not from this VM's page cache: best effort.
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return len(data)

    def read(self, stream: int, block: int) -> tuple[int, str]:
        digest = hashlib.sha256()
        total = 0
        with open(self._path(stream, block), "rb", buffering=0) as f:
            while chunk := f.read(block):
                digest.update(chunk)
                total += len(chunk)
        return total, digest.hexdigest()

    def clean(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class _S3Target:
    def __init__(self, backend: Backend, prefix: str, size: int) -> None:
        self.backend = backend
        self.prefix = prefix
        self.size = size
        self.keys: list[str] = []
        self._lock = threading.Lock()

    def _key(self, stream: int, block: int, index: int) -> str:
        return f"{self.prefix}s{stream}-b{block}/{index:08d}"

    def write(self, stream: int, block: int, data: bytes) -> int:
        view = memoryview(data)
        for index, start in enumerate(range(0, len(view), block)):
            key = self._key(stream, block, index)
            self.backend.put(key, bytes(view[start : start + block]))
            with self._lock:
                self.keys.append(key)
        return len(data)

    def read(self, stream: int, block: int) -> tuple[int, str]:
        digest = hashlib.sha256()
        total = 0
        for index in range(-(-self.size // block)):
            chunk = self.backend.get(self._key(stream, block, index))
            digest.update(chunk)
            total += len(chunk)
        return total, digest.hexdigest()

    def clean(self) -> None:
        self.backend.delete(sorted(set(self.keys)))


def _timed_parallel(streams: int, work: Callable[[int], Any]) -> tuple[float, list[Any]]:
    """Run work(i) for every stream at once; seconds from the common start to the last end."""
    start = threading.Barrier(streams + 1)

    def run(i: int) -> Any:
        start.wait()
        return work(i)

    with ThreadPoolExecutor(max_workers=streams) as pool:
        futures = [pool.submit(run, i) for i in range(streams)]
        start.wait()
        began = time.perf_counter()
        results = [f.result() for f in futures]
        return time.perf_counter() - began, results


def _write(target: _Target, block: int, data: bytes, stream: int) -> int:
    return target.write(stream, block, data)


def _read(target: _Target, block: int, stream: int) -> tuple[int, str]:
    return target.read(stream, block)


def measure(target: _Target, settings: ProbeSettings, data: bytes) -> list[Measurement]:
    """Every (streams, block size) configuration of settings on one target, each written then read back."""
    expected = hashlib.sha256(data).hexdigest()
    runs = []
    for streams in settings.streams:
        for block_kib in settings.block_kib:
            block = block_kib * 1024
            write_s, written = _timed_parallel(streams, functools.partial(_write, target, block, data))
            read_s, read = _timed_parallel(streams, functools.partial(_read, target, block))
            runs.append(
                Measurement(
                    streams=streams,
                    block_bytes=block,
                    bytes_written=sum(written),
                    bytes_read=sum(n for n, _ in read),
                    write_s=write_s,
                    read_s=read_s,
                    verified=all(digest == expected for _, digest in read),
                )
            )
    return runs


def _synthetic_images(directory: Path, size: int, seed: bytes) -> None:
    """A CRIU-like image set: pages, half random and half zero (zero pages compress, random ones do not)."""
    pages = max(1, size // PAGE)
    random_page = hashlib.sha256(seed).digest() * (PAGE // 32)
    with open(directory / "pages-1.img", "wb") as f:
        for index in range(pages):
            if index % 2:
                f.write(bytes(PAGE))
            else:
                # Distinct pages, so that content-defined chunking and deduplication see real data.
                f.write(os.urandom(64) + random_page[64:])
    (directory / "inventory.img").write_bytes(b"spotcr probe\n")


def measure_pipeline(backend: Backend, size: int, scratch: Path, workers: int) -> PipelineMeasurement:
    """Commit a synthetic image set through the agent's store into backend, as a job of its own, fetch it back,
    then delete it."""
    job_id = f"{PROBE_JOB_PREFIX}{uuid.uuid4().hex[:12]}"
    store = CheckpointStore(backend, job_id, workers=workers)
    written = f"jobs/{job_id}/"
    checkpoint_id = f"{int(time.time() * 1000):013d}-g0-periodic"
    with tempfile.TemporaryDirectory(dir=scratch, prefix=".spotcr-probe-") as work:
        images = Path(work) / "images"
        fetched = Path(work) / "fetched"
        images.mkdir()
        _synthetic_images(images, size, job_id.encode())
        bytes_total = sum(p.stat().st_size for p in images.iterdir())
        try:
            began = time.perf_counter()
            result = store.commit(
                images, CheckpointMeta(job_id=job_id, checkpoint_id=checkpoint_id, generation=0, kind="periodic")
            )
            commit_s = time.perf_counter() - began
            began = time.perf_counter()
            store.fetch(checkpoint_id, fetched)
            fetch_s = time.perf_counter() - began
            verified = all(
                _file_digest(images / p.name) == _file_digest(fetched / "images" / p.name) for p in images.iterdir()
            )
        finally:
            backend.delete([o.key for o in backend.scan(written)])
            # A file system also keeps the directories the store made.
            if isinstance(backend, DirectoryBackend):
                shutil.rmtree(backend.root / "jobs" / job_id, ignore_errors=True)
                with contextlib.suppress(OSError):
                    (backend.root / "jobs").rmdir()  # only if no job's checkpoints are there
    return PipelineMeasurement(bytes_total, result.bytes_uploaded, commit_s, fetch_s, verified)


def _file_digest(path: Path) -> str:
    if not path.is_file():
        return ""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MIB):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class ProbeTarget:
    """One storage to probe: a mounted directory (ebs, efs, fsx, local), or an S3 bucket (s3)."""

    storage: str
    directory: Path | None = None
    bucket: str = ""

    def __post_init__(self) -> None:
        if self.storage not in STORAGE_NAMES:
            raise ProbeError(f"unknown storage {self.storage[:32]!r}; one of {', '.join(STORAGE_NAMES)}")
        if (self.directory is None) == (not self.bucket):
            raise ProbeError(f"{self.storage}: give a directory or a bucket, not both or neither")
        if self.directory is not None and not self.directory.is_dir():
            raise ProbeError(f"{self.storage}: {self.directory} is not a directory")

    @property
    def location(self) -> str:
        return f"s3://{self.bucket}" if self.bucket else str(self.directory)


def probe(
    targets: Iterable[ProbeTarget],
    settings: ProbeSettings,
    *,
    instance_type: str,
    scratch: Path,
    s3_backend: Callable[[str], S3Backend] | None = None,
    s3_job: str = "",
    s3_run: str = "",
    s3_session: Any = None,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> list[ProbeResult]:
    """Probe each target in turn (never two at once: they would share the VM's network and CPUs). `s3_job`,
    `s3_run` and `s3_session`: on a job VM, S3 is probed with the job's vended store credentials (the VM's own role
    reaches no job's objects), which write only under the run's own prefix: there the probe keeps its objects under
    `probe/`, which the run's restore never looks at, and deletes them afterwards."""
    if s3_job and not s3_run:
        raise ProbeError(f"job {s3_job} has no run yet: probe its S3 store once the job started")
    scope = f"jobs/{s3_job}/" if s3_job else ""
    make_s3 = s3_backend or (
        lambda bucket: S3Backend(bucket, max_connections=max(settings.streams) + 20, session=s3_session, scope=scope)
    )
    data = os.urandom(settings.size_mib * MIB)
    results = []
    for target in targets:
        measured_at = now().isoformat(timespec="seconds")
        backend: Backend
        if target.bucket:
            s3 = make_s3(target.bucket)
            s3.check()
            if s3_job:
                backend = Under(s3, f"{run_prefix(s3_job, s3_run)}probe/{uuid.uuid4().hex[:12]}/")
                io: _Target = _S3Target(backend, "io/", len(data))
            else:
                backend = s3
                io = _S3Target(s3, f"jobs/{PROBE_JOB_PREFIX}{uuid.uuid4().hex[:12]}/io/", len(data))
        else:
            assert target.directory is not None
            backend = DirectoryBackend(target.directory)
            io = _DirectoryTarget(target.directory)
        try:
            runs = measure(io, settings, data)
        finally:
            io.clean()
        pipeline = None
        if settings.pipeline_mib:
            workers = 16 if target.bucket else 8  # as CheckpointStore.for_s3 / for_directory
            pipeline = measure_pipeline(backend, settings.pipeline_mib * MIB, scratch, workers)
        results.append(
            ProbeResult(
                storage=target.storage,
                location=target.location,
                instance_type=instance_type,
                measured_at=measured_at,
                host=socket.gethostname(),
                settings=settings,
                runs=tuple(runs),
                pipeline=pipeline,
            )
        )
    return results


def parse_target(text: str) -> ProbeTarget:
    """STORAGE=PATH for a directory, s3=BUCKET for a bucket (a bare PATH is `local`)."""
    storage, sep, where = text.partition("=")
    if not sep:
        storage, where = "local", text
    if storage == "s3":
        if not where:
            raise ProbeError("s3= needs a bucket name")
        return ProbeTarget("s3", bucket=where)
    return ProbeTarget(storage, directory=Path(where))


def parse_list(name: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as error:
        raise ProbeError(f"{name} must be comma-separated whole numbers, got {text[:64]!r}") from error
    if not values:
        raise ProbeError(f"{name} is empty")
    return values


def config_targets(storage: str, bucket: str, mount_point: Path, scratch_dir: Path) -> list[ProbeTarget]:
    """On a job VM: the stack's bucket, the job's mounted storage (ebs, efs, fsx) and the local scratch dir."""
    targets = []
    if bucket:
        targets.append(ProbeTarget("s3", bucket=bucket))
    if storage != "s3" and mount_point.is_dir():
        targets.append(ProbeTarget(storage, directory=mount_point))
    scratch_dir.mkdir(parents=True, exist_ok=True)
    targets.append(ProbeTarget("local", directory=scratch_dir))
    return targets


def summary(results: Sequence[ProbeResult]) -> dict[str, Any]:
    return {"ok": True, "results": [r.to_json() for r in results]}
