"""Restoring the job from a committed checkpoint, newest first, walking back through every older one.

The walk: the checkpoint the control plane names (else the newest committed), then every older committed one,
newest first. A store error that may pass (an outage, a throttle) is retried on the same checkpoint with
backoff; a checkpoint that is damaged, missing or incompatible is skipped. Only when the walk finds nothing
restorable for such reasons (or nothing committed at all) may the caller start the job from the beginning.
Damaged and missing checkpoints count, and so does one that needs a mount this VM lacks (MissingMount): every
backup boots alike from the launch template, so no backup will ever have it. Other incompatibilities and CRIU
failures do not: another machine may restore that checkpoint.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from spotcr_contracts.commands import checkpoint_order
from spotcr_contracts.tags import DEFAULT_TCP

from . import aliases, carry, gpu, mounts
from . import lazy as lazy_restore
from .carry import Entry
from .checkpoint import Store
from .criu import LAZY_PAGES, Criu, CriuError
from .host import HostInfo
from .runner import job_alive, process_start_time
from .state import StateFile, admit, exclusive
from .store import FileEntry, Manifest
from .store.errors import CheckpointNotFound, CorruptCheckpoint, StoreError, UnsupportedManifest

log = logging.getLogger(__name__)

STORE_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # 15.5 s of retries: a store brownout of 12 s does not fail a restore
PERMANENT_STORE_ERRORS = (CorruptCheckpoint, CheckpointNotFound, UnsupportedManifest)
# CRIU's words for an external mount of the image that this VM cannot bind (a checkpoint recorded without its
# mounts, or one missed by check_mounts): as permanent as MissingMount.
CRIU_MISSING_MOUNT = re.compile(r"mnt: No mapping for \S+ mountpoint")


STOPPED_HERE = "the job was stopped on this VM after its final dump failed; it is never resumed here"


class RestoreError(RuntimeError):
    """No checkpoint could be restored; the message gives each attempt's reason, log_tail the last CRIU log's end."""

    def __init__(
        self,
        message: str,
        checkpoint_id: str = "",
        log_tail: str = "",
        logs: Mapping[str, str] | None = None,
        *,
        nothing_restorable: bool = False,
    ) -> None:
        super().__init__(message)
        self.checkpoint_id = checkpoint_id
        self.log_tail = log_tail
        # Checkpoint id -> CRIU's whole restore log, kept in the job's storage by the agent.
        self.logs = dict(logs or {})
        # True when the store answered that no committed checkpoint exists or every one is damaged; False when
        # an outage may hide a good one, or CRIU or this host failed (the checkpoint may restore elsewhere).
        self.nothing_restorable = nothing_restorable


class Incompatible(RuntimeError):
    """This machine cannot restore the checkpoint; the message says what differs."""


class MissingMount(Incompatible):
    """The checkpoint needs a mount this VM lacks, and so does every backup (they boot alike)."""


@dataclass(frozen=True)
class RestoreOutcome:
    checkpoint_id: str
    generation: int
    seconds: float
    pid: int
    skipped: str = ""  # why newer checkpoints were not restored; empty when the first choice was
    # From the order to the job running again; `seconds` runs to its last page in, later for a lazy restore.
    running_seconds: float = 0.0
    lazy: bool = False  # its memory arrived after it ran again (lazy.py)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def check_compatible(manifest: Manifest, host: HostInfo) -> None:
    """Raise Incompatible naming the first difference that would make CRIU fail here."""
    dumped, here = _version(manifest.criu_version), _version(host.criu_version)
    if not dumped or not here or dumped[0] != here[0] or here < dumped:
        raise Incompatible(
            f"CRIU {host.criu_version} here cannot restore images of CRIU {manifest.criu_version} "
            f"(needs the same major version, at least as new)"
        )
    if manifest.arch != host.arch:
        raise Incompatible(f"checkpoint is for {manifest.arch}, this machine is {host.arch}")
    missing = sorted(set(manifest.cpu_flags) - set(host.cpu_flags))
    if missing:
        raise Incompatible(f"this CPU lacks features the job's CPU had: {', '.join(missing[:12])}")


def check_gpus(manifest: Manifest, machine: Callable[[], gpu.Machine], criu: Criu) -> Path | None:
    """For a checkpoint that holds GPU state: Incompatible unless this machine has the same GPUs and driver and
    CRIU's CUDA plugin; the plugin's directory. None for a checkpoint without GPU state."""
    recorded = manifest.gpu
    if not recorded:
        return None
    problem = gpu.restore_problem(recorded, machine())
    if problem:
        raise Incompatible(problem)
    directory = gpu.plugin_dir(criu.binary)
    if directory is None:
        raise Incompatible(f"the checkpoint holds GPU state and CRIU's CUDA plugin ({gpu.PLUGIN}) is not installed")
    return directory


def check_open_files(manifest: Manifest, record: Mapping[str, Any] | None = None) -> None:
    """Every file the job held exists here (its VM-local ones were put back first)."""
    if record is not None:
        layout = carry.Layout.from_json(record["layout"])
        held = [path for path in record["scan"]["files"] if layout.place(path) != "kernel"]
    else:
        held = [f.path for f in manifest.open_files]
    missing = [path for path in held if not Path(path).exists()]
    if missing:
        raise Incompatible(f"files the job had open are missing here: {', '.join(missing[:5])}")


def check_mounts(record: Mapping[str, Any], mountinfo: str | None = None) -> None:
    """Raise MissingMount naming the VM mounts the job saw that this VM lacks (CRIU could not bind them)."""
    missing = mounts.missing_here([str(point) for point in record.get("mounts", [])], mountinfo)
    if missing:
        raise MissingMount(
            f"the job's VM had {', '.join(missing[:5])} mounted and this VM has not (a mount made by the instance's "
            "own boot script, which backups do not run): no backup can restore this checkpoint"
        )


def permanent(error: Exception) -> bool:
    """A failure that says this checkpoint will never restore on a backup: the walk may end in a fresh start."""
    if isinstance(error, CriuError):
        return bool(CRIU_MISSING_MOUNT.search(f"{error.reason}\n{error.log}"))
    return isinstance(error, (*PERMANENT_STORE_ERRORS, MissingMount))


def check_image(record: Mapping[str, Any]) -> None:
    """The image files the job had open or mapped are the same here: same size, same bytes sampled at each end."""
    problems = carry.image_differences(record["image_files"])
    if problems:
        raise Incompatible(
            "this VM's image differs from the one the job ran on: "
            + "; ".join(problems[:5])
            + " (launch the backup from the same AMI)"
        )


def check_listeners(record: Mapping[str, Any]) -> None:
    """A listening socket bound to one address needs that address here; a wildcard listener restores anywhere."""
    missing = []
    for listener in record["scan"]["listening"]:
        address, port = listener.rsplit(" ", 1)
        if not carry.address_here(address):
            missing.append(f"{address}:{port}")
    if missing:
        raise Incompatible(
            f"the job listens on {', '.join(missing[:3])}, an address this VM does not have "
            "(listen on 0.0.0.0 or :: to be restorable on another VM)"
        )


def close_connections(record: Mapping[str, Any] | None, policy: str) -> bool:
    """Whether the job's TCP connections come back closed: by policy, or because this VM lacks their address."""
    if record is None:
        return policy == "close"
    established = record["scan"]["established"]
    return bool(established) and (policy == "close" or not all(carry.address_here(a) for a in established))


