"""The lazy restore's page server and images, without CRIU: CRIU's pagemap images read as CRIU writes them, and
its page-server protocol answered as `criu lazy-pages` expects (criu/page-xfer.c), by a client on loopback."""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path

import pytest
from spotcr_agent.lazy import (
    HEADER,
    PAGE,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    PS_IOV_ADD_F,
    PS_IOV_CLOSE,
    PS_IOV_GET,
    Images,
    LazyUnsupported,
    LocalPages,
    PageServer,
    StorePages,
)
from spotcr_agent.store import CorruptCheckpoint, Manifest

MAGICS = struct.pack("<II", 0x54564319, 0x56084025)  # IMG_COMMON_MAGIC, PAGEMAP_MAGIC


def _varint(value: int) -> bytes:
    out = b""
    while True:
        byte, value = value & 0x7F, value >> 7
        out += bytes([byte | (0x80 if value else 0)])
        if not value:
            return out


def _entry(*fields: tuple[int, int]) -> bytes:
    body = b"".join(_varint(number << 3) + _varint(value) for number, value in fields)
    return struct.pack("<I", len(body)) + body


def _pagemap(path: Path, pages_id: int, runs: list[tuple[int, int, int]]) -> None:
    """A pagemap image: its head (pages_id), then (vaddr, nr_pages, flags) entries."""
    path.write_bytes(MAGICS + _entry((1, pages_id)) + b"".join(_entry((1, v), (2, n), (4, f)) for v, n, f in runs))


LAZY = PE_LAZY | PE_PRESENT


@pytest.fixture
def images_dir(tmp_path):
    """Process 1: a stack page (eager), then 3 lazy pages and 2 more lazy pages elsewhere; pages image 7."""
    _pagemap(tmp_path / "pagemap-1.img", 7, [(0x1000, 1, PE_PRESENT), (0x10000, 3, LAZY), (0x20000, 2, LAZY)])
    (tmp_path / "pages-7.img").write_bytes(b"".join(bytes([n]) * PAGE for n in range(6)))
    return tmp_path


def test_pagemaps_say_which_pages_come_lazily_and_where_each_is_stored(images_dir):
    images = Images.read(images_dir)
    pagemap = images.pagemaps[1]
    assert pagemap.pages_image == "pages-7.img"
    assert images.eager == {"pages-7.img": [(0, PAGE)]}  # CRIU restores the stack itself
    assert images.lazy_bytes == 5 * PAGE
    # A range inside a run maps to its place in the pages image (after the 1 eager and 1 lazy page before it)
    assert pagemap.ranges(0x11000, 2) == [(2 * PAGE, 2 * PAGE)]
    with pytest.raises(ValueError, match=r"not in pages-7\.img"):
        pagemap.ranges(0x12000, 2)  # runs past the run's end, into pages the checkpoint does not have


def test_pages_in_a_parent_checkpoint_are_restored_whole(tmp_path):
    _pagemap(tmp_path / "pagemap-1.img", 1, [(0x1000, 1, PE_PARENT)])
    with pytest.raises(LazyUnsupported, match="parent"):
        Images.read(tmp_path)


class _Daemon:
    """The lazy-pages daemon's side of the connection."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))

    def get(self, pid: int, vaddr: int, pages: int) -> None:
        self.sock.sendall(HEADER.pack(PS_IOV_GET, pages, vaddr, pid))

    def answer(self) -> tuple[tuple[int, int, int, int], bytes]:
        header = self._read(HEADER.size)
        cmd, pages, vaddr, dst_id = HEADER.unpack(header)
        return (cmd, pages, vaddr, dst_id), self._read(pages * PAGE)

    def _read(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            more = self.sock.recv(size - len(data))
            assert more, "the page server closed the connection"
            data += more
        return data


def test_requests_are_answered_in_order_with_the_pages_and_close_is_acknowledged(images_dir):
    server = PageServer(images_dir, Images.read(images_dir).pagemaps, LocalPages())
    server.start()
    daemon = _Daemon(server.port)
    try:
        # When the daemon asks for two ranges before reading either answer
        daemon.get(1, 0x20000, 2)
        daemon.get(1, 0x10000, 1)
        # Then each answer is PS_IOV_ADD_F with PE_PRESENT, naming what was asked, with the stored pages
        first, pages = daemon.answer()
        assert first == (PS_IOV_ADD_F | PE_PRESENT << 16, 2, 0x20000, 1)
        assert pages == bytes([4]) * PAGE + bytes([5]) * PAGE
        second, pages = daemon.answer()
        assert second[1:] == (1, 0x10000, 1) and pages == bytes([1]) * PAGE
        # And a close is answered with status 0
        daemon.sock.sendall(HEADER.pack(PS_IOV_CLOSE, 0, 0, 0))
        assert struct.unpack("<i", daemon._read(4)) == (0,)
        assert not server.failed.is_set() and server.served_bytes == 3 * PAGE
    finally:
        daemon.sock.close()
        server.close()


class _FailingPages(LocalPages):
    def __init__(self) -> None:
        self.asked = threading.Event()

    def ensure(self, pages_image: str, offset: int, length: int) -> None:
        self.asked.set()
        raise CorruptCheckpoint("1795293235815-g1-periodic", "chunk ab of images/pages-7.img does not match its hash")


def test_a_failed_fetch_stops_the_answers_but_holds_the_connection_open_until_told(images_dir):
    # Given pages whose fetch fails
    server = PageServer(images_dir, Images.read(images_dir).pagemaps, _FailingPages())
    server.start()
    daemon = _Daemon(server.port)
    try:
        # When the daemon asks for them
        daemon.get(1, 0x10000, 1)
        # Then the server says it failed, with the store's error, and sends nothing: the connection stays open (a
        # closed one would let the kernel fill the job's memory with zeros) until the job is gone
        assert server.failed.wait(10)
        assert isinstance(server.error, CorruptCheckpoint)
        daemon.sock.settimeout(0.2)
        with pytest.raises(TimeoutError):
            daemon.sock.recv(1)
    finally:
        server.close()
        daemon.sock.close()


def test_a_request_for_pages_the_checkpoint_lacks_fails_the_server(images_dir):
    server = PageServer(images_dir, Images.read(images_dir).pagemaps, LocalPages())
    server.start()
    daemon = _Daemon(server.port)
    try:
        daemon.get(2, 0x10000, 1)  # no process 2 in the images
        assert server.failed.wait(10)
        assert "process 2" in str(server.error)
    finally:
        server.close()
        daemon.sock.close()


def test_a_pages_image_not_left_for_later_is_taken_as_whole(tmp_path):
    # Given a checkpoint of two processes where only one pages image is left for later: the other (a process of few
    # pages, its image inside the manifest) was fetched whole with the rest
    class NoReads:
        def read_chunks(self, manifest, chunks, path):
            raise AssertionError(f"{path} was read from the store")

    manifest = Manifest(
        job_id="job-1",
        checkpoint_id="c1",
        generation=1,
        kind="final",
        parent=None,
        created_at="2026-11-26T00:00:00Z",
        criu_version="4.1.1",
        kernel="6.18",
        arch="x86_64",
        cpu_flags=(),
        open_files=(),
        files=(),
        compression="zstd-1",
    )
    source = StorePages(NoReads(), manifest, [], tmp_path)

    # When a range of the whole image is asked for, it is there at once: nothing is read from the store
    source.ensure("pages-6.img", 0, PAGE)
