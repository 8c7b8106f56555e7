"""The checkpoint manifest: the one record of what a checkpoint holds, written last to commit it."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import blake3
import xxhash
from spotcr_contracts.commands import CHECKPOINT_ID_PATTERN
from spotcr_contracts.tags import JOB_ID_PATTERN, RUN_ID_PATTERN

from .errors import CorruptCheckpoint, UnsupportedManifest

FORMAT_VERSION = 3  # 3: chunk ids by BLAKE3; 2: chunks live in packs (ChunkRef.pack); 1: each chunk its own object
READABLE_FORMATS = (1, 2, 3)
# A chunk's id: a cryptographic hash of its raw bytes, named by the manifest's `hash`. New checkpoints use BLAKE3,
# 5 GiB/s a core here (AVX-512) against SHA-256's 1.1: on 2 cores SHA-256 alone took as long as CRIU's whole dump
# of the same memory. Checkpoints with SHA-256 ids (formats 1 and 2) are still read and verified by theirs.
CHUNK_HASHES: Mapping[str, Callable[[bytes | memoryview], str]] = {
    "blake3": lambda data: blake3.blake3(data).hexdigest(),
    "sha256": lambda data: hashlib.sha256(data).hexdigest(),
}
HASH_ALGORITHM = "blake3"
chunk_id = CHUNK_HASHES[HASH_ALGORITHM]
KINDS = ("periodic", "final")

_CHECKPOINT_ID = re.compile(CHECKPOINT_ID_PATTERN)
_RUN_ID = re.compile(RUN_ID_PATTERN)
_JOB_ID = re.compile(JOB_ID_PATTERN)
_HASH = re.compile(r"^[0-9a-f]{64}$")
_PACK = re.compile(r"^[0-9a-f]{32}$")
_FAST = re.compile(r"^[0-9a-f]{32}$")


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
    """One piece of a file: its compressed bytes at `offset` in pack object `pack` (`stored` of them), in an object
    of its own named by its hash (pack None: format 1's layout), or carried in the manifest (tiny files)."""

    hash: str
    size: int
    inline: bytes | None = None  # zstd-compressed bytes, for files too small to be worth a PUT
    pack: str | None = None
    offset: int = 0
    stored: int = 0
    fast: str | None = None  # fast_digest of its raw bytes, where the commit computed one

    def to_dict(self, packs: Mapping[str, int]) -> dict[str, Any]:
        """As the manifest holds it; `packs` numbers the manifest's pack ids (its `packs` list)."""
        out: dict[str, Any] = {"hash": self.hash, "size": self.size}
        if self.inline is not None:
            out["inline"] = base64.b64encode(self.inline).decode("ascii")
        if self.pack is not None:
            out |= {"pack": packs[self.pack], "at": self.offset, "len": self.stored}
        if self.fast is not None:
            out["fast"] = self.fast
        return out


@dataclass(frozen=True)
class FileEntry:
    path: str  # images/<name> or workdir/<name>
    size: int
    mode: int
    digest: str  # sha256 over the file's chunk ids in order: with every chunk verified, it pins the whole file
    chunks: tuple[ChunkRef, ...]

    def to_dict(self, packs: Mapping[str, int]) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "mode": self.mode,
            "digest": self.digest,
            "chunks": [c.to_dict(packs) for c in self.chunks],
        }


def fast_digest(data: bytes | memoryview) -> str:
    """A cheap check that a chunk at the same file, offset and length as in the parent checkpoint is unchanged:
    XXH3's 128-bit hash of the chunk (32 hex digits), 10 GiB/s a core here: twice BLAKE3's, nine times SHA-256's.

    Collision risk: a changed chunk passes for unchanged only if its 128-bit hash matches the parent's, about
    2^-128 per changed chunk for a hash of XXH3's quality: a 64 GiB job rewriting 5% between checkpoints (about
    2,600 changed chunks a checkpoint) never meets one. It is not cryptographic: a change crafted to match is
    possible, but a job's memory is not an adversary of its own checkpoint, and the job could corrupt its memory
    directly anyway."""
    return xxhash.xxh3_128_hexdigest(data)


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

    def stored_chunks(self) -> dict[str, ChunkRef]:
        """The chunks this checkpoint keeps in the store, by hash (one place each, should a chunk be in two)."""
        return {c.hash: c for f in self.files for c in f.chunks if c.inline is None}

    def packs(self) -> list[str]:
        """The pack objects holding its chunks, in order of first use."""
        return list(dict.fromkeys(c.pack for f in self.files for c in f.chunks if c.pack is not None))

    def to_json(self) -> bytes:
        packs = {pack: n for n, pack in enumerate(self.packs())}
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
            "files": [f.to_dict(packs) for f in self.files],
            "since_full": self.since_full,
        }
        if packs:
            doc["packs"] = list(packs)
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
        if version not in READABLE_FORMATS or isinstance(version, bool):
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
                files=tuple(_file_from_dict(f, _packs_from(doc)) for f in doc["files"]),
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
        if manifest.hash not in CHUNK_HASHES:
            known = ", ".join(CHUNK_HASHES)
            raise CorruptCheckpoint(checkpoint_id, f"manifest uses hash {manifest.hash!r}, not one of {known}")
        return manifest


def _gpu_from_dict(doc: Mapping[str, Any]) -> dict[str, Any]:
    gpu = dict(doc)
    if not isinstance(gpu["model"], str) or not isinstance(gpu["driver"], str):
        raise ValueError("gpu model and driver must be text")
    if isinstance(gpu["count"], bool) or not isinstance(gpu["count"], int) or gpu["count"] < 1:
        raise ValueError(f"gpu count {gpu['count']!r} is not a positive whole number")
    return gpu


def _packs_from(doc: Mapping[str, Any]) -> list[str]:
    packs = [str(p) for p in doc.get("packs", [])] if doc["format"] >= 2 else []
    for pack in packs:
        if not _PACK.fullmatch(pack):
            raise ValueError(f"pack id {pack!r} is not 32 hex digits")
    return packs


def _file_from_dict(doc: Mapping[str, Any], packs: Sequence[str]) -> FileEntry:
    chunks = tuple(_chunk_from_dict(c, packs) for c in doc["chunks"])
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


def _chunk_from_dict(doc: Mapping[str, Any], packs: Sequence[str]) -> ChunkRef:
    digest = str(doc["hash"])
    if not _HASH.fullmatch(digest):
        raise ValueError(f"chunk id {digest!r} is not 64 hex digits")
    inline = doc.get("inline")
    size = int(doc["size"])
    if size < 0:
        raise ValueError(f"chunk {digest[:12]} has a negative size")
    if inline is not None:
        return ChunkRef(digest, size, base64.b64decode(inline, validate=True))
    fast = str(doc["fast"]) if "fast" in doc else None
    if fast is not None and not _FAST.fullmatch(fast):
        raise ValueError(f"chunk {digest[:12]} has fast digest {fast!r}, not 32 hex digits")
    if "pack" not in doc:
        return ChunkRef(digest, size, fast=fast)
    number, offset, stored = int(doc["pack"]), int(doc["at"]), int(doc["len"])
    if not 0 <= number < len(packs) or offset < 0 or stored < 1:
        raise ValueError(f"chunk {digest[:12]} names pack {number} at {offset} ({stored} bytes): not in this manifest")
    return ChunkRef(digest, size, pack=packs[number], offset=offset, stored=stored, fast=fast)
