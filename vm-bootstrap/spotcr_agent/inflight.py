"""A periodic dump's commit in flight, as a final dump sees it.

A periodic dump commits under the dump lock once its job runs again, and a final dump waits for that lock. A commit
that cannot end before EC2 reclaims the VM made the final dump wait for nothing: the VM went with neither committed,
and the backup restored the checkpoint before, at the end of the notice. So:
- the periodic commit records its progress here every store.PROGRESS_S (`record`), and stops before its manifest
  once asked to (`abandoned`: store.CommitAbandoned);
- the final dump, while it waits for the lock, predicts the commit's end from that progress at the commit's own
  rate so far (`Commit.ends_at`), and asks it to stop when that falls after the reclaim (`abandon`); it then takes
  the lock at once, and its own deadline decides (deadline.cannot_fit): the dump, or the job stopped for the backup
  to restore the newest committed checkpoint now;
- what the stopped commit measured of how much of the job's memory changed since its parent counts for that
  decision (`Commit.dirty_per_s`): the job's own figure, where one full dump alone has none (as does the job's
  memory sampled at its parent's dump and read again at the notice: memsample.py);
- a periodic dump names itself here for as long as it holds the dump lock (`holding`: from before its freeze to its
  commit's end). When neither a final dump begun at the notice nor that periodic dump, from when it took the lock,
  can be durable before the reclaim even at the job's best measured rates, the final dump does not wait for the
  lock at all (checkpoint.Checkpointer._hopeless): the job is stopped at once, and the backup restores the newest
  committed checkpoint as soon as it is up rather than after the periodic dump's freeze and first figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from . import deadline

PROGRESS = "periodic-commit.json"
ABANDON = "abandon-periodic"
HOLDING = "periodic-dump.json"
FRESH_S = 2.0  # a progress older than this says nothing of the commit now (it may be blocked on the store)
# Bytes a commit cuts before its rate and its changed share say anything: its first files are CRIU's small images,
# which change whole every time, and its first second pays for listing the parent's chunks.
MEASURED_BYTES = 64 << 20


@dataclass(frozen=True)
class Commit:
    """A periodic dump's commit at one moment: raw bytes cut into chunks, of all, and of those changed (counted
    as they are hashed, a little behind)."""

    checkpoint_id: str
    parent: str | None
    first_at: float  # unix time of the commit's first figures
    first_done: int
    at: float  # unix time of these figures
    done: int
    total: int
    changed: int

    def ends_at(self) -> float | None:
        """When the commit ends at its rate since its first figures; None before MEASURED_BYTES of it."""
        cut = self.done - self.first_done
        if cut < MEASURED_BYTES or self.at <= self.first_at:
            return None
        return self.at + (self.at - self.first_at) * max(0, self.total - self.done) / cut

    def dirty_per_s(self) -> float | None:
        """Share of the job's bytes changed per second between the parent's freeze and this one's, in what the
        commit has hashed so far; None without a parent or before MEASURED_BYTES."""
        since = deadline.since_parent(self.checkpoint_id, self.parent)
        if self.done < MEASURED_BYTES or since <= 0:
            return None
        return self.changed / self.done / since


def record(state_dir: Path, commit: Commit) -> None:
    _put(state_dir, PROGRESS, commit)


def _put(state_dir: Path, name: str, figures: Commit | Holder) -> None:
    """Replaces the file whole: a reader never sees half of it."""
    tmp = state_dir / f".{name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(asdict(figures)))
    tmp.replace(state_dir / name)


def read(state_dir: Path) -> Commit | None:
    try:
        return Commit(**json.loads((state_dir / PROGRESS).read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def in_flight(state_dir: Path) -> Commit | None:
    """The commit's figures if they are fresh (FRESH_S)."""
    commit = read(state_dir)
    return commit if commit is not None and time.time() - commit.at < FRESH_S else None


def abandon(state_dir: Path, checkpoint_id: str) -> None:
    (state_dir / ABANDON).write_text(checkpoint_id)


def abandoned(state_dir: Path, checkpoint_id: str) -> bool:
    try:
        return (state_dir / ABANDON).read_text() == checkpoint_id
    except FileNotFoundError:
        return False


@dataclass(frozen=True)
class Holder:
    """The periodic dump that holds the dump lock."""

    checkpoint_id: str
    since: float  # unix time it took the lock, before its freeze


@contextlib.contextmanager
def holding(state_dir: Path, checkpoint_id: str) -> Iterator[None]:
    """Names the periodic dump `checkpoint_id` as the dump lock's holder while the block runs (under the lock)."""
    _put(state_dir, HOLDING, Holder(checkpoint_id, time.time()))
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            (state_dir / HOLDING).unlink()


def holder(state_dir: Path) -> Holder | None:
    """The periodic dump named as the dump lock's holder; one that died holding it may still be named (its lock
    is free then: a final dump that does not wait for it decides what it would have decided on taking the lock)."""
    try:
        return Holder(**json.loads((state_dir / HOLDING).read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None
