"""Lazy restore: the job runs again before its memory has arrived; its pages follow from the store.

How: everything but page contents is fetched first (and the few pages CRIU restores eagerly), then
`criu restore --lazy-pages` rebuilds the process tree with its anonymous memory registered with userfaultfd, and
`criu lazy-pages --page-server` serves each page the job touches, then every other one in the background, asking
our page server (PageServer, CRIU's page-server protocol on loopback). The page server answers from the local
pages image once the chunks that hold the asked range are fetched and verified against the manifest; a
background prefetch fetches every chunk meanwhile, faulted ranges first (PageSource).

Rules, each enforced here:
- No page reaches the job unless the chunk it came from verified against the manifest (the store verifies each
  chunk before it is written to the local image; the page server reads only ranges whose chunks are all in).
- A fetch or verification failure never lets the job run on: the kernel resolves the faults of a closed
  userfaultfd as ordinary faults, i.e. zero pages for anonymous memory, a silently wrong result. So on any
  failure the page server stops answering (the job waits on its fault), the job's process tree is killed and
  seen gone, and only then are the lazy-pages daemon and the page server stopped (LazyRestore.abort).
- The restore is not done until the last page is in: the restore holds the dump lock until then, so a final
  dump asked during the lazy phase waits for it and never dumps a job with pages missing (CRIU would dump them
  as holes, which restore as zeros).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .criu import Criu, failure, protobuf_fields
from .store.errors import StoreError
from .store.manifest import ChunkRef, FileEntry, Manifest
from .store.store import read_plan

log = logging.getLogger(__name__)

PAGE = 4096
# CRIU's page-server protocol (criu/page-xfer.c): a request or answer is this header; an answer's pages follow it.
HEADER = struct.Struct("<IIQQ")  # cmd, nr_pages, vaddr, dst_id
PS_IOV_ADD_F = 6
PS_IOV_GET = 7
PS_IOV_CLOSE = 0x1023
PS_IOV_FORCE_CLOSE = 0x1024
PS_CMD_BITS = 16
# Pagemap entry flags (criu/include/pagemap.h)
PE_PARENT = 1 << 0
PE_LAZY = 1 << 1
PE_PRESENT = 1 << 2
PAGES_IMAGE = re.compile(r"images/pages-\d+\.img")  # a checkpoint's pages images, by manifest path
PAGEMAP = re.compile(r"pagemap-(\d+)\.img")
SHMEM_PAGEMAP = re.compile(r"pagemap-shmem-(\d+)\.img")
READY_TIMEOUT_S = 30.0  # the lazy-pages daemon is listening well within this
GONE_TIMEOUT_S = 10.0  # a killed process tree is gone well within this


class LazyUnsupported(RuntimeError):
    """These images cannot be restored lazily (the restore fetches them whole instead); the message says why."""


class LazyRestoreError(OSError):
    """The lazy phase failed; the job was killed before anything could read a page that never arrived."""


@dataclass(frozen=True)
class Run:
    """A pagemap entry: `pages` pages at `vaddr`, stored at `offset` of its pages image."""

    vaddr: int
    pages: int
    flags: int
    offset: int

    @property
    def lazy(self) -> bool:
        return bool(self.flags & PE_LAZY)


@dataclass(frozen=True)
class PageMap:
    """One process's (or one shared memory segment's) pagemap image: its pages image and its runs by address."""

    pages_image: str
    runs: tuple[Run, ...]

    def ranges(self, vaddr: int, pages: int) -> list[tuple[int, int]]:
        """The (offset, length) ranges of the pages image that hold `pages` pages from `vaddr`; ValueError when any
        of them is not in the image."""
        starts = [run.vaddr for run in self.runs]
        out: list[tuple[int, int]] = []
        address, end = vaddr, vaddr + pages * PAGE
        while address < end:
            index = bisect_right(starts, address) - 1
            run = self.runs[index] if index >= 0 else None
            if run is None or address >= run.vaddr + run.pages * PAGE:
                raise ValueError(f"page {address:#x} is not in {self.pages_image}")
            stop = min(end, run.vaddr + run.pages * PAGE)
            out.append((run.offset + address - run.vaddr, stop - address))
            address = stop
        return out


def _entries(path: Path) -> Iterable[dict[int, int | bytes]]:
    """The protobuf entries of a CRIU image: two 32-bit magics, then each entry after its 32-bit length."""
    data = path.read_bytes()
    offset = 8
    while offset < len(data):
        (size,) = struct.unpack_from("<I", data, offset)
        yield protobuf_fields(data[offset + 4 : offset + 4 + size])
        offset += 4 + size


def _int(entry: dict[int, int | bytes], number: int) -> int:
    value = entry.get(number, 0)
    if not isinstance(value, int):
        raise ValueError(f"field {number} of a pagemap entry is not a number")
    return value


def read_pagemap(path: Path) -> PageMap:
    """A pagemap image; LazyUnsupported for one whose pages are partly in a parent checkpoint's images."""
    entries = iter(_entries(path))
    head = next(entries, None)
    if head is None:
        return PageMap("", ())
    runs: list[Run] = []
    offset = 0
    for entry in entries:
        vaddr, pages, in_parent, flags = (_int(entry, n) for n in (1, 2, 3, 4))
        if in_parent or flags & PE_PARENT:
            raise LazyUnsupported(f"{path.name} refers to a parent checkpoint's pages")
        flags = flags or PE_PRESENT
        if flags & PE_PRESENT:
            runs.append(Run(vaddr, pages, flags, offset))
            offset += pages * PAGE
    return PageMap(f"pages-{_int(head, 1)}.img", tuple(runs))


