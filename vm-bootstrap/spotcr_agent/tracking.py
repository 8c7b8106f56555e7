"""Memory tracking: the local chain of CRIU image directories that incremental dumps build on.

Where the kernel tracks dirty memory (soft-dirty bits; `criu check --feature mem_dirty_track`), a periodic
checkpoint is a pre-dump (the job is frozen only while its memory map is read; its pages are drained after it
thaws) followed at once by a `dump --leave-running --track-mem --prev-images-dir` on top of it, whose freeze
covers only the pages dirtied in between. The final dump is `dump --track-mem --prev-images-dir` on top of the
newest periodic checkpoint's dump, so its time and bytes follow what changed since then, not the job's size.

CRIU reads an incremental dump's pages through the `parent` link of each image directory, so a checkpoint in
the store holds its whole chain: its own images under images/, its parent's under images/parent/, theirs under
images/parent/parent/ and so on. A fetched checkpoint is then a complete image set (real directories named
`parent`, which CRIU follows as it follows its symlinks), and every committed checkpoint is restorable on its
own. The store takes the files a checkpoint shares with its parent from the parent's manifest without reading
them again (`inherited`), so a commit reads only what CRIU just wrote.

The chain lives on local scratch (CHAIN_DIR, its record CHAIN_FILE) and holds only for the process and the
checkpoint it was made for: a new job process (a restore), another newest checkpoint, or any failure after a
pre-dump started (which resets the kernel's dirty bits, so the chain no longer covers every change) discards it,
and the next periodic checkpoint starts a fresh one. After MAX_CHAIN_DIRS directories it starts afresh too, so
restore never walks a long chain and the store never keeps pages overwritten long ago.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

CHAIN_DIR = "chain"  # under the agent's scratch directory
CHAIN_FILE = "chain.json"
MAX_CHAIN_DIRS = 8  # image directories in one chain (a periodic checkpoint adds two: pre-dump, dump)
IMAGES = "images/"
PARENT = "parent/"


def images_prefix(depth: int) -> str:
    """Where a chain directory `depth` links below a checkpoint's own images sits in its manifest."""
    return IMAGES + PARENT * depth


@dataclass(frozen=True)
class Chain:
    """The job's tracked image directories on local scratch, oldest first. The newest is the top of the committed
    checkpoint `checkpoint`; each links to the one before it (`parent`)."""

    root: Path
    pid: int
    start_time: int
    checkpoint: str
    dirs: tuple[str, ...]

    @classmethod
    def load(cls, scratch_dir: Path) -> Chain | None:
        root = scratch_dir / CHAIN_DIR
        try:
            record = json.loads((root / CHAIN_FILE).read_text())
            return cls(root, int(record["pid"]), int(record["start_time"]), record["checkpoint"], tuple(record["dirs"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self) -> None:
        record = {k: v for k, v in asdict(self).items() if k != "root"}
        tmp = self.root / f"{CHAIN_FILE}.tmp"
        tmp.write_text(json.dumps(record))
        tmp.rename(self.root / CHAIN_FILE)

    def paths(self) -> list[Path]:
        return [self.root / name for name in self.dirs]

    def top(self) -> Path:
        return self.root / self.dirs[-1]

    def problem(self, pid: int, start_time: int, parent: str | None) -> str | None:
        """Why an incremental dump of this job cannot build on this chain now; None when it can."""
        if pid != self.pid or start_time != self.start_time:
            return "the job's process is not the one the chain was dumped from"
        if parent != self.checkpoint:
            return f"the chain's top is checkpoint {self.checkpoint}, the job's newest is {parent}"
        missing = [path.name for path in self.paths() if not path.is_dir()]
        if missing:
            return f"the chain's image directories {', '.join(missing)} are missing"
        return None

    def files(self, shift: int) -> dict[str, tuple[str, Path]]:
        """The chain's files as a checkpoint `shift` levels above its top names them, each with its name in the
        chain's own checkpoint (where the top was at depth 0) and its local copy: the store's `inherited`."""
        files: dict[str, tuple[str, Path]] = {}
        for depth, path in enumerate(reversed(self.paths())):
            for name, source in dir_files(path).items():
                files[images_prefix(depth + shift) + name] = (images_prefix(depth) + name, source)
        return files


def dir_files(path: Path) -> dict[str, Path]:
    """The regular files of one image directory (CRIU writes no subdirectories; `parent` is a link)."""
    return {entry.name: Path(entry.path) for entry in os.scandir(path) if entry.is_file(follow_symlinks=False)}


def link_target(images_dir: Path, parent_dir: Path) -> Path:
    """--prev-images-dir for CRIU: relative to the images directory, as CRIU writes it into the `parent` link."""
    return Path(os.path.relpath(parent_dir, images_dir))


def discard(scratch_dir: Path, keep: tuple[str, ...] = ()) -> None:
    """Remove the chain (its record and image directories); with `keep`, only the image directories not in it."""
    root = scratch_dir / CHAIN_DIR
    if not keep:
        (root / CHAIN_FILE).unlink(missing_ok=True)
    if root.is_dir():
        for entry in os.scandir(root):
            if entry.name not in keep and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
