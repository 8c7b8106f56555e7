"""How much of a job's memory changed since its last checkpoint, measured at the notice without freezing the job.

Without dirty-page tracking, the job's own dirty rate comes from a periodic dump that has a parent (deadline.py)
or from a commit in flight (inflight.py). A job with one full periodic dump has neither, so a final dump that
meets the next periodic dump holding the job frozen had to wait for that freeze and the commit's first figures
before it could tell that it cannot fit the notice: seconds of the notice, for a large job, spent learning what
the backup should have been told at once.

So each periodic dump, once CRIU is done and the job runs again, reads SAMPLE_PAGES pages of the job's memory
chosen at random among the writable pages its processes hold that CRIU writes (private, or shared of no file),
and keeps their CRC32s under the checkpoint's id. At the notice the same pages are read again: the changed share
of what the job still holds of them, and the memory it took since, are how much of its memory the checkpoint does
not hold as it is now, within milliseconds and without the dump lock. The final dump's deadline counts that at the
low end of its 95% (Wilson) interval, as a share of the checkpoint's bytes (its work dir counted unchanged), and
as a floor under the dirtying the job's dumps measured: it never decides from a share the job may not have
reached. A page written between the freeze and the sample counts as unchanged, so the share errs low as well.
Only pages a process holds are read (reading another would fault it in, or wait for a lazy restore to bring it);
a process that is gone (or whose PID another one has by now) and a page no longer held count as nothing to send.
A job with GPUs is not sampled: its device memory is not read here.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import math
import os
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import runner, scratch

log = logging.getLogger(__name__)

SAMPLES = "memory-samples.json"
SAMPLE_PAGES = 512  # a share's 95% interval is within 4.4 points of what was seen
TRIES_PER_PAGE = 32  # random addresses tried per sampled page: sparse reservations have few resident pages
LEAST_PAGES = 64  # fewer pages found held: no sample
KEEP = 3  # samples kept, newest last: the committed checkpoint's and those of dumps after it
PAGE = 4096
PRESENT, SWAPPED = 1 << 63, 1 << 62  # /proc/PID/pagemap
Z = 1.96


@dataclass(frozen=True)
class Share:
    """A sample read again: of its `sampled` pages the job still holds `held`, and `changed` of those differ; the
    bytes of the job's memory when it was sampled and now (what CRIU writes: scratch.memory_bytes)."""

    sampled: int
    held: int
    changed: int
    memory_then: int
    memory_now: int

    def least_changed(self) -> float:
        """Bytes of the job's memory now that the checkpoint does not hold as they are, at the low end: the changed
        part of what it still holds of the sampled memory, and what it holds beyond that (memory it took since), each
        at the end of its 95% interval that makes it smaller."""
        kept = self.memory_then * _wilson(self.held, self.sampled, low=True)
        most_kept = self.memory_then * _wilson(self.held, self.sampled, low=False)
        changed = kept * _wilson(self.changed, self.held, low=True) if self.held else 0.0
        return changed + max(0.0, self.memory_now - most_kept)


def _wilson(hits: int, of: int, *, low: bool) -> float:
    """The low (or high) end of the 95% Wilson score interval of hits / of."""
    p = hits / of
    middle = p + Z * Z / (2 * of)
    spread = Z * math.sqrt(p * (1 - p) / of + Z * Z / (4 * of * of))
    return min(1.0, max(0.0, (middle - spread if low else middle + spread) / (1 + Z * Z / of)))


def _regions(pid: int) -> list[tuple[int, int]]:
    """The process's writable mappings whose pages CRIU dumps, (start, end): private ones, and shared ones of no
    file that lives on (anonymous shared memory, memfd, SysV: "(deleted)"); a shared file's pages are the file's."""
    regions = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) > 5 else ""
            if fields[1][1] == "w" and (fields[1][3] == "p" or not path or path.endswith("(deleted)")):
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                regions.append((start, end))
    return regions


