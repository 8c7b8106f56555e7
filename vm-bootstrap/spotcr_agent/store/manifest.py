"""The checkpoint manifest: the one record of what a checkpoint holds, written last to commit it."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from spotcr_contracts.commands import CHECKPOINT_ID_PATTERN
from spotcr_contracts.tags import JOB_ID_PATTERN, RUN_ID_PATTERN

from .errors import CorruptCheckpoint, UnsupportedManifest

FORMAT_VERSION = 1
HASH_ALGORITHM = "sha256"
KINDS = ("periodic", "final")

_CHECKPOINT_ID = re.compile(CHECKPOINT_ID_PATTERN)
_RUN_ID = re.compile(RUN_ID_PATTERN)
_JOB_ID = re.compile(JOB_ID_PATTERN)
_HASH = re.compile(r"^[0-9a-f]{64}$")


def check_job_id(job_id: str) -> str:
    if not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"job id {job_id!r} does not match {JOB_ID_PATTERN} (the spotcr:job tag's rule)")
    return job_id


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"run id {run_id!r} does not match {RUN_ID_PATTERN}")
    return run_id


def check_checkpoint_id(checkpoint_id: str) -> str:
    if not _CHECKPOINT_ID.fullmatch(checkpoint_id):
        raise ValueError(f"checkpoint id {checkpoint_id!r} does not match {CHECKPOINT_ID_PATTERN}")
    return checkpoint_id


def check_manifest_path(path: str) -> str:
    """A file path inside a checkpoint: relative, normalised, never escaping the restore directory."""
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or ".." in pure.parts or str(pure) != path or path == "." or "\x00" in path:
        raise ValueError(f"file path {path!r} must be relative, normalised and stay inside the checkpoint")
    return path


@dataclass(frozen=True)
class OpenFile:
    """A file the job holds open; it must exist at this path with this size for the restore to work."""

    path: str
    size: int


@dataclass(frozen=True)
class CheckpointMeta:
    """What the agent knows about a checkpoint before its images are stored."""

    job_id: str
    checkpoint_id: str
    generation: int
    kind: str  # periodic | final
    parent: str | None = None
    criu_version: str = ""
    kernel: str = ""
    arch: str = ""
    cpu_flags: Sequence[str] = ()
    open_files: Sequence[OpenFile | Mapping[str, Any]] = ()
    gpu: Mapping[str, Any] | None = None  # the job held a GPU: spotcr_agent.gpu.JobGpus.record()

    def __post_init__(self) -> None:
        check_job_id(self.job_id)
        check_checkpoint_id(self.checkpoint_id)
        if self.kind not in KINDS:
            raise ValueError(f"checkpoint kind {self.kind!r} is not one of {KINDS}")
        if self.parent is not None:
            check_checkpoint_id(self.parent)
        object.__setattr__(self, "open_files", tuple(as_open_file(f) for f in self.open_files))
        object.__setattr__(self, "cpu_flags", tuple(self.cpu_flags))


def as_open_file(value: OpenFile | Mapping[str, Any]) -> OpenFile:
    """Accept {path, size} mappings too, as the agent may read them straight from /proc."""
    return value if isinstance(value, OpenFile) else OpenFile(str(value["path"]), int(value["size"]))


@dataclass(frozen=True)
class ChunkRef:
    """One piece of a file: stored content-addressed by hash, or carried in the manifest (tiny files)."""

    hash: str
    size: int
    inline: bytes | None = None  # zstd-compressed bytes, for files too small to be worth a PUT

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hash": self.hash, "size": self.size}
        if self.inline is not None:
            out["inline"] = base64.b64encode(self.inline).decode("ascii")
        return out


@dataclass(frozen=True)
class FileEntry:
    path: str  # images/<name> or workdir/<name>
    size: int
    mode: int
    digest: str  # sha256 over the file's chunk hashes in order: with every chunk verified, it pins the whole file
    chunks: tuple[ChunkRef, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "mode": self.mode,
            "digest": self.digest,
            "chunks": [c.to_dict() for c in self.chunks],
        }


def file_digest(chunks: Sequence[ChunkRef]) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(bytes.fromhex(chunk.hash))
    return h.hexdigest()


@dataclass(frozen=True)
class Manifest:
    job_id: str
    checkpoint_id: str
    generation: int
    kind: str
    parent: str | None
    created_at: str  # ISO 8601, UTC
    criu_version: str
    kernel: str
    arch: str
    cpu_flags: tuple[str, ...]
    open_files: tuple[OpenFile, ...]
    files: tuple[FileEntry, ...]
    compression: str  # e.g. zstd-1
    chunking: Mapping[str, Any] = field(default_factory=dict)
    format: int = FORMAT_VERSION
    hash: str = HASH_ALGORITHM
    since_full: int = 0  # commits since the last one that sent every chunk afresh (0: this one did)
    # GPU model, count and driver (and device memory) when the job held an NVIDIA GPU: a restore needs the same.
    gpu: Mapping[str, Any] | None = None
    run_id: str = ""  # the run of the job that committed it (spotcr:run); empty for a store used without runs

    @property
    def bytes_total(self) -> int:
        return sum(f.size for f in self.files)

    def chunk_hashes(self) -> set[str]:
        """Hashes of the chunks this checkpoint keeps in the store (inline chunks live in the manifest)."""
        return {c.hash for f in self.files for c in f.chunks if c.inline is None}

    def to_json(self) -> bytes:
        doc = {
            "format": self.format,
            "job_id": self.job_id,
            "checkpoint_id": self.checkpoint_id,
            "generation": self.generation,
            "kind": self.kind,
            "parent": self.parent,
            "created_at": self.created_at,
            "criu_version": self.criu_version,
            "kernel": self.kernel,
            "arch": self.arch,
            "cpu_flags": list(self.cpu_flags),
            "open_files": [{"path": f.path, "size": f.size} for f in self.open_files],
            "hash": self.hash,
            "compression": self.compression,
            "chunking": dict(self.chunking),
            "files": [f.to_dict() for f in self.files],
            "since_full": self.since_full,
        }
        if self.gpu is not None:
            doc["gpu"] = dict(self.gpu)
        if self.run_id:
            doc["run_id"] = self.run_id
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, checkpoint_id: str) -> Manifest:
        """Parse a stored manifest; anything malformed is a CorruptCheckpoint naming what is wrong."""
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpoint(checkpoint_id, f"manifest is not valid JSON ({e})") from e
        if not isinstance(doc, dict):
            raise CorruptCheckpoint(checkpoint_id, "manifest is not a JSON object")
        version = doc.get("format")
        if version != FORMAT_VERSION:
            if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
                raise UnsupportedManifest(checkpoint_id, version, FORMAT_VERSION)
            raise CorruptCheckpoint(checkpoint_id, f"manifest format {version!r} is not a known version")
        try:
            manifest = cls(
                format=version,
                job_id=check_job_id(doc["job_id"]),
                checkpoint_id=check_checkpoint_id(doc["checkpoint_id"]),
                generation=int(doc["generation"]),
                kind=str(doc["kind"]),
                parent=doc["parent"],
                created_at=str(doc["created_at"]),
                criu_version=str(doc["criu_version"]),
                kernel=str(doc["kernel"]),
                arch=str(doc["arch"]),
                cpu_flags=tuple(str(f) for f in doc["cpu_flags"]),
                open_files=tuple(OpenFile(str(f["path"]), int(f["size"])) for f in doc["open_files"]),
                hash=str(doc["hash"]),
                compression=str(doc["compression"]),
                chunking=dict(doc["chunking"]),
                files=tuple(_file_from_dict(f) for f in doc["files"]),
                since_full=int(doc.get("since_full", 0)),
                gpu=_gpu_from_dict(doc["gpu"]) if doc.get("gpu") is not None else None,
                run_id=str(doc.get("run_id", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpoint(checkpoint_id, f"manifest is malformed ({type(e).__name__}: {e})") from e
        paths = [f.path for f in manifest.files]
        if len(set(paths)) != len(paths):
            raise CorruptCheckpoint(checkpoint_id, "manifest lists a file path twice")
        if manifest.checkpoint_id != checkpoint_id:
            raise CorruptCheckpoint(checkpoint_id, f"manifest names checkpoint {manifest.checkpoint_id}")
        if manifest.hash != HASH_ALGORITHM:
            raise CorruptCheckpoint(checkpoint_id, f"manifest uses hash {manifest.hash!r}, expected {HASH_ALGORITHM}")
        return manifest


def _gpu_from_dict(doc: Mapping[str, Any]) -> dict[str, Any]:
    gpu = dict(doc)
    if not isinstance(gpu["model"], str) or not isinstance(gpu["driver"], str):
        raise ValueError("gpu model and driver must be text")
    if isinstance(gpu["count"], bool) or not isinstance(gpu["count"], int) or gpu["count"] < 1:
        raise ValueError(f"gpu count {gpu['count']!r} is not a positive whole number")
    return gpu


def _file_from_dict(doc: Mapping[str, Any]) -> FileEntry:
    chunks = tuple(_chunk_from_dict(c) for c in doc["chunks"])
    entry = FileEntry(
        path=check_manifest_path(str(doc["path"])),
        size=int(doc["size"]),
        mode=int(doc["mode"]),
        digest=str(doc["digest"]),
        chunks=chunks,
    )
    if sum(c.size for c in chunks) != entry.size:
        raise ValueError(f"chunks of {entry.path} add up to {sum(c.size for c in chunks)} bytes, not {entry.size}")
    if file_digest(chunks) != entry.digest:
        raise ValueError(f"digest of {entry.path} does not match its chunk list")
    return entry


def _chunk_from_dict(doc: Mapping[str, Any]) -> ChunkRef:
    digest = str(doc["hash"])
    if not _HASH.fullmatch(digest):
        raise ValueError(f"chunk hash {digest!r} is not a sha256 hex digest")
    inline = doc.get("inline")
    size = int(doc["size"])
    if size < 0:
        raise ValueError(f"chunk {digest[:12]} has a negative size")
    return ChunkRef(digest, size, base64.b64decode(inline, validate=True) if inline is not None else None)