@dataclass(frozen=True)
class Images:
    """What a lazy restore needs to know of a checkpoint's images: each process's pagemap by its PID in the
    images, and the ranges of pages images CRIU restores itself (not lazily) and which must be in first."""

    pagemaps: dict[int, PageMap]
    eager: dict[str, list[tuple[int, int]]]  # pages image -> (offset, length)
    lazy_bytes: int

    @classmethod
    def read(cls, images_dir: Path) -> Images:
        pagemaps: dict[int, PageMap] = {}
        eager: dict[str, list[tuple[int, int]]] = {}
        lazy_bytes = 0
        for path in sorted(images_dir.iterdir()):
            if SHMEM_PAGEMAP.fullmatch(path.name):  # shared memory is restored by CRIU itself, whole
                pagemap = read_pagemap(path)
                if pagemap.runs:
                    last = pagemap.runs[-1]
                    eager.setdefault(pagemap.pages_image, []).append((0, last.offset + last.pages * PAGE))
            elif match := PAGEMAP.fullmatch(path.name):
                pagemap = pagemaps[int(match.group(1))] = read_pagemap(path)
                for run in pagemap.runs:
                    if run.lazy:
                        lazy_bytes += run.pages * PAGE
                    else:
                        eager.setdefault(pagemap.pages_image, []).append((run.offset, run.pages * PAGE))
        return cls(pagemaps, eager, lazy_bytes)


class ChunkReader(Protocol):
    """The store's read side that a lazy restore uses (CheckpointStore)."""

    def read_chunks(self, manifest: Manifest, chunks: list[ChunkRef], path: str) -> list[bytes]: ...


class PageSource(Protocol):
    """Where the bytes of the pages images come from: `ensure` returns once the range is in the local image,
    verified, or raises."""

    def ensure(self, pages_image: str, offset: int, length: int) -> None: ...

    def start(self) -> None:
        """Begin fetching every page in the background."""

    def check(self) -> None:
        """Raise the first failure of the background fetch, if any."""

    def finish(self) -> None:
        """Wait until every page is in (raising the first failure)."""

    def close(self) -> None:
        """Stop fetching now."""