class _Process:
    """One process of the job's tree, read through /proc: a page's bytes, if it is resident (or swapped)."""

    def __init__(self, pid: int) -> None:
        self._pagemap = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
        try:
            self._mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        except OSError:
            os.close(self._pagemap)
            raise

    def page(self, address: int) -> bytes | None:
        """Only a page the process holds is read: reading another would fault it in (or wait for a lazy restore)."""
        try:
            entry = int.from_bytes(os.pread(self._pagemap, 8, address // PAGE * 8), "little")
            return os.pread(self._mem, PAGE, address) if entry & (PRESENT | SWAPPED) else None
        except OSError:  # unmapped meanwhile
            return None

    def close(self) -> None:
        os.close(self._pagemap)
        os.close(self._mem)


class _Tree:
    """The processes of a sample, opened as they are first needed; one that is gone (or another by now) is None."""

    def __init__(self, started: dict[int, int | None]) -> None:
        self._started = started
        self._open: dict[int, _Process | None] = {}

    def __enter__(self) -> _Tree:
        return self

    def __exit__(self, *_: object) -> None:
        for process in self._open.values():
            if process is not None:
                process.close()

    def page(self, pid: int, address: int) -> bytes | None:
        if pid not in self._open:
            self._open[pid] = None
            started = self._started.get(pid)
            if started is not None and runner.job_alive(pid, started):
                with contextlib.suppress(OSError):
                    self._open[pid] = _Process(pid)
        process = self._open[pid]
        return process.page(address) if process is not None else None


def take(pid: int, pages: int = SAMPLE_PAGES) -> dict[str, Any]:
    """Up to `pages` pages the job's tree holds, picked at random over the mappings CRIU dumps (so uniformly among
    the pages it holds there): each as [pid, address, CRC32]; with each process's start time and the bytes of the
    job's memory."""
    tree = scratch.job_tree(pid)
    started = {member: runner.process_start_time(member) for member in tree}
    regions = []
    for member in tree:
        with contextlib.suppress(OSError):  # gone meanwhile
            regions += [(member, start, end) for start, end in _regions(member)]
    ends, total = [], 0
    for _, start, end in regions:
        total += end - start
        ends.append(total)
    picked: dict[tuple[int, int], int] = {}
    with _Tree(started) as processes:
        for _ in range(pages * TRIES_PER_PAGE if total else 0):
            if len(picked) == pages:
                break
            at = random.randrange(total)  # noqa: S311 (a sample, not a secret)
            index = bisect.bisect_right(ends, at)
            member, start, end = regions[index]
            address = (start + at - (ends[index] - (end - start))) // PAGE * PAGE
            if (member, address) not in picked and (data := processes.page(member, address)) is not None:
                picked[member, address] = zlib.crc32(data)
    return {
        "pid": pid,
        "started": {str(member): time for member, time in started.items()},
        "memory": scratch.tree_memory(tree),
        "pages": [[member, address, crc] for (member, address), crc in picked.items()],
    }


def read_again(sample: dict[str, Any]) -> tuple[int, int]:
    """Of the sampled pages, how many the job still holds, and how many of those differ now. A page of a process
    that is gone, or unmapped, is not held: what took its place, if anything, is memory taken since."""
    changed = held = 0
    with _Tree({int(member): time for member, time in sample["started"].items()}) as processes:
        for member, address, crc in sample["pages"]:
            data = processes.page(member, address)
            if data is not None:
                held += 1
                changed += zlib.crc32(data) != crc
    return held, changed


def record(state_dir: Path, checkpoint_id: str, pid: int) -> None:
    """Sample the job's memory as of checkpoint `checkpoint_id`, just dumped (the job runs again). Never fails the
    dump: a sample that cannot be taken or kept is only missing at the notice."""
    try:
        sample = take(pid)
        if len(sample["pages"]) < LEAST_PAGES:
            log.info("no memory sample for checkpoint %s: %d pages found", checkpoint_id, len(sample["pages"]))
            return
        kept = [s for s in _read(state_dir) if s.get("checkpoint_id") != checkpoint_id][-(KEEP - 1) :]
        kept.append({"checkpoint_id": checkpoint_id, **sample})
        tmp = state_dir / f".{SAMPLES}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(kept))
        tmp.replace(state_dir / SAMPLES)
    except (OSError, ValueError) as error:
        log.warning("no memory sample for checkpoint %s: %s", checkpoint_id, error)


def changed_since(state_dir: Path, checkpoint_id: str) -> Share | None:
    """How much of the job's memory changed since checkpoint `checkpoint_id` was dumped here; None without its
    sample, once the job is not the one sampled (restarted or restored), or when the sample cannot be read: a
    final dump decides without it then, never fails for it."""
    for sample in _read(state_dir):
        if sample.get("checkpoint_id") == checkpoint_id:
            try:
                pid = int(sample["pid"])
                started = sample["started"].get(str(pid))
                if started is None or not runner.job_alive(pid, started):
                    return None
                held, changed = read_again(sample)
                now = scratch.tree_memory(scratch.job_tree(pid))
                return Share(len(sample["pages"]), held, changed, int(sample["memory"]), now)
            except (KeyError, TypeError, ValueError, OSError) as error:
                log.warning("the memory sample of checkpoint %s cannot be read: %s", checkpoint_id, error)
                return None
    return None


def _read(state_dir: Path) -> list[dict[str, Any]]:
    try:
        samples = json.loads((state_dir / SAMPLES).read_text())
    except (OSError, ValueError):
        return []
    return [s for s in samples if isinstance(s, dict)] if isinstance(samples, list) else []
