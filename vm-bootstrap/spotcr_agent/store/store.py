"""The deduplicating checkpoint store: chunk, hash, compress and ship images; commit with a manifest, last.

Layout under the bucket or mount root (<run> is `jobs/<job_id>/runs/<run_id>`, or `jobs/<job_id>` without a run):
  <run>/chunks/packs/<pack id>                zstd-compressed chunks one after another (32 random hex digits)
  <run>/chunks/<h[:2]>/<h>                    one zstd-compressed chunk whose raw bytes hash to h (sha256): manifest
                                              format 1's layout, still read; nothing writes it any more
  <run>/checkpoints/<checkpoint_id>.json      manifest; a checkpoint without one does not exist
  <run>/commits/<checkpoint_id>               a commit in flight (removed once its manifest is written)
  <run>/sweeps/<uuid>                         a prune in flight (removed when it is done)

Packs: a commit appends each new compressed chunk to the pack being filled and writes the pack once the next chunk
would take it past PACK_SIZE bytes, up to PACKS_IN_FLIGHT packs at once, the last one when the commit's chunks are
all in. The index is the manifest: each chunk names its pack, offset and stored length (ChunkRef), so a restore and
the next commit read nothing but the manifest and one listing (no per-pack index object to write, read or lose).
A pack is never rewritten; a pack id is random, so a retried commit never overwrites a pack a committed manifest
uses. A restore reads the chunks it needs by ranged GETs of adjacent chunks (FETCH_RANGE at most), never a pack's
dead bytes. A pack is "held" while its object exists, as a format-1 chunk is while its object does.

One run never sees another's checkpoints: a job name reused after COMPLETED or FAILED is a new run (a new
spotcr:run), whose listing, restore walk, parents and prune cover only its own prefix; a manifest that names
another run than the store's is corrupt.

Garbage collection never loses a committed checkpoint. The invariant: prune deletes a pack (or a format-1 chunk)
only if no committed manifest it read references any chunk in it AND no commit was in flight when it last
looked. A commit writes its `commits/` marker before it decides anything about chunks, then waits while a
`sweeps/` marker exists; prune writes its `sweeps/` marker, then looks for `commits/` markers right before
deleting and gives up if it finds one. With strongly consistent listings (S3, a file system) one of the two
always sees the other: either prune sees the commit and deletes nothing, or the commit's marker came after
prune's look, hence after prune's marker, and the commit waits until prune is done, then relies only on chunks
that still exist. A pruner that died (its VM terminated) leaves its marker: a live pruner never deletes later
than SWEEP_LEASE_S / 2 after it started (its own monotonic clock), so a commit treats a sweep marker older than
SWEEP_LEASE_S than its own marker as dead and removes it. Both ages are the store's own timestamps, never two
VMs' clocks compared.

Packs are not repacked: a pack stays whole while any kept checkpoint uses one of its chunks. What bounds the dead
bytes is `full_every`: such a checkpoint writes every chunk into new packs, and the ones after it use those, so
within `full_every` periodic checkpoints plus the number kept every older pack is unreferenced and deleted whole,
without the reads, writes and extra crash window of rewriting live chunks elsewhere.

A shared chunk is not a single point of failure: a commit re-sends every chunk of its parent that the store no
longer holds (whose pack is gone), instead of trusting the parent's manifest; and every `full_every`-th periodic
checkpoint sends every chunk afresh into new packs, so a damaged shared chunk stops reaching newer checkpoints
there (the older ones keep pointing at the damaged pack: a restore walks back no further than the fresh one).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import resource
import stat
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import zstandard
from spotcr_contracts.commands import checkpoint_order
from spotcr_contracts.layout import job_prefix, run_prefix

from .backends import Backend, DirectoryBackend, ObjectNotFound, S3Backend
from .chunking import PAGE, Chunker, Chunking
from .errors import CheckpointNotFound, CommitAbandoned, CorruptCheckpoint, StoreError, UnsupportedManifest
from .manifest import (
    CHUNK_HASHES,
    HASH_ALGORITHM,
    CheckpointMeta,
    ChunkRef,
    FileEntry,
    Manifest,
    as_open_file,
    check_checkpoint_id,
    check_job_id,
    check_manifest_path,
    check_run_id,
    chunk_id,
    fast_digest,
    file_digest,
)

INLINE_MAX = 64 * 1024  # files up to this size travel inside the manifest instead of costing a PUT each
READ_BLOCK = 4 * 1024 * 1024
PROBE = 64 * 1024  # a chunk's head compressed first to see whether the chunk compresses at all
PROBE_GAIN = 0.9  # the probe must shrink to this share of its size, or the chunk is stored as raw zstd blocks
FAST_LEVEL = -1  # zstd's fast level for such chunks: raw blocks at several GiB/s, yet long runs of zeros still shrink
# and for every chunk of a final dump, which races the notice: on CRIU's images of a half-random job 2.4x the
# throughput of level 1 at the same ratio, on a Python heap's 22% more at 4.53x against 4.71x
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # populate: one fault-in per mapping, not per page
POLL_SECONDS = 0.02  # how often a file CRIU is still writing is checked for new bytes
GRACE_SECONDS = 3600.0  # prune never removes what a commit still running (started within this) may use
SWEEP_LEASE_S = 60.0  # a prune deletes nothing after half of this; a sweep marker this much older is dead
SWEEP_POLL_S = 0.5
DELETE_BATCH = 500
PACK_SIZE = 32 * 1024 * 1024  # a pack holds at most this much: about 32 PUTs per GiB of new data (S3
# charges per request; one chunk per object was about 800), each a single PUT, and 4 in flight keep 5 Gbit/s busy
PACKS_IN_FLIGHT = 4  # packs being written at once: a commit holds at most 5 x PACK_SIZE of packs in memory
FETCH_RANGE = 8 * 1024 * 1024  # a restore's ranged GETs of adjacent chunks stop at this size: parallel parts
PACKS = "chunks/packs/"  # under chunks/: what a later run may prune (store_access.PRUNABLE) covers packs too
FULL_EVERY = 10  # every 10th periodic checkpoint sends all its chunks again (final dumps always deduplicate)
PROGRESS_S = 0.25  # how often a commit with keep_going reports its progress and asks whether to go on


@dataclass(frozen=True)
class CommitResult:
    checkpoint_id: str
    manifest: Manifest
    bytes_total: int  # bytes of the files the checkpoint describes
    bytes_uploaded: int  # bytes actually sent to the store (compressed new chunks plus the manifest)
    chunks_total: int
    chunks_uploaded: int
    seconds: float
    bytes_new: int = 0  # raw bytes of the chunks sent
    bytes_changed: int = 0  # raw bytes of the chunks the parent did not hold (what changed since it)
    read_seconds: float = 0.0  # reading and chunking the files (one thread)
    hash_seconds: float = 0.0  # busy seconds summed over the store's threads, as are the next two
    compress_seconds: float = 0.0
    upload_seconds: float = 0.0
    objects_uploaded: int = 0  # pack objects written (requests, the manifest and markers aside)
    chunks_unchanged: int = 0  # chunks found to be the parent's by their place and fast digest, not hashed


@dataclass(frozen=True)
class CommitProgress:
    """How far a commit of complete files is: raw bytes cut into chunks, of all the files hold, and of those the
    bytes of chunks hashed so far that the parent checkpoint did not hold."""

    done: int
    total: int
    changed: int


@dataclass(frozen=True)
class PruneResult:
    kept: list[str]
    deleted_checkpoints: list[str]
    deleted_chunks: int
    bytes_freed: int


def cpus() -> int:
    """The CPUs this process may run on. A full 2 GiB final dump into a directory store on 2 of them took 3.7-3.9 s
    and 4.7-5.2 CPU seconds with 2 hashing threads, 4.3-4.4 s and 5.9-6.1 with 8 (three runs each, alternating)."""
    return len(os.sched_getaffinity(0))


def other_runs(backend: Backend, job_id: str, run_id: str) -> list[str]:
    """The runs of this job name, other than `run_id`, that keep anything in this store."""
    prefix = f"{job_prefix(job_id)}runs/"
    found = {obj.key.removeprefix(prefix).split("/", 1)[0] for obj in backend.scan(prefix)}
    runs = []
    for candidate in sorted(found - {run_id}):
        with contextlib.suppress(ValueError):
            runs.append(check_run_id(candidate))
    return runs


class CheckpointStore:
    """One job's checkpoints in one store (S3 bucket or mounted file system).

    A commit hashes and compresses its chunks on one thread per CPU this process may use (cpus()): that work is C
    code that keeps a thread busy, so more threads than CPUs only take turns; its pack writes have their own
    threads. `workers` is how many chunks a restore fetches at once: requests that mostly wait."""

    def __init__(
        self,
        backend: Backend,
        job_id: str,
        *,
        workers: int = 16,
        compression_level: int = 1,
        chunking: Chunking | None = None,
        full_every: int = FULL_EVERY,
        run_id: str = "",
        pack_size: int = PACK_SIZE,
        part: str = "",
    ) -> None:
        self.backend = backend
        self.full_every = full_every
        self.pack_size = pack_size
        self.job_id = check_job_id(job_id)
        self.run_id = check_run_id(run_id) if run_id else ""
        self.workers = workers
        self.compression_level = compression_level
        self.chunking = chunking or Chunking()
        # A node of a job over several VMs keeps its own checkpoints (its parts of the job's) under a part of the run
        # of its own, so that two nodes' dumps never meet in a store they share.
        self._prefix = run_prefix(job_id, run_id) + (f"{part}/" if part else "")
        self.sleep: Callable[[float], None] = time.sleep  # tests force interleavings through it
        self.sweep_lease_s = SWEEP_LEASE_S

    @classmethod
    def for_s3(
        cls,
        bucket: str,
        job_id: str,
        *,
        region: str | None = None,
        workers: int = 16,
        compression_level: int = 1,
        chunking: Chunking | None = None,
        session: Any = None,
        run_id: str = "",
        part: str = "",
    ) -> CheckpointStore:
        """A store in an S3 bucket; the client honours AWS_ENDPOINT_URL and the usual AWS environment, and uses
        `session` (a boto3 session, e.g. the job's vended store credentials) when given."""
        backend = S3Backend(
            bucket, max_connections=workers + 4, region=region or None, session=session, scope=job_prefix(job_id)
        )
        return cls(
            backend,
            job_id,
            workers=workers,
            compression_level=compression_level,
            chunking=chunking,
            run_id=run_id,
            part=part,
        )

    @classmethod
    def for_directory(
        cls,
        root: Path,
        job_id: str,
        *,
        workers: int = 8,
        compression_level: int = 1,
        chunking: Chunking | None = None,
        run_id: str = "",
        part: str = "",
    ) -> CheckpointStore:
        """A store on a mounted file system (EBS, EFS, FSx for Lustre) at root."""
        backend = DirectoryBackend(Path(root))
        return cls(
            backend,
            job_id,
            workers=workers,
            compression_level=compression_level,
            chunking=chunking,
            run_id=run_id,
            part=part,
        )

    @property
    def location(self) -> str:
        return self.backend.describe(self._prefix)

    def commit(
        self,
        image_dir: Path,
        meta: CheckpointMeta,
        extra_files: Mapping[str, Path] | None = None,
        still_writing: Callable[[], bool] | None = None,
        inherited: Mapping[str, tuple[str, Path]] | None = None,
        *,
        keep_going: Callable[[CommitProgress], bool] | None = None,
    ) -> CommitResult:
        """Store every regular file under image_dir (as images/<name>) and extra_files, then commit.

        With still_writing, files are read as CRIU writes them, until it returns False; then they are finished.
        keep_going (for files already complete) is told the commit's progress every PROGRESS_S; once it answers
        False the commit stops before its manifest and raises CommitAbandoned.
        inherited: files known to hold the same bytes as a file of the parent checkpoint (meta.parent), by name
        here -> (name there, local copy); each is described by the parent's entry without being read, unless the
        parent lacks it, a chunk of it is no longer in the store, or this commit sends every chunk afresh: then
        its local copy is stored like an extra file.
        """
        started = time.monotonic()
        if meta.job_id != self.job_id:
            raise ValueError(f"checkpoint {meta.checkpoint_id} is for job {meta.job_id}, this store is {self.job_id}")
        image_dir = Path(image_dir)
        if not image_dir.is_dir():
            raise StoreError(f"image directory {image_dir} does not exist")
        self.backend.check()
        _allow_many_open_files()
        marker = self._commit_marker(meta.checkpoint_id)
        self.backend.put(marker, b"")
        try:
            self._wait_for_sweeps(marker)
            return self._commit(
                image_dir, meta, extra_files, still_writing, started, inherited=inherited or {}, keep_going=keep_going
            )
        finally:
            self.backend.delete([marker])

    def _commit(
        self,
        image_dir: Path,
        meta: CheckpointMeta,
        extra_files: Mapping[str, Path] | None,
        still_writing: Callable[[], bool] | None,
        started: float,
        *,
        inherited: Mapping[str, tuple[str, Path]],
        keep_going: Callable[[CommitProgress], bool] | None = None,
    ) -> CommitResult:
        known, in_parent, parent_since_full, parent_at = self._known_chunks(meta.parent)
        since_full = parent_since_full + 1 if known else 0
        if meta.kind == "periodic" and since_full >= self.full_every:
            known, since_full, parent_at = {}, 0, {}  # a fresh full checkpoint: every chunk is written again
        reused = self._inherit(meta.parent, inherited, known)
        unread = {name: source for name, (_, source) in inherited.items() if name not in reused}
        tails: dict[str, _FileTail] = {}
        level = FAST_LEVEL if meta.kind == "final" else self.compression_level
        packer = _Packer(self.backend, self._prefix, self.pack_size)
        uploader = _Uploader(
            packer,
            known,
            cpus(),
            level,
            in_parent=in_parent,
            parent_at=parent_at,
            record_fast=meta.kind != "final",
            watch=_watch(meta.checkpoint_id, image_dir, extra_files, unread, keep_going) if keep_going else None,
        )
        try:
            with uploader:
                if still_writing is not None:
                    while still_writing():
                        if not self._pump_images(image_dir, tails, uploader):
                            time.sleep(POLL_SECONDS)
                self._pump_images(image_dir, tails, uploader)
                for name, source in sorted([*(extra_files or {}).items(), *unread.items()]):
                    if name in tails:
                        raise ValueError(f"extra file {name} would replace an image file of the same name")
                    tail = _FileTail(check_manifest_path(name), Path(source), self.chunking)
                    tails[name] = tail
                    tail.pump(uploader)
                for tail in tails.values():
                    tail.finish(uploader)
            entries = [*(tail.entry(uploader.locate) for tail in tails.values()), *reused.values()]
            files = tuple(sorted(entries, key=lambda f: f.path))
        finally:
            for tail in tails.values():
                tail.close()
        manifest = Manifest(
            job_id=meta.job_id,
            checkpoint_id=meta.checkpoint_id,
            generation=meta.generation,
            kind=meta.kind,
            parent=meta.parent,
            created_at=datetime.now(UTC).isoformat(timespec="milliseconds"),
            criu_version=meta.criu_version,
            kernel=meta.kernel,
            arch=meta.arch,
            cpu_flags=tuple(meta.cpu_flags),
            open_files=tuple(as_open_file(f) for f in meta.open_files),
            files=files,
            compression=f"zstd-{level}",
            chunking=self.chunking.describe(),
            since_full=since_full,
            gpu=meta.gpu,
            run_id=self.run_id,
        )
        document = manifest.to_json()
        self.backend.flush()
        self.backend.put_new(self._manifest_key(meta.checkpoint_id), document)
        return CommitResult(
            checkpoint_id=meta.checkpoint_id,
            manifest=manifest,
            bytes_total=manifest.bytes_total,
            bytes_uploaded=uploader.bytes_uploaded + len(document),
            chunks_total=sum(len(f.chunks) for f in files),
            chunks_uploaded=uploader.chunks_uploaded,
            seconds=time.monotonic() - started,
            bytes_new=uploader.bytes_new,
            bytes_changed=uploader.bytes_changed,
            read_seconds=uploader.read_s,
            hash_seconds=uploader.hash_s,
            compress_seconds=uploader.compress_s,
            upload_seconds=packer.upload_s,
            objects_uploaded=packer.written,
            chunks_unchanged=uploader.unchanged_chunks,
        )

    def _inherit(
        self, parent: str | None, inherited: Mapping[str, tuple[str, Path]], known: Mapping[str, ChunkRef]
    ) -> dict[str, FileEntry]:
        """The entries this commit takes from its parent's manifest (see commit's `inherited`), by their name here."""
        if not inherited or not known or parent is None:
            return {}
        try:
            entries = {entry.path: entry for entry in self.load(parent).files}
        except (CorruptCheckpoint, UnsupportedManifest, CheckpointNotFound):
            return {}
        reused = {}
        for name, (there, source) in inherited.items():
            entry = entries.get(there)
            if entry is None:
                continue
            try:
                size = os.stat(source).st_size
            except OSError:
                continue
            if size == entry.size and all(c.inline is not None or c.hash in known for c in entry.chunks):
                reused[check_manifest_path(name)] = FileEntry(name, entry.size, entry.mode, entry.digest, entry.chunks)
        return reused

    def check(self) -> None:
        """Raise StoreUnavailable, naming the bucket or path, unless checkpoints can be written now."""
        self.backend.check()

    def checkpoints(self) -> list[Manifest]:
        """Committed checkpoints, newest first."""
        return [self.load(checkpoint_id) for checkpoint_id in self.checkpoint_ids()]

    def load(self, checkpoint_id: str) -> Manifest:
        check_checkpoint_id(checkpoint_id)
        try:
            raw = self.backend.get(self._manifest_key(checkpoint_id))
        except ObjectNotFound:
            raise CheckpointNotFound(checkpoint_id, self.location) from None
        manifest = Manifest.from_json(raw, checkpoint_id)
        if manifest.job_id != self.job_id:
            raise CorruptCheckpoint(checkpoint_id, f"manifest is for job {manifest.job_id}, stored under {self.job_id}")
        if manifest.run_id != self.run_id:
            raise CorruptCheckpoint(
                checkpoint_id, f"manifest is for run {manifest.run_id or 'none'}, stored under {self.run_id or 'none'}"
            )
        return manifest

    def fetch(self, checkpoint_id: str, dest_dir: Path, later: Collection[str] = ()) -> Manifest:
        """Download and verify a checkpoint into dest_dir (images/..., workdir/...); return its manifest.

        later: files (by manifest path) created at their size but left unwritten: a lazy restore reads their chunks
        as it needs them (read_chunks)."""
        manifest = self.load(checkpoint_id)
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        fds: dict[str, int] = {}
        spots: dict[str, list[tuple[int, int, str]]] = defaultdict(list)  # hash -> (fd, offset, path)
        stored = manifest.stored_chunks()
        try:
            for entry in manifest.files:
                target = dest_dir / entry.path
                target.parent.mkdir(parents=True, exist_ok=True)
                fd = fds[entry.path] = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.ftruncate(fd, entry.size)
                if entry.path in later:
                    continue
                offset = 0
                for chunk in entry.chunks:
                    if chunk.inline is not None:
                        data = _verified(manifest, chunk, chunk.inline, entry.path)
                        os.pwrite(fd, data, offset)
                    else:
                        spots[chunk.hash].append((fd, offset, entry.path))
                    offset += chunk.size
            self._download(manifest, {h: c for h, c in stored.items() if h in spots}, spots)
            for entry in manifest.files:
                os.fchmod(fds[entry.path], entry.mode & 0o7777)
        except BaseException:
            for path in fds:
                with contextlib.suppress(OSError):
                    (dest_dir / path).unlink()
            raise
        finally:
            for fd in fds.values():
                os.close(fd)
        return manifest

    def prune(
        self, keep: int, grace_seconds: float = GRACE_SECONDS, commit_timeout_s: float = GRACE_SECONDS
    ) -> PruneResult:
        """Keep the newest `keep` checkpoints; delete older ones and the chunks no remaining checkpoint uses.

        Safe against concurrent commits by the marker protocol in the module docstring. A restore may still be
        reading an older manifest, so a manifest stays until its successor is grace_seconds old, a chunk until
        it is. A commit marker older than commit_timeout_s is a commit that died (killed mid-upload): ignored.
        """
        if keep < 1:
            raise ValueError("prune keeps at least the newest checkpoint")
        started = time.monotonic()
        sweep = f"{self._prefix}sweeps/{uuid.uuid4().hex}"
        self.backend.put(sweep, b"")
        try:
            return self._sweep(keep, grace_seconds, commit_timeout_s, started)
        finally:
            self.backend.delete([sweep])

    def _sweep(self, keep: int, grace_seconds: float, commit_timeout_s: float, started: float) -> PruneResult:
        now = time.time()
        ids = self.checkpoint_ids()
        kept, doomed = list(ids[:keep]), []
        for newer, checkpoint_id in zip(ids[keep - 1 :], ids[keep:], strict=False):
            if now - _id_seconds(newer) >= grace_seconds:
                doomed.append(checkpoint_id)
            else:
                kept.append(checkpoint_id)
        referenced: set[str] = set()  # names of packs and format-1 chunks
        for checkpoint_id in kept:
            referenced |= {c.pack or c.hash for c in self.load(checkpoint_id).stored_chunks().values()}
        garbage, freed = [], 0
        for obj in self.backend.scan(self._prefix + "chunks/"):
            name = obj.key.rsplit("/", 1)[-1]
            if name not in referenced and now - obj.modified >= grace_seconds:
                garbage.append(obj.key)
                freed += obj.size
        if not self._delete_unless_committing(
            [self._manifest_key(c) for c in doomed] + garbage, commit_timeout_s, started
        ):
            return PruneResult(kept=ids, deleted_checkpoints=[], deleted_chunks=0, bytes_freed=0)
        return PruneResult(kept=kept, deleted_checkpoints=doomed, deleted_chunks=len(garbage), bytes_freed=freed)

    def delete_run(self, commit_timeout_s: float = GRACE_SECONDS) -> PruneResult:
        """Delete every checkpoint of this run and its chunks (the run's result/ stays): for a run that ended and
        whose name a new run now uses, so nothing will restore it again. Manifests go first, so a delete cut short
        leaves only whole checkpoints (or none). Safe against a late commit of that run (a zombie VM's) by prune's
        marker protocol: nothing is deleted while one is in flight, and one that starts after the last look waits
        for this sweep, then re-sends the chunks it finds gone."""
        started = time.monotonic()
        sweep = f"{self._prefix}sweeps/{uuid.uuid4().hex}"
        self.backend.put(sweep, b"")
        try:
            ids = self.checkpoint_ids()
            chunks = list(self.backend.scan(self._prefix + "chunks/"))
            keys = [self._manifest_key(c) for c in ids] + [c.key for c in chunks]
            if not self._delete_unless_committing(keys, commit_timeout_s, started):
                return PruneResult(kept=ids, deleted_checkpoints=[], deleted_chunks=0, bytes_freed=0)
            return PruneResult([], ids, len(chunks), sum(c.size for c in chunks))
        finally:
            self.backend.delete([sweep])

    def _delete_unless_committing(self, keys: list[str], commit_timeout_s: float, started: float) -> bool:
        """Delete keys (in order), with dead commits' markers, unless a live commit is in flight (False)."""
        # The last look before deleting: a commit in flight may rely on any of these chunks.
        commits = list(self.backend.scan(self._prefix + "commits/"))
        dead = [c.key for c in commits if time.time() - c.modified >= commit_timeout_s]
        if len(dead) < len(commits):
            return False
        keys = dead + keys
        for start in range(0, len(keys), DELETE_BATCH):
            if time.monotonic() - started > self.sweep_lease_s / 2:
                raise StoreError("prune ran out of its time; a waiting commit may go on, so it stops deleting")
            self.backend.delete(keys[start : start + DELETE_BATCH])
        return True

    def _wait_for_sweeps(self, marker: str) -> None:
        """Hold a commit while a live prune is in flight (its marker exists); remove a dead pruner's marker."""
        deadline = time.monotonic() + self.sweep_lease_s
        while sweeps := list(self.backend.scan(self._prefix + "sweeps/")):
            mine = next((c.modified for c in self.backend.scan(self._prefix + "commits/") if c.key == marker), None)
            dead = [s.key for s in sweeps if mine is not None and mine - s.modified >= self.sweep_lease_s]
            self.backend.delete(dead)
            if len(dead) == len(sweeps) or time.monotonic() > deadline:
                return  # what is left cannot delete anything any more: its pruner is past its own deadline
            self.sleep(SWEEP_POLL_S)

    def _commit_marker(self, checkpoint_id: str) -> str:
        return f"{self._prefix}commits/{check_checkpoint_id(checkpoint_id)}"

    def _download(
        self,
        manifest: Manifest,
        stored: Mapping[str, ChunkRef],
        spots: Mapping[str, list[tuple[int, int, str]]],
    ) -> None:
        """Fetch, verify and write every stored chunk: a format-1 chunk by its own GET, packed ones by ranged GETs
        of adjacent chunks."""

        def place(chunk: ChunkRef, raw: bytes) -> None:
            fd, offset, path = spots[chunk.hash][0]
            data = _verified(manifest, chunk, raw, path)
            for fd, offset, _ in spots[chunk.hash]:
                os.pwrite(fd, data, offset)

        def fetch(chunks: list[ChunkRef]) -> None:
            for chunk, raw in zip(
                chunks, self._read_stored(manifest.checkpoint_id, chunks, spots[chunks[0].hash][0][2]), strict=True
            ):
                place(chunk, raw)

        with ThreadPoolExecutor(self.workers, thread_name_prefix="spotcr-fetch") as pool:
            futures = [pool.submit(fetch, chunks) for chunks in _ranges(stored.values())]
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for future in pending:
                future.cancel()
            for future in done:
                future.result()

    def read_chunks(self, manifest: Manifest, chunks: list[ChunkRef], path: str) -> list[bytes]:
        """The raw bytes of chunks of file `path`, each verified against its hash: one format-1 chunk, or adjacent
        chunks of one pack (a run of read_plan)."""
        stored = self._read_stored(manifest.checkpoint_id, chunks, path)
        return [_verified(manifest, chunk, raw, path) for chunk, raw in zip(chunks, stored, strict=True)]

    def _read_stored(self, checkpoint_id: str, chunks: list[ChunkRef], path: str) -> list[bytes]:
        """The stored (compressed) bytes of one format-1 chunk, or of adjacent chunks of one pack by one ranged GET."""
        first, pack = chunks[0], chunks[0].pack
        try:
            if pack is None:
                return [self.backend.get(self._chunk_key(first.hash))]
            start = first.offset
            raw = self.backend.get_range(self._pack_key(pack), start, chunks[-1].offset + chunks[-1].stored - start)
        except ObjectNotFound:
            where = f"pack {pack} holding " if pack else ""
            raise CorruptCheckpoint(
                checkpoint_id, f"{where}chunk {first.hash} of {path} is missing from the store"
            ) from None
        return [raw[chunk.offset - start : chunk.offset - start + chunk.stored] for chunk in chunks]

    def _pump_images(self, image_dir: Path, tails: dict[str, _FileTail], uploader: _Uploader) -> int:
        """Open image files that appeared and read what was added to each; return the bytes read. Called every
        POLL_SECONDS while CRIU writes: a file already open costs a string lookup here, not a Path."""
        for directory, _, names in os.walk(image_dir):
            under = os.path.relpath(directory, image_dir)
            prefix = "images/" if under == "." else f"images/{Path(under).as_posix()}/"
            for name in names:
                path = prefix + name
                if path not in tails:
                    source = Path(directory) / name
                    with contextlib.suppress(FileNotFoundError):
                        if stat.S_ISREG(source.lstat().st_mode):
                            tails[path] = _FileTail(path, source, self.chunking, mapped=True)
        return sum(tail.pump(uploader) for tail in tails.values())

    def _known_chunks(
        self, parent: str | None
    ) -> tuple[dict[str, ChunkRef], set[str], int, dict[tuple[str, int], ChunkRef]]:
        """Chunks committed by the parent (else the newest checkpoint) that the store still holds, by hash with
        where they are: sent once, never again; every chunk the parent names (what did not change since it); the
        parent's `since_full`; and its held chunks that have a fast digest by (file, offset): a chunk here at the
        same place with the same length and fast digest is that chunk, found without hashing it.

        The parent is the checkpoint the job was restored from or last committed, so its chunks were verified or
        just written; a newer one may hold a damaged chunk a restore fell back from, which must be sent afresh.
        """
        ids = self.checkpoint_ids()
        source = parent if parent and parent in ids else (ids[0] if ids else None)
        if source is None:
            return {}, set(), 0, {}
        try:
            manifest = self.load(source)
        except (CorruptCheckpoint, UnsupportedManifest, CheckpointNotFound):
            return {}, set(), 0, {}  # a manifest this agent cannot read only costs dedup, never correctness
        chunks = manifest.stored_chunks()
        if manifest.hash != HASH_ALGORITHM:
            return {}, set(), 0, {}  # its chunks go by other ids (SHA-256, before format 3): this commit sends all
        if not chunks:
            return {}, set(), manifest.since_full, {}
        # Rely only on chunks the store still holds: one listing (pack ids and format-1 chunk hashes), and a chunk
        # whose pack or object is gone is sent afresh.
        held = {obj.key.rsplit("/", 1)[-1] for obj in self.backend.scan(self._prefix + "chunks/")}
        known = {digest: chunk for digest, chunk in chunks.items() if (chunk.pack or digest) in held}
        at = {}
        for entry in manifest.files:
            offset = 0
            for chunk in entry.chunks[:-1]:  # the last one ends where the file did, not where a boundary is
                if chunk.fast is not None and chunk.hash in known:
                    at[entry.path, offset] = chunk
                offset += chunk.size
        return known, set(chunks), manifest.since_full, at

    def checkpoint_ids(self) -> list[str]:
        """Ids of committed checkpoints, newest first by the control plane's order (commands.checkpoint_order:
        generation, then sequence; never a VM's clock), from one listing: no manifest is read."""
        ids = []
        for obj in self.backend.scan(self._prefix + "checkpoints/"):
            name = obj.key.rsplit("/", 1)[-1]
            if name.endswith(".json"):
                with contextlib.suppress(ValueError):
                    ids.append(check_checkpoint_id(name.removesuffix(".json")))
        return sorted(ids, key=checkpoint_order, reverse=True)

    def _manifest_key(self, checkpoint_id: str) -> str:
        return f"{self._prefix}checkpoints/{checkpoint_id}.json"

    def _chunk_key(self, digest: str) -> str:
        return f"{self._prefix}chunks/{digest[:2]}/{digest}"

    def _pack_key(self, pack: str) -> str:
        return f"{self._prefix}{PACKS}{pack}"


class _Packer:
    """Copies compressed chunks into the pack being filled; writes each full pack on a thread of its own.

    A pack is filled in a page-aligned buffer that is used again once its pack is written: PACKS_IN_FLIGHT + 1 of
    them at most, touched once, instead of a fresh 32 MiB of memory for every pack (joining a pack's chunks into a
    new bytes object cost more in page faults than the copy itself), and a directory store writes them past the
    page cache (DirectoryBackend)."""

    def __init__(self, backend: Backend, prefix: str, size: int) -> None:
        self._backend = backend
        self._prefix = prefix
        self._size = size
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(PACKS_IN_FLIGHT)  # bounds memory: a full pack waits for a slot
        self._pool = ThreadPoolExecutor(PACKS_IN_FLIGHT, thread_name_prefix="spotcr-pack")
        self._writes: list[Future[float]] = []
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()  # buffers of written packs
        self._pack, self._buffer, self._filled = uuid.uuid4().hex, self._take_buffer(), 0
        self.written = 0
        self.upload_s = 0.0

    def add(self, compressed: bytes) -> tuple[str, int]:
        """Put a compressed chunk in the pack being filled; return that pack's id and the chunk's offset in it. A
        pack holds at most `size` bytes, unless one chunk alone is larger: that one is a pack of its own."""
        with self._lock:
            if self._filled + len(compressed) > self._size:
                self._seal()
            if len(compressed) > self._size:
                where = uuid.uuid4().hex, 0
                self._send(where[0], compressed)
                return where
            where = self._pack, self._filled
            self._buffer[self._filled : self._filled + len(compressed)] = compressed
            self._filled += len(compressed)
            if self._filled == self._size:
                self._seal()
        return where

    def finish(self) -> None:
        """Write the last pack; return once every pack is written (raising the first failure)."""
        with self._lock:
            self._seal()
        self._pool.shutdown(wait=True)
        for write in self._writes:
            self.upload_s += write.result()
        self.written = len(self._writes)

    def abort(self) -> None:
        """Write no more packs; those being written finish in the background (the process waits for them on exit),
        unreferenced: swept as a killed commit's are. A final dump waiting for this commit's lock goes on now."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _seal(self) -> None:
        """Hand the pack being filled to a writer thread and start a new one (the caller holds the lock)."""
        if not self._filled:
            return
        buffer, filled = self._buffer, self._filled
        self._send(self._pack, memoryview(buffer)[:filled], buffer)
        self._pack, self._buffer, self._filled = uuid.uuid4().hex, self._take_buffer(), 0

    def _send(self, pack: str, body: bytes | memoryview, buffer: mmap.mmap | None = None) -> None:
        for write in self._writes:
            if write.done() and (error := write.exception()) is not None:
                raise error
        self._slots.acquire()
        self._writes.append(self._pool.submit(self._write, f"{self._prefix}{PACKS}{pack}", body, buffer))

    def _take_buffer(self) -> mmap.mmap:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return mmap.mmap(-1, self._size)  # anonymous: page-aligned, and its pages are only used once written

    def _write(self, key: str, body: bytes | memoryview, buffer: mmap.mmap | None) -> float:
        began = time.perf_counter()
        try:
            self._backend.put(key, body)
        finally:
            if buffer is not None:
                self._free.put(buffer)
            self._slots.release()
        return time.perf_counter() - began


class _Uploader:
    """Hashes and compresses chunks on a thread pool into packs; skips chunks the store already holds."""

    def __init__(
        self,
        packer: _Packer,
        known: Mapping[str, ChunkRef],
        workers: int,
        level: int,
        *,
        in_parent: set[str],
        parent_at: Mapping[tuple[str, int], ChunkRef],
        record_fast: bool,
        watch: Callable[[_Uploader], None] | None = None,
    ) -> None:
        self._packer = packer
        self._in_parent = in_parent
        self._parent_at = parent_at
        self._record_fast = record_fast  # a periodic commit records every chunk's fast digest for the next one
        self.level = level
        self._claimed = set(known)
        self._located = dict(known)  # hash -> where the chunk is stored: known ones, then each one packed
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(workers * 2)  # bounds memory: at most 2 chunks per worker
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="spotcr-store")
        self._local = threading.local()
        self._failure: BaseException | None = None
        self.bytes_uploaded = 0
        self.chunks_uploaded = 0
        self.bytes_new = 0
        self.bytes_changed = 0
        self.read_s = 0.0  # added to by the reading thread (_FileTail.pump)
        self.hash_s = self.compress_s = 0.0
        self.unchanged_chunks = 0  # chunks found unchanged by their fast digest, without a chunk id
        self.bytes_handed = 0  # raw bytes cut into chunks so far, unchanged ones included
        self._watch = watch

    def __enter__(self) -> _Uploader:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._pool.shutdown(wait=True, cancel_futures=error is not None)
        if error is None and self._failure is None:
            self._packer.finish()
        else:
            self._packer.abort()

    def locate(self, chunk: ChunkRef) -> ChunkRef:
        """The chunk with where it is stored (once every chunk is in): inline ones are where they are."""
        if chunk.inline is not None:
            return chunk
        located = self._located[chunk.hash]
        return located if located.fast or not chunk.fast else replace(located, fast=chunk.fast)

    @property
    def has_parent(self) -> bool:
        return bool(self._parent_at)

    def unchanged(self, path: str, offset: int, view: memoryview) -> ChunkRef | None:
        """The parent's chunk at `offset` of `path` if view starts with the same bytes (its length and fast digest),
        found while the file is cut: neither its pages scanned for a boundary nor the chunk handed to a worker."""
        there = self._parent_at.get((path, offset))
        if there is None or there.size > len(view) or fast_digest(view[: there.size]) != there.fast:
            return None
        with self._lock:
            self.unchanged_chunks += 1
        return there

    def handed(self, size: int) -> None:
        """A chunk of `size` bytes was cut (stored, or found to be the parent's)."""
        self.bytes_handed += size
        if self._watch is not None:
            self._watch(self)

    def submit(self, data: bytes | memoryview, path: str, offset: int) -> Future[ChunkRef]:
        """Store the chunk at `offset` of file `path` (unless the store holds it); its ChunkRef once done."""
        if self._failure is not None:
            raise self._failure
        self._slots.acquire()
        future = self._pool.submit(self._store, data, self._parent_at.get((path, offset)))
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future[ChunkRef]) -> None:
        self._slots.release()
        if not future.cancelled() and (error := future.exception()) is not None:
            self._failure = error

    def _store(self, data: bytes | memoryview, there: ChunkRef | None) -> ChunkRef:
        """`there`: the parent's chunk at the same place, which this one is if length and fast digest match."""
        began = time.perf_counter()
        fast = None
        if self._record_fast or (there is not None and there.size == len(data)):
            fast = fast_digest(data)
            if there is not None and there.size == len(data) and there.fast == fast:
                with self._lock:
                    self.hash_s += time.perf_counter() - began
                    self.unchanged_chunks += 1
                return there
        digest = chunk_id(data)
        hashed = time.perf_counter()
        with self._lock:
            self.hash_s += hashed - began
            new = digest not in self._claimed
            self._claimed.add(digest)
            if new and digest not in self._in_parent:
                self.bytes_changed += len(data)
        if new:
            compressed = self._compress(data)
            compressed_at = time.perf_counter()
            pack, offset = self._packer.add(compressed)
            with self._lock:
                self._located[digest] = ChunkRef(
                    digest, len(data), pack=pack, offset=offset, stored=len(compressed), fast=fast
                )
                self.compress_s += compressed_at - hashed
                self.bytes_uploaded += len(compressed)
                self.bytes_new += len(data)
                self.chunks_uploaded += 1
        return ChunkRef(digest, len(data), fast=fast)

    def _compress(self, data: bytes | memoryview) -> bytes:
        """zstd at the commit's level (the store's; FAST_LEVEL for a final dump), unless a probe of the chunk's head
        shows it does not compress (random or float data: zstd-1 gains about 8% on float32 at 540 MiB/s); then at
        FAST_LEVEL, which stores it as raw blocks at several GiB/s. Either way a zstd frame: fetch decompresses it
        alike."""
        local = self._local
        if getattr(local, "compressor", None) is None:
            local.compressor = zstandard.ZstdCompressor(level=self.level)
            local.raw = zstandard.ZstdCompressor(level=FAST_LEVEL)
        probe = self.level != FAST_LEVEL and len(data) > 2 * PROBE  # at FAST_LEVEL already: nothing to learn
        if probe and len(local.compressor.compress(data[:PROBE])) > PROBE * PROBE_GAIN:
            return local.raw.compress(data)
        return local.compressor.compress(data)


class _FileTail:
    """One file being read into chunks, possibly while it is still being written."""

    def __init__(self, path: str, source: Path, chunking: Chunking, *, mapped: bool = False) -> None:
        self.path = path
        self._mapped = mapped  # only for files that are appended to, never truncated or rewritten (CRIU's images)
        self.source = source
        try:
            self._fd = os.open(source, os.O_RDONLY)
        except FileNotFoundError:
            raise StoreError(f"file {source} to checkpoint as {path} does not exist") from None
        self._chunker = Chunker(chunking)
        self._chunks: list[Future[ChunkRef] | ChunkRef] = []
        self._handed = 0  # bytes handed to the uploader: where the next chunk starts
        self._same: dict[int, ChunkRef] = {}  # the parent's chunks found unchanged while cutting, by offset
        self.size = 0

    def _feed(self, uploader: _Uploader, data: bytes | memoryview) -> list[bytes | memoryview]:
        """Cut data into chunks; a chunk found to be the parent's at the same place is taken whole, unscanned."""

        def known(offset: int, view: memoryview) -> int:
            there = uploader.unchanged(self.path, offset, view)
            if there is None:
                return 0
            self._same[offset] = there
            return there.size

        return self._chunker.feed(data, known if uploader.has_parent else None)

    def _hand_over(self, uploader: _Uploader, chunks: list[bytes | memoryview]) -> None:
        for chunk in chunks:
            same = self._same.pop(self._handed, None)
            self._chunks.append(same or uploader.submit(chunk, self.path, self._handed))
            self._handed += len(chunk)
            uploader.handed(len(chunk))

    def pump(self, uploader: _Uploader) -> int:
        """Read everything written so far; hand complete chunks to the uploader."""
        if self._mapped:
            return self._pump_mapped(uploader)
        read = 0
        while True:
            began = time.perf_counter()
            block = os.read(self._fd, READ_BLOCK)
            if not block:
                uploader.read_s += time.perf_counter() - began
                break
            read += len(block)
            chunks = self._feed(uploader, block)
            uploader.read_s += time.perf_counter() - began
            self._hand_over(uploader, chunks)
        self.size += read
        return read

    def _pump_mapped(self, uploader: _Uploader, *, last: bool = False) -> int:
        """pump() for a file only ever appended to (CRIU's images): the bytes added since the last call are mapped,
        not read, so chunks are views of the page cache that are hashed and compressed without a copy. The mapping
        lives as long as a chunk still refers to it. Whole pages only until the last call: a partial page would be
        carried, and the next block copied to join it."""
        began = time.perf_counter()
        end = os.fstat(self._fd).st_size
        if not last:
            end -= end % PAGE
        if end <= self.size:
            uploader.read_s += time.perf_counter() - began
            return 0
        start = self.size - self.size % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(self._fd, end - start, prot=mmap.PROT_READ, offset=start, flags=MAP_FLAGS)
        chunks = self._feed(uploader, memoryview(mapping)[self.size - start :])
        uploader.read_s += time.perf_counter() - began
        self._hand_over(uploader, chunks)
        added, self.size = end - self.size, end
        return added

    def finish(self, uploader: _Uploader) -> None:
        if self._mapped:
            self._pump_mapped(uploader, last=True)
        else:
            self.pump(uploader)
        if self._chunker.emitted == 0 and self._chunker.pending <= INLINE_MAX:
            for data in self._chunker.finish():
                compressed = zstandard.ZstdCompressor(level=uploader.level).compress(data)
                self._chunks.append(ChunkRef(chunk_id(data), len(data), compressed))
        else:
            self._hand_over(uploader, self._chunker.finish())
        self.mode = os.fstat(self._fd).st_mode & 0o7777

    def entry(self, locate: Callable[[ChunkRef], ChunkRef]) -> FileEntry:
        """The file's manifest entry, each chunk with where it is stored (`locate`), once every chunk is in."""
        chunks = tuple(locate(c.result() if isinstance(c, Future) else c) for c in self._chunks)
        size = sum(c.size for c in chunks)
        if size != self.size:
            raise StoreError(f"file {self.source} changed while it was stored")
        return FileEntry(self.path, size, self.mode, file_digest(chunks), chunks)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def _watch(
    checkpoint_id: str,
    image_dir: Path,
    extra_files: Mapping[str, Path] | None,
    unread: Mapping[str, Path],
    keep_going: Callable[[CommitProgress], bool],
) -> Callable[[_Uploader], None]:
    """An uploader's watch that tells keep_going the commit's progress every PROGRESS_S and stops the commit (in the
    thread cutting chunks) once it answers False."""
    files = [p for d, _, names in os.walk(image_dir) for p in (Path(d) / n for n in names) if p.is_file()]
    total = sum(
        p.stat().st_size for p in [*files, *map(Path, (extra_files or {}).values()), *map(Path, unread.values())]
    )
    asked = time.monotonic()

    def watch(uploader: _Uploader) -> None:
        nonlocal asked
        if time.monotonic() - asked < PROGRESS_S:
            return
        asked = time.monotonic()
        if not keep_going(CommitProgress(uploader.bytes_handed, total, uploader.bytes_changed)):
            raise CommitAbandoned(checkpoint_id)

    return watch


def _allow_many_open_files() -> None:
    """Every image file stays open while CRIU may still write it: a job of many processes has thousands."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _decompressor() -> zstandard.ZstdDecompressor:
    local = _THREAD
    if not hasattr(local, "decompressor"):
        local.decompressor = zstandard.ZstdDecompressor()
    return local.decompressor


_THREAD = threading.local()


def _verified(manifest: Manifest, chunk: ChunkRef, stored: bytes, path: str) -> bytes:
    """Decompress a stored chunk and check it is exactly the bytes the manifest names (by the manifest's hash)."""
    checkpoint_id = manifest.checkpoint_id
    try:
        data = _decompressor().decompress(stored, max_output_size=chunk.size)
    except zstandard.ZstdError as e:
        raise CorruptCheckpoint(checkpoint_id, f"chunk {chunk.hash} of {path} is damaged or truncated ({e})") from e
    if len(data) != chunk.size or CHUNK_HASHES[manifest.hash](data) != chunk.hash:
        raise CorruptCheckpoint(checkpoint_id, f"chunk {chunk.hash} of {path} does not match its hash")
    return data


def read_plan(chunks: Iterable[ChunkRef]) -> list[list[ChunkRef]]:
    """The reads that fetch these chunks (read_chunks takes each): see _ranges."""
    return _ranges(chunks)


def _ranges(chunks: Iterable[ChunkRef]) -> list[list[ChunkRef]]:
    """What a restore reads, one request each: a format-1 chunk alone; packed chunks in runs of adjacent ones of
    one pack, up to FETCH_RANGE bytes (larger only for a single chunk)."""
    ranges: list[list[ChunkRef]] = []
    packed = sorted((c for c in chunks if c.pack is not None), key=lambda c: (c.pack or "", c.offset))
    for chunk in packed:
        last = ranges[-1] if ranges else None
        if (
            last is not None
            and last[-1].pack == chunk.pack
            and last[-1].offset + last[-1].stored == chunk.offset
            and chunk.offset + chunk.stored - last[0].offset <= FETCH_RANGE
        ):
            last.append(chunk)
        else:
            ranges.append([chunk])
    return ranges + [[c] for c in chunks if c.pack is None]


def _id_seconds(checkpoint_id: str) -> float:
    return int(checkpoint_id.split("-", 1)[0]) / 1000
