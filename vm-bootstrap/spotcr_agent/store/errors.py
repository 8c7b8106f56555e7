"""What can go wrong with the checkpoint store, each naming the checkpoint, chunk, file or path at fault."""

from __future__ import annotations


class StoreError(Exception):
    """Base of every checkpoint store error."""


class StoreUnavailable(StoreError):
    """The store cannot be used at all: a missing mount, an unwritable directory, a missing bucket."""


class CommitAbandoned(StoreError):
    """The committer's keep_going said stop: nothing of this checkpoint was committed."""

    def __init__(self, checkpoint_id: str) -> None:
        super().__init__(f"the commit of checkpoint {checkpoint_id} was abandoned before its manifest")
        self.checkpoint_id = checkpoint_id


class CheckpointNotFound(StoreError):
    def __init__(self, checkpoint_id: str, location: str) -> None:
        super().__init__(f"checkpoint {checkpoint_id} is not committed in {location}")
        self.checkpoint_id = checkpoint_id


class CheckpointExists(StoreError):
    """A manifest with this id is already committed; manifests are never overwritten."""

    def __init__(self, checkpoint_id: str) -> None:
        super().__init__(f"checkpoint {checkpoint_id} is already committed; refusing to overwrite it")
        self.checkpoint_id = checkpoint_id


class CorruptCheckpoint(StoreError):
    def __init__(self, checkpoint_id: str, reason: str) -> None:
        super().__init__(f"checkpoint {checkpoint_id} is corrupt: {reason}")
        self.checkpoint_id = checkpoint_id
        self.reason = reason


class UnsupportedManifest(StoreError):
    def __init__(self, checkpoint_id: str, version: object, supported: int) -> None:
        super().__init__(
            f"checkpoint {checkpoint_id} has manifest format {version!r}; this agent reads format {supported} "
            "(upgrade the agent to restore it)"
        )
        self.checkpoint_id = checkpoint_id
        self.version = version