class LocalPages:
    """Pages images already whole on the local disk."""

    def ensure(self, pages_image: str, offset: int, length: int) -> None:
        pass

    def start(self) -> None:
        pass

    def check(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class StorePages:
    """The pages images of a checkpoint read from the store: a range asked for is fetched at once (in the asking
    thread) unless a background fetch already has it; every other chunk is fetched in the background, in the
    order CRIU's daemon asks for them (the order they were committed in). Each chunk is verified against the
    manifest before it is written to the local image (CheckpointStore.read_chunks)."""

    def __init__(
        self, store: ChunkReader, manifest: Manifest, files: Iterable[FileEntry], images_dir: Path, workers: int = 8
    ) -> None:
        self.store = store
        self.manifest = manifest
        self._starts: dict[str, list[int]] = {}  # pages image -> where each of its chunks starts
        self._chunks: dict[str, tuple[ChunkRef, ...]] = {}
        self._spots: dict[str, list[tuple[int, int]]] = {}  # chunk hash -> (fd, offset) of each place it goes
        self._fds: dict[str, int] = {}
        unique: dict[str, ChunkRef] = {}
        for entry in files:
            if any(chunk.inline is not None for chunk in entry.chunks):
                raise ValueError(f"{entry.path} travels inside the manifest: it is fetched whole, not lazily")
            name = Path(entry.path).name
            fd = self._fds[name] = os.open(images_dir / name, os.O_WRONLY)
            starts, offset = [], 0
            for chunk in entry.chunks:
                starts.append(offset)
                unique.setdefault(chunk.hash, chunk)
                self._spots.setdefault(chunk.hash, []).append((fd, offset))
                offset += chunk.size
            self._starts[name], self._chunks[name] = starts, entry.chunks
        self._paths = {c.hash: name for name, chunks in self._chunks.items() for c in chunks}
        self._reads = read_plan(unique.values())
        self._read_of = {c.hash: index for index, chunks in enumerate(self._reads) for c in chunks}
        self._done: dict[int, Future[None]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="spotcr-lazy-fetch")
        self._background: list[Future[None]] = []
        self.fetched_bytes = 0

    def ensure(self, pages_image: str, offset: int, length: int) -> None:
        if pages_image not in self._starts:
            return  # not left for later: fetched whole and verified with the other images (e.g. one small enough
            # to travel inside the manifest, as a process of few pages has: MPICH's launcher)
        starts, chunks = self._starts[pages_image], self._chunks[pages_image]
        index = bisect_right(starts, offset) - 1
        while index < len(chunks) and starts[index] < offset + length:
            self._read(self._read_of[chunks[index].hash])
            index += 1

    def start(self) -> None:
        self._background = [self._pool.submit(self._read, index) for index in range(len(self._reads))]

    def check(self) -> None:
        for future in self._background:
            if future.done() and not future.cancelled() and (error := future.exception()) is not None:
                raise error

    def finish(self) -> None:
        for future in self._background:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _read(self, index: int) -> None:
        """Fetch read `index` unless it is fetched or being fetched (then wait for it)."""
        with self._lock:
            done = self._done.get(index)
            mine = done is None
            if mine:
                done = self._done[index] = Future()
        assert done is not None
        if not mine:
            done.result()
            return
        try:
            chunks = self._reads[index]
            for chunk, data in zip(
                chunks, self.store.read_chunks(self.manifest, chunks, self._paths[chunks[0].hash]), strict=True
            ):
                self._place(chunk, data)
        except BaseException as error:
            done.set_exception(error)
            raise
        done.set_result(None)

    def _place(self, chunk: ChunkRef, data: bytes) -> None:
        for fd, offset in self._spots[chunk.hash]:
            os.pwrite(fd, data, offset)
        self.fetched_bytes += len(data)


class PageServer:
    """CRIU's page server for `criu lazy-pages --page-server`, on loopback: answers each PS_IOV_GET, in order, with
    the pages once the source has them in the local pages images.

    On a failure it stops answering and sets `failed` (the job then waits on its fault, which is safe): the caller
    kills the job before anything closes the connection (LazyRestore.abort)."""

    def __init__(self, images_dir: Path, pagemaps: dict[int, PageMap], source: PageSource) -> None:
        self.images_dir = images_dir
        self.pagemaps = pagemaps
        self.source = source
        self.failed = threading.Event()
        self.error: BaseException | None = None
        self.served_bytes = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._connection: socket.socket | None = None
        self._files: dict[str, int] = {}
        self._thread = threading.Thread(target=self._serve, name="spotcr-page-server", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close the sockets: only once the job is gone, or every page is in."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        if self._connection is not None:
            with contextlib.suppress(OSError):
                self._connection.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=GONE_TIMEOUT_S)
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def _serve(self) -> None:
        try:
            self._listener.settimeout(0.2)
            while self._connection is None:
                if self._stop.is_set():
                    return
                with contextlib.suppress(TimeoutError):
                    self._connection, _ = self._listener.accept()
            self._connection.settimeout(None)
            self._connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while self._answer(self._connection):
                pass
        except BaseException as error:  # any failure stops the job: it never reads zeros
            if not self._stop.is_set():
                self.error = error
                log.error("the lazy restore's page server failed: %s", error)
                self.failed.set()
                self._stop.wait()  # hold the connection open until the job is gone

    def _answer(self, connection: socket.socket) -> bool:
        header = _receive(connection, HEADER.size)
        if header is None:
            return False
        cmd, pages, vaddr, dst_id = HEADER.unpack(header)
        if cmd in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
            connection.sendall(struct.pack("<i", 0))
            return False
        if cmd & ((1 << PS_CMD_BITS) - 1) != PS_IOV_GET:
            raise LazyRestoreError(f"the lazy-pages daemon sent page-server command {cmd:#x}, not PS_IOV_GET")
        pid = dst_id  # a lazy-pages request names the process by its PID in the images, not encoded (page-xfer.c)
        pagemap = self.pagemaps.get(pid)
        if pagemap is None:
            raise LazyRestoreError(f"the lazy-pages daemon asked for pages of process {pid}, which has no pagemap")
        try:
            ranges = pagemap.ranges(vaddr, pages)
        except ValueError as error:
            raise LazyRestoreError(f"process {pid}: {error}") from None
        chunks = []
        for offset, length in ranges:
            self.source.ensure(pagemap.pages_image, offset, length)
            chunks.append(os.pread(self._fd(pagemap.pages_image), length, offset))
        body = b"".join(chunks)
        if len(body) != pages * PAGE:
            raise LazyRestoreError(f"{pagemap.pages_image} is shorter than its pagemap says")
        connection.sendall(HEADER.pack(PS_IOV_ADD_F | (PE_PRESENT << PS_CMD_BITS), pages, vaddr, dst_id) + body)
        self.served_bytes += len(body)
        return True

    def _fd(self, pages_image: str) -> int:
        if pages_image not in self._files:
            self._files[pages_image] = os.open(self.images_dir / pages_image, os.O_RDONLY)
        return self._files[pages_image]


def _receive(connection: socket.socket, size: int) -> bytes | None:
    """Exactly `size` bytes; None at a clean end of the stream before the first byte."""
    data = b""
    while len(data) < size:
        more = connection.recv(size - len(data))
        if not more:
            if data:
                raise LazyRestoreError("the lazy-pages daemon closed the connection mid-request")
            return None
        data += more
    return data


def kill_tree(pid: int, timeout_s: float = GONE_TIMEOUT_S) -> None:
    """SIGKILL the job's PID 1 (the kernel then kills its whole PID namespace) and wait until it is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while _running(pid):
        if time.monotonic() > deadline:
            raise LazyRestoreError(f"the job (pid {pid}) is still running {timeout_s:.0f} s after SIGKILL")
        time.sleep(0.01)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@dataclass
class LazyTimes:
    """When (time.monotonic) CRIU began, the job ran again and its last page arrived."""

    started: float = field(default_factory=time.monotonic)
    running_at: float = 0.0
    all_pages_at: float = 0.0
    lazy_bytes: int = 0

    @property
    def running_s(self) -> float:
        return self.running_at - self.started

    @property
    def all_pages_s(self) -> float:
        return self.all_pages_at - self.started


@dataclass
class LazyRestore:
    """One lazy restore: the lazy-pages daemon, our page server, `criu restore --lazy-pages`, then the wait for
    the last page. `run` returns the job's PID once every page is in, or raises with the job killed."""

    criu: Criu
    images_dir: Path
    log_dir: Path
    source: PageSource
    images: Images
    times: LazyTimes = field(default_factory=LazyTimes)
    on_running: Callable[[int], None] = lambda pid: None  # tests force interleavings during the lazy phase

    def run(self, restore_argv: Callable[[Path], list[str]]) -> int:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / "restore.pid").unlink(missing_ok=True)
        self.times = LazyTimes(lazy_bytes=self.images.lazy_bytes)
        server = PageServer(self.images_dir, self.images.pagemaps, self.source)
        daemon: subprocess.Popen[bytes] | None = None
        pid = 0
        try:
            server.start()
            daemon = self._start_daemon(server.port)
            self.source.start()
            pid = self._restore(restore_argv(self.log_dir))
            self.times.running_at = time.monotonic()
            self.on_running(pid)
            self._wait_for_pages(daemon, server)
            self.source.finish()
            self.times.all_pages_at = time.monotonic()
            return pid
        except BaseException:
            self.abort(pid, daemon, server)
            raise
        finally:
            self.source.close()
            server.close()
            if daemon is not None and daemon.poll() is None:
                daemon.kill()
                daemon.wait()

    def abort(self, pid: int, daemon: subprocess.Popen[bytes] | None, server: PageServer) -> None:
        """Kill the job first and see it gone; only then may the daemon and the page server stop."""
        if not pid:
            pid = _read_pid(self.log_dir / "restore.pid")
        if pid:
            kill_tree(pid)
        server.failed.set()
        if daemon is not None and daemon.poll() is None:
            daemon.kill()
            daemon.wait()

    def _start_daemon(self, port: int) -> subprocess.Popen[bytes]:
        read, write = os.pipe()
        try:
            argv = [self.criu.binary, "lazy-pages", "-D", str(self.images_dir), "-W", str(self.log_dir)]
            argv += ["-o", "lazy-pages.log", "-v4", "--page-server", "--address", "127.0.0.1", "--port", str(port)]
            argv += ["--status-fd", str(write)]
            daemon = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(write,))
        finally:
            os.close(write)
        try:
            ready, _, _ = select.select([read], [], [], READY_TIMEOUT_S)
            if not ready or not os.read(read, 1):
                daemon.kill()
                daemon.wait()
                raise failure("lazy-pages", self.log_dir / "lazy-pages.log", "the lazy-pages daemon did not start")
        finally:
            os.close(read)
        return daemon

    def _restore(self, argv: list[str]) -> int:
        """`criu restore --lazy-pages`: returns once the tree runs. A page-server failure meanwhile is acted on
        after it returns, when the job's PID is known (the tasks touch no lazy page before they resume)."""
        result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise failure("restore", self.log_dir / "restore.log", result.stderr)
        return int((self.log_dir / "restore.pid").read_text().strip())

    def _wait_for_pages(self, daemon: subprocess.Popen[bytes], server: PageServer) -> None:
        """Until the daemon has put every page in and exited; a failure of the page server fails the restore."""
        while daemon.poll() is None:
            self.source.check()
            if server.failed.wait(0.05):
                raise _failure(server)
        self.source.check()
        if server.failed.is_set():
            raise _failure(server)
        if daemon.returncode != 0:
            raise failure("lazy-pages", self.log_dir / "lazy-pages.log", "")


def _failure(server: PageServer) -> BaseException:
    """The page server's failure as the restore walk knows it: a store error (retried, or the checkpoint skipped)
    as itself, anything else as a LazyRestoreError."""
    if isinstance(server.error, StoreError):
        return server.error
    return LazyRestoreError(f"serving the job's pages failed: {server.error}")


def _read_pid(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0
