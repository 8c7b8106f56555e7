"""Packed chunks: few requests per GiB, ranged reads of live chunks only, format-1 stores still restore, and
garbage collection of packs under a commit in flight."""

from __future__ import annotations

import base64
import hashlib
import json
import mmap
import shutil
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest
import zstandard
from botocore import httpchecksum
from botocore.exceptions import ClientError
from spotcr_agent.store import CheckpointStore, CorruptCheckpoint, DirectoryBackend, chunking
from spotcr_agent.store import store as store_module
from spotcr_agent.store.backends import SEND_BLOCK, _ViewReader, crc32_header
from spotcr_agent.store.chunking import Chunker, Chunking
from spotcr_agent.store.manifest import CHUNK_HASHES
from spotcr_agent.store.store import FETCH_RANGE

from tests.localaws.vended import Enforced

from .support import JOB, RUN, MiB, checkpoint_id, images, meta, random_bytes, run_keys, tree_bytes


class Counting:
    """A backend that counts the requests the store makes of it, and passes them on."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.puts: list[str] = []
        self.gets: list[str] = []
        self.ranges: list[tuple[str, int, int]] = []

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.puts.append(key)
        self.backend.put(key, data)

    def put_new(self, key: str, data: bytes) -> None:
        self.puts.append(key)
        self.backend.put_new(key, data)

    def get(self, key: str) -> bytes:
        self.gets.append(key)
        return bytes(self.backend.get(key))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        self.ranges.append((key, offset, length))
        return bytes(self.backend.get_range(key, offset, length))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


def counted(store: CheckpointStore) -> Counting:
    store.backend = counting = Counting(store.backend)
    return counting


def test_new_data_is_sent_in_packs_of_tens_of_mib(store: CheckpointStore, tmp_path: Path) -> None:
    # Given 40 MiB of memory that does not compress
    (tmp_path / "img").mkdir()
    (tmp_path / "img/pages-1.img").write_bytes(random_bytes(40 * MiB, seed=40))
    requests = counted(store)

    # When it is committed
    result = store.commit(tmp_path / "img", meta(1))

    # Then its chunks (tens of them) cost two PUTs, a full pack and the rest: 32 PUTs per GiB, not 800
    packs = [key for key in requests.puts if "/chunks/" in key]
    assert result.chunks_uploaded > 20 and len(packs) == result.objects_uploaded == 2
    assert requests.puts == [f"{run_keys(store)}commits/{checkpoint_id(1)}", *packs, requests.puts[-1]]
    assert requests.puts[-1].endswith(f"checkpoints/{checkpoint_id(1)}.json")


def test_a_restore_reads_only_the_chunks_it_needs_in_few_ranged_reads(store: CheckpointStore, tmp_path: Path) -> None:
    # Given a checkpoint of 16 MiB, and a second one where 2 MiB in the middle changed
    pages = bytearray(random_bytes(16 * MiB, seed=41))
    (tmp_path / "img").mkdir()
    (tmp_path / "img/pages-1.img").write_bytes(pages)
    store.commit(tmp_path / "img", meta(1))
    pages[7 * MiB : 9 * MiB] = random_bytes(2 * MiB, seed=42)
    (tmp_path / "img/pages-1.img").write_bytes(pages)
    second = store.commit(tmp_path / "img", meta(2, parent=1))
    requests = counted(store)

    # When the second one is restored
    store.fetch(checkpoint_id(2), tmp_path / "restore")

    # Then it read exactly its chunks' bytes (none of the first pack's replaced chunks), adjacent chunks in one
    # ranged read of at most FETCH_RANGE, and restored byte for byte
    assert (tmp_path / "restore/images/pages-1.img").read_bytes() == pages
    chunks = second.manifest.stored_chunks().values()
    assert sum(length for _, _, length in requests.ranges) == sum(c.stored for c in chunks)
    assert requests.gets == [f"{run_keys(store)}checkpoints/{checkpoint_id(2)}.json"]
    assert len(requests.ranges) <= 6 < len(chunks)
    assert max(length for _, _, length in requests.ranges) <= FETCH_RANGE


def write_format_1(store: CheckpointStore, n: int, files: dict[str, bytes]) -> None:
    """Commit as the store did before packs (manifest format 1): each chunk its own object under chunks/<h[:2]>/<h>."""
    entries = []
    compressor = zstandard.ZstdCompressor(level=1)
    for path, content in files.items():
        chunker = Chunker(Chunking())
        chunks = [bytes(c) for c in [*chunker.feed(content), *chunker.finish()]]
        refs = []
        for chunk in chunks:
            digest = hashlib.sha256(chunk).hexdigest()
            store.backend.put(f"{run_keys(store)}chunks/{digest[:2]}/{digest}", compressor.compress(chunk))
            refs.append({"hash": digest, "size": len(chunk)})
        digest = hashlib.sha256(b"".join(bytes.fromhex(r["hash"]) for r in refs)).hexdigest()  # type: ignore[arg-type]
        entries.append({"path": path, "size": len(content), "mode": 0o600, "digest": digest, "chunks": refs})
    doc = {
        "format": 1,
        "job_id": JOB,
        "checkpoint_id": checkpoint_id(n),
        "generation": 1,
        "kind": "periodic",
        "parent": None,
        "created_at": "2026-11-20T10:00:00.000+00:00",
        "criu_version": "4.1.1",
        "kernel": "6.18.0",
        "arch": "x86_64",
        "cpu_flags": [],
        "open_files": [],
        "hash": "sha256",
        "compression": "zstd-1",
        "chunking": Chunking().describe(),
        "files": entries,
        "since_full": 0,
        "run_id": RUN,
    }
    store.backend.put_new(f"{run_keys(store)}checkpoints/{checkpoint_id(n)}.json", json.dumps(doc).encode())


def test_a_store_written_before_packs_restores_and_prune_keeps_the_chunk_objects_it_uses(
    store: CheckpointStore, tmp_path: Path
) -> None:
    # Given two checkpoints committed in format 1 (a chunk per object, SHA-256 ids), the second one the first's
    # memory plus a new file
    old, new = random_bytes(3 * MiB, seed=43), random_bytes(MiB, seed=44)
    write_format_1(store, 1, {"images/pages-1.img": old})
    write_format_1(store, 2, {"images/pages-1.img": old, "images/pages-44.img": new})
    objects = {o.key for o in store.backend.scan(f"{run_keys(store)}chunks/")}

    # When this agent restores the first, then commits the same memory on top of the second
    store.fetch(checkpoint_id(1), tmp_path / "restore1")
    images(tmp_path / "img", 44)
    (tmp_path / "img/pages-1.img").write_bytes(old)
    third = store.commit(tmp_path / "img", meta(3, parent=2))

    # Then the old checkpoint restores byte for byte; the new one, whose chunks go by BLAKE3 ids, sends them all
    # into packs as a fresh full checkpoint; and prune keeps the chunk objects the kept format-1 checkpoint uses
    assert (tmp_path / "restore1/images/pages-1.img").read_bytes() == old
    assert third.manifest.hash == "blake3" and third.manifest.since_full == 0
    assert all(c.pack is not None for c in third.manifest.stored_chunks().values())
    assert store.prune(keep=2, grace_seconds=0).deleted_checkpoints == [checkpoint_id(1)]
    assert {o.key for o in store.backend.scan(f"{run_keys(store)}chunks/")} >= objects
    for n in (2, 3):
        store.fetch(checkpoint_id(n), tmp_path / f"restore{n}")
        assert tree_bytes(tmp_path / f"restore{n}/images") == {"pages-1.img": old, "pages-44.img": new}


def test_a_prune_while_a_commit_has_written_packs_but_no_manifest_deletes_nothing(
    make_store: Callable[..., CheckpointStore], tmp_path: Path
) -> None:
    # Given an old checkpoint whose pack is garbage once a newer one exists, and a commit of new memory
    pruner, committer = make_store(), make_store()
    pruner.commit(images(tmp_path / "img1", 1), meta(1))
    pruner.commit(images(tmp_path / "img2", 2), meta(2, parent=1))
    pruned: list[Any] = []
    write_manifest = committer.backend.put_new

    def prune_first(key: str, data: bytes) -> None:
        pruned.append(pruner.prune(keep=1, grace_seconds=0))
        write_manifest(key, data)

    # When a prune runs at the worst moment: the commit's packs are written, its manifest not yet
    committer.backend.put_new = prune_first  # type: ignore[method-assign]
    committer.commit(images(tmp_path / "img3", 3), meta(3, parent=2))

    # Then prune saw the commit in flight and deleted nothing, neither its unreferenced new packs nor old ones,
    # and the new checkpoint restores
    assert [(p.deleted_checkpoints, p.deleted_chunks) for p in pruned] == [([], 0)]
    committer.fetch(checkpoint_id(3), tmp_path / "restore")
    assert (tmp_path / "restore/images/pages-3.img").read_bytes() == random_bytes(MiB, seed=3)


def test_s3_checks_each_put_by_crc32_not_a_second_sha256(s3_iam: Enforced, tmp_path: Path) -> None:
    # Given a store in S3 (over plain http here, where botocore signs a SHA-256 of each body unless told not to)
    store = CheckpointStore.for_s3(s3_iam.bucket, JOB, session=s3_iam.store_session(JOB, RUN), run_id=RUN)
    signed: list[bytes] = []
    store.backend.client.meta.events.register(  # type: ignore[attr-defined]
        "before-send.s3.PutObject", lambda request, **_: signed.append(request.headers["x-amz-content-sha256"])
    )

    # When a checkpoint is committed
    store.commit(images(tmp_path / "img", 1), meta(1))

    # Then S3 was told to verify its pack and manifest by CRC32 (cheap), not by a SHA-256 of the body, and no
    # body was hashed for the request's signature either
    for key in (f"chunks/packs/{store.load(checkpoint_id(1)).packs()[0]}", f"checkpoints/{checkpoint_id(1)}.json"):
        head = boto3.client("s3").head_object(Bucket=s3_iam.bucket, Key=run_keys(store) + key, ChecksumMode="ENABLED")
        assert "ChecksumCRC32" in head and "ChecksumSHA256" not in head, key
    assert signed and set(signed) == {b"UNSIGNED-PAYLOAD"}


def test_s3_is_given_each_pack_s_crc32_so_botocore_reads_no_body_twice(
    s3_iam: Enforced, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a store in S3, and botocore's own checksum pass watched
    store = CheckpointStore.for_s3(s3_iam.bucket, JOB, session=s3_iam.store_session(JOB, RUN), run_id=RUN)
    computed: list[int] = []
    handle = httpchecksum.BaseChecksum.handle

    def watched(checksum: Any, body: Any) -> Any:
        computed.append(_size(body))
        return handle(checksum, body)

    monkeypatch.setattr(httpchecksum.BaseChecksum, "handle", watched)

    # When a checkpoint of several packs is committed
    store.pack_size = MiB // 2
    store.commit(images(tmp_path / "img", 1, 2), meta(1))

    # Then botocore read no pack for a checksum (only DeleteObjects' few bytes of XML, which S3 requires one of), and
    # S3 checked (and keeps) each pack by the CRC32 the store gave
    assert computed and max(computed) < 1024
    client = boto3.client("s3")
    packs = store.load(checkpoint_id(1)).packs()
    assert len(packs) > 2
    for pack in packs:
        key = run_keys(store) + f"chunks/packs/{pack}"
        head = client.head_object(Bucket=s3_iam.bucket, Key=key, ChecksumMode="ENABLED")
        body = client.get_object(Bucket=s3_iam.bucket, Key=key)["Body"].read()
        assert head["ChecksumCRC32"] == base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()


def _size(body: Any) -> int:
    if isinstance(body, (bytes, bytearray)):
        return len(body)
    at = body.tell()
    end = int(body.seek(0, 2))
    body.seek(at)
    return end


def test_s3_refuses_a_put_whose_crc32_is_not_its_body_s(s3_iam: Enforced) -> None:
    # Given the store's S3 client, as a job's store credentials use it
    store = CheckpointStore.for_s3(s3_iam.bucket, JOB, session=s3_iam.store_session(JOB, RUN), run_id=RUN)
    client = store.backend.client  # type: ignore[attr-defined]

    # When a body goes with another body's CRC32, then S3 refuses it: the header is the check, not decoration
    with pytest.raises(ClientError, match=r"BadDigest|InvalidRequest|checksum"):
        client.put_object(
            Bucket=s3_iam.bucket,
            Key=run_keys(store) + "chunks/packs/x",
            Body=b"pack",
            ChecksumAlgorithm="CRC32",
            ChecksumCRC32=crc32_header(b"other"),
        )


def test_a_final_dump_finds_what_did_not_change_by_fast_digest(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a periodic checkpoint of 16 MiB, each chunk with its fast digest
    pages = bytearray(random_bytes(16 * MiB, seed=50))
    (tmp_path / "img").mkdir()
    (tmp_path / "img/pages-1.img").write_bytes(pages)
    first = store.commit(tmp_path / "img", meta(1))
    assert all(c.fast for c in first.manifest.stored_chunks().values())

    # When one byte in the middle changes (same length, same place) and the final dump follows
    pages[8 * MiB] ^= 0xFF
    (tmp_path / "img/pages-1.img").write_bytes(pages)
    scanned, crc32 = list[int](), zlib.crc32

    def counted_crc32(sample: memoryview) -> int:
        scanned.append(len(sample))
        return crc32(sample)

    monkeypatch.setattr(chunking.zlib, "crc32", counted_crc32)
    final = store.commit(tmp_path / "img", meta(2, parent=1, kind="final"))

    # Then every other chunk but the last (which ends where the file did, not at a boundary) was taken as the
    # parent's by its place and fast digest, neither given a chunk id nor its pages scanned for a boundary; the
    # changed one was cut, hashed and sent; and the final dump restores byte for byte
    assert (final.chunks_uploaded, final.chunks_unchanged) == (1, final.chunks_total - 2)
    assert len(scanned) < 2 * Chunking().max_size // chunking.PAGE < len(pages) // chunking.PAGE
    store.fetch(final.checkpoint_id, tmp_path / "restore")
    assert (tmp_path / "restore/images/pages-1.img").read_bytes() == pages


@pytest.mark.parametrize("mount", ["disk", "tmpfs"])
@pytest.mark.parametrize("memory", ["page-aligned", "unaligned"])
def test_a_directory_store_writes_a_pack_byte_for_byte_past_or_through_the_page_cache(
    mount: str, memory: str, tmp_path: Path
) -> None:
    # Given a pack of 3 MiB and a partial block, in page-aligned memory (as the store fills packs: O_DIRECT for its
    # whole blocks) or not (refused by O_DIRECT: the page cache), bound for a disk or tmpfs (O_DIRECT by its own
    # rules, or none before Linux 6.6)
    body = random_bytes(3 * MiB + 1234, seed=50)
    if memory == "page-aligned":
        buffer = mmap.mmap(-1, len(body))
        buffer[:] = body
        view = memoryview(buffer)
    else:
        view = memoryview(bytearray(b"x" + body))[1:]
    root = Path(tempfile.mkdtemp(dir="/dev/shm")) if mount == "tmpfs" else tmp_path
    try:
        backend = DirectoryBackend(root)

        # When it is put, and the store flushed
        backend.put("run/chunks/packs/p1", view)
        backend.flush()

        # Then the object holds exactly those bytes
        assert (root / "run/chunks/packs/p1").read_bytes() == body
    finally:
        if mount == "tmpfs":
            shutil.rmtree(root)


def test_an_s3_put_hands_a_pack_to_the_connection_uncopied_in_large_blocks() -> None:
    # Given a pack in page-aligned memory, as the store fills packs, read as an S3 put's body
    buffer = mmap.mmap(-1, 3 * SEND_BLOCK + 1234)
    buffer[:] = random_bytes(len(buffer), seed=52)
    reader = _ViewReader(memoryview(buffer))

    # When urllib3 reads it, asking for its 16 KiB blocks
    blocks = []
    while block := reader.read(16 * 1024):
        blocks.append(block)

    # Then each block is the pack's own memory, SEND_BLOCK long but the last, and together they are the pack
    assert all(isinstance(block, memoryview) and block.obj is buffer for block in blocks)
    assert [len(block) for block in blocks] == [SEND_BLOCK, SEND_BLOCK, SEND_BLOCK, 1234]
    assert b"".join(blocks) == buffer[:]

    # And after a retry's seek back to the start, readinto fills exactly the buffer it is given
    reader.seek(0)
    into = bytearray(100)
    assert reader.readinto(into) == 100 and into == buffer[:100] and reader.tell() == 100


def test_a_checkpoint_with_sha256_chunk_ids_restores_verified_by_them(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a packed checkpoint as format 2 wrote it (chunks named by SHA-256), and a copy naming one chunk wrongly
    monkeypatch.setattr(store_module, "chunk_id", CHUNK_HASHES["sha256"])
    content = random_bytes(3 * MiB, seed=51)
    images(tmp_path / "img")
    (tmp_path / "img/pages-1.img").write_bytes(content)
    doc = json.loads(store.commit(tmp_path / "img", meta(1)).manifest.to_json())
    chunks = doc["files"][0]["chunks"]
    misnamed = [{**chunks[0], "hash": CHUNK_HASHES["sha256"](b"another chunk")}, *chunks[1:]]
    for n, listed in ((2, chunks), (3, misnamed)):
        files = [{**doc["files"][0], "chunks": listed}]
        files[0]["digest"] = hashlib.sha256(b"".join(bytes.fromhex(c["hash"]) for c in listed)).hexdigest()
        copy = doc | {"format": 2, "hash": "sha256", "checkpoint_id": checkpoint_id(n), "files": files}
        store.backend.put_new(f"{run_keys(store)}checkpoints/{checkpoint_id(n)}.json", json.dumps(copy).encode())

    # When this agent restores it, Then it restores byte for byte, each chunk checked against its SHA-256
    store.fetch(checkpoint_id(2), tmp_path / "restore")
    assert (tmp_path / "restore/images/pages-1.img").read_bytes() == content
    with pytest.raises(CorruptCheckpoint, match="does not match its hash"):
        store.fetch(checkpoint_id(3), tmp_path / "restore3")
