"""The deduplicating checkpoint store: content-addressed, compressed chunks plus a manifest written last."""

from .backends import Backend, DirectoryBackend, S3Backend
from .chunking import Chunking
from .errors import (
    CheckpointExists,
    CheckpointNotFound,
    CommitAbandoned,
    CorruptCheckpoint,
    StoreError,
    StoreUnavailable,
    UnsupportedManifest,
)
from .manifest import FORMAT_VERSION, CheckpointMeta, ChunkRef, FileEntry, Manifest, OpenFile
from .store import CheckpointStore, CommitProgress, CommitResult, PruneResult

__all__ = [
    "FORMAT_VERSION",
    "Backend",
    "CheckpointExists",
    "CheckpointMeta",
    "CheckpointNotFound",
    "CheckpointStore",
    "ChunkRef",
    "Chunking",
    "CommitAbandoned",
    "CommitProgress",
    "CommitResult",
    "CorruptCheckpoint",
    "DirectoryBackend",
    "FileEntry",
    "Manifest",
    "OpenFile",
    "PruneResult",
    "S3Backend",
    "StoreError",
    "StoreUnavailable",
    "UnsupportedManifest",
]