@dataclass
class Restorer:
    job_id: str
    workdir: Path
    scratch_dir: Path
    state: StateFile
    store: Store
    criu: Criu
    host: Callable[[], HostInfo]
    tcp: str = DEFAULT_TCP  # AgentConfig.tcp
    backoff_s: tuple[float, ...] = STORE_BACKOFF_S
    gpus: Callable[[], gpu.Machine] = gpu.read_machine  # this machine's GPUs, read only for a GPU checkpoint
    sleep: Callable[[float], None] = time.sleep
    lazy: bool = True  # AgentConfig.lazy_restore: lazily where CRIU and the kernel can (lazy.py)
    on_running: Callable[[int], None] = lambda pid: None  # a lazy restore's job runs, pages still to come (tests)
    _times: dict[str, lazy_restore.LazyTimes] = field(default_factory=dict)  # per checkpoint, its last attempt

    def restore(self, generation: int, checkpoint_id: str | None = None, *, exact: bool = False) -> RestoreOutcome:
        """Restore the named checkpoint (else the newest), walking back to older ones if it fails; `exact`: that one
        or nothing (a node of a job over several VMs never walks back alone: its part must match the others')."""
        started = time.monotonic()
        with exclusive(self.state.dir / "dump.lock"):
            with self.state.locked() as state:
                admit(state, generation)
                if state.job_status == "running" and job_alive(state.job_pid, state.job_start_time):
                    raise RestoreError(f"the job already runs on this VM (pid {state.job_pid}); it never runs twice")
                if state.job_status == "stopped":
                    raise RestoreError(STOPPED_HERE)
            candidates = [checkpoint_id] if exact and checkpoint_id else self._candidates(checkpoint_id)
            host = self.host()
            failures: list[str] = []
            logs: dict[str, str] = {}
            log_tail = ""
            transient = False
            for candidate in candidates:
                try:
                    pid = self._with_retries(functools.partial(self._restore_one, candidate, host))
                except (StoreError, Incompatible, CriuError, OSError, aliases.AliasError) as error:
                    reason = error.reason if isinstance(error, CriuError) else str(error)
                    if isinstance(error, CriuError):
                        logs[candidate], log_tail = error.log, error.log_tail
                    # Only a store that says the data is gone, or a mount no backup has, makes a start from
                    # scratch right; other CRIU or host failures may pass elsewhere, an outage may hide a good one.
                    transient |= not permanent(error)
                    log.warning("restoring checkpoint %s failed: %s", candidate, reason)
                    failures.append(f"{candidate}: {reason}")
                    continue
                start_time = process_start_time(pid) or 0
                with self.state.locked() as state:
                    # The job runs here now, whatever generation was admitted meanwhile: a warning that came
                    # during the restore (a newer generation) has its final dump waiting on the dump lock.
                    state.generation = max(state.generation, generation)
                    state.job_id = self.job_id
                    state.job_pid, state.job_start_time = pid, start_time
                    state.job_status, state.exit_code = "running", None
                    # A share that ended here before its job's restore (a node of a job over several VMs, ended
                    # by MPI when another node went) committed that end's result: the restored job's end is its own.
                    state.result, state.result_error, state.result_missing = "", "", ""
                    state.last_checkpoint = candidate
                    # A new run of the job here: earlier final dumps are not its own; one asked meanwhile is.
                    state.final_dumps = {k: v for k, v in state.final_dumps.items() if int(k) > generation}
                if failures:
                    log.warning("restored the older checkpoint %s because %s", candidate, "; ".join(failures))
                seconds = time.monotonic() - started
                times = self._times.get(candidate)
                return RestoreOutcome(
                    checkpoint_id=candidate,
                    generation=generation,
                    seconds=round(seconds, 3),
                    pid=pid,
                    skipped="; ".join(failures),
                    running_seconds=round(times.running_at - started, 3) if times else round(seconds, 3),
                    lazy=times is not None,
                )
        if not candidates:
            raise RestoreError(f"job {self.job_id} has no committed checkpoint", nothing_restorable=True)
        raise RestoreError(
            "no checkpoint could be restored: " + "; ".join(failures),
            candidates[0],
            log_tail,
            logs,
            nothing_restorable=not transient,
        )

    def _candidates(self, checkpoint_id: str | None) -> list[str]:
        """The named checkpoint (else the newest), then every older committed one, newest first (the store's and the
        control plane's one order, commands.checkpoint_order)."""
        committed = self._with_retries(self.store.checkpoint_ids)
        if not checkpoint_id:
            return committed
        return [checkpoint_id, *(c for c in committed if checkpoint_order(c) < checkpoint_order(checkpoint_id))]

    def _with_retries(self, action: Callable[[], Any]) -> Any:
        """Run a store action, retrying errors that may pass (not a damaged or missing checkpoint) with backoff."""
        for delay in (*self.backoff_s, None):
            try:
                return action()
            except PERMANENT_STORE_ERRORS:
                raise
            except StoreError as error:
                if delay is None:
                    raise
                log.warning("the checkpoint store failed (%s); retrying in %.1f s", error, delay)
                self.sleep(delay)
        raise AssertionError("unreachable")

    def _restore_one(self, checkpoint_id: str, host: HostInfo) -> int:
        dest = self.scratch_dir / f"restore-{checkpoint_id}"
        shutil.rmtree(dest, ignore_errors=True)
        created: list[str] = []
        kept: list[str] = []
        try:
            # The manifest alone first: a machine that cannot restore it downloads no image.
            manifest = self.store.load(checkpoint_id)
            check_compatible(manifest, host)
            libdir = check_gpus(manifest, self.gpus, self.criu)
            self._times.pop(checkpoint_id, None)
            pages = self._lazy_pages(manifest, libdir)
            manifest = self.store.fetch(checkpoint_id, dest, later={entry.path for entry in pages})
            images = self._lazy_images(checkpoint_id, dest, pages)
            record = _record(dest)
            if record is not None:
                check_mounts(record)
                check_image(record)
                # The checkpoint VM's address the job's sockets were bound to, kept on this VM's loopback.
                kept = aliases.keep(self.state.dir, aliases.wanted(record, self.tcp))
                check_listeners(record)
            self._place_workdir(dest / "workdir")
            if record is not None:
                for relative in record.get("workdir_mount_points", []):  # mount points of the job's own namespaces
                    if ".." not in Path(relative).parts:
                        (self.workdir / relative).mkdir(parents=True, exist_ok=True)
                created = carry.put_back([Entry.from_json(e) for e in record["entries"]], dest)
            check_open_files(manifest, record)
            tcp_close = close_connections(record, self.tcp)
            reset = [] if tcp_close or record is None else aliases.outside_connections(record, kept)
            if tcp_close:
                log.info(
                    "the job's TCP connections come back closed (policy %s, or their address is not here)", self.tcp
                )
            elif reset:
                log.info("connections from the old VM's address to peers outside the job are reset: %s", reset)
            log_dir = self.scratch_dir / f"restore-{checkpoint_id}.logs"
            if images is None:
                pid = self.criu.restore(dest / "images", log_dir, tcp_close=tcp_close, reset=reset, libdir=libdir)
            else:
                pid = self._restore_lazily(
                    manifest, dest / "images", log_dir, pages, images, tcp_close=tcp_close, reset=reset
                )
            created, kept = [], []
            return pid
        finally:
            carry.take_back(created)
            if kept:
                aliases.release(self.state.dir)  # a failed restore leaves no alias behind
            shutil.rmtree(dest, ignore_errors=True)

    def _lazy_pages(self, manifest: Manifest, libdir: Path | None) -> list[FileEntry]:
        """The pages images a lazy restore leaves for later; none where the job's restore is not lazy (turned off,
        a kernel without userfaultfd, GPU state: the CUDA plugin restores device memory from host pages)."""
        if not self.lazy or libdir is not None or not self.criu.supports(LAZY_PAGES):
            return []
        return [
            entry
            for entry in manifest.files
            if lazy_restore.PAGES_IMAGE.fullmatch(entry.path) and all(c.inline is None for c in entry.chunks)
        ]

    def _lazy_images(self, checkpoint_id: str, dest: Path, pages: list[FileEntry]) -> lazy_restore.Images | None:
        """What the lazy restore serves, or None for a restore of whole images (then the pages are fetched now)."""
        if not pages:
            return None
        try:
            return lazy_restore.Images.read(dest / "images")
        except lazy_restore.LazyUnsupported as why:
            log.info("checkpoint %s is restored whole: %s", checkpoint_id, why)
        self.store.fetch(checkpoint_id, dest)
        return None

    def _restore_lazily(
        self,
        manifest: Manifest,
        images_dir: Path,
        log_dir: Path,
        pages: list[FileEntry],
        images: lazy_restore.Images,
        *,
        tcp_close: bool,
        reset: list[str],
    ) -> int:
        """The job runs again once its process tree is rebuilt; this returns once its last page is in (lazy.py)."""
        checkpoint_id = manifest.checkpoint_id
        source = lazy_restore.StorePages(self.store, manifest, pages, images_dir)
        try:
            for image, ranges in images.eager.items():
                for offset, length in ranges:
                    source.ensure(image, offset, length)
        except BaseException:
            source.close()
            raise
        restore = lazy_restore.LazyRestore(self.criu, images_dir, log_dir, source, images, on_running=self.on_running)
        pid = restore.run(
            lambda logs: self.criu.restore_argv(images_dir, logs, tcp_close=tcp_close, reset=reset, lazy=True)
        )
        self._times[checkpoint_id] = restore.times
        log.info(
            "checkpoint %s restored lazily: the job ran again %.2f s after CRIU began, its last page of %.0f MiB "
            "came %.2f s after",
            checkpoint_id,
            restore.times.running_s,
            restore.times.lazy_bytes / 2**20,
            restore.times.all_pages_s,
        )
        return pid

    def _place_workdir(self, fetched: Path) -> None:
        """The work dir becomes exactly the checkpoint's: the job's files at the paths and sizes it had."""
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.parent.mkdir(parents=True, exist_ok=True)
        if fetched.is_dir():
            shutil.move(fetched, self.workdir)
        else:
            self.workdir.mkdir()


def _record(dest: Path) -> dict[str, Any] | None:
    """What the checkpoint carried and checked (carry.py); None for checkpoints taken before it was recorded."""
    path = dest / carry.RECORD
    if not path.exists():
        return None
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except ValueError as error:
        raise Incompatible(f"{carry.RECORD} in the checkpoint is not JSON: {error}") from error
    return record
