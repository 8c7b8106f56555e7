"""The checkpoint store against both backends: round trip, dedup, streaming, commit rules and bad input."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from spotcr_agent.store import (
    CheckpointExists,
    CheckpointNotFound,
    CheckpointStore,
    CommitAbandoned,
    CommitProgress,
    CorruptCheckpoint,
    StoreUnavailable,
    UnsupportedManifest,
)
from spotcr_contracts import commands, tags

from tests.store.support import run_keys

from .support import JOB, MiB, checkpoint_id, damage_chunk, meta, random_bytes, tree_bytes
from .support import images as seeded_images


def write_images(image_dir: Path, pages: bytes) -> None:
    """A CRIU-like image set: one big pages file and a handful of tiny protobuf-sized files."""
    image_dir.mkdir(parents=True, exist_ok=True)
    (image_dir / "pages-1.img").write_bytes(pages)
    (image_dir / "core-1.img").write_bytes(random_bytes(900, seed=11))
    (image_dir / "mm-1.img").write_bytes(random_bytes(5000, seed=12) + bytes(3000))
    (image_dir / "pagemap-1.img").write_bytes(random_bytes(200 * 1024, seed=13))
    (image_dir / "inventory.img").write_bytes(b"")
    (image_dir / "sub").mkdir(exist_ok=True)
    (image_dir / "sub" / "tty.img").write_bytes(b"\x01\x02")


def mixed_pages() -> bytes:
    """Random, zero and repeated content, so compression and in-checkpoint dedup both get exercised."""
    return random_bytes(3 * MiB, seed=1) + bytes(2 * MiB) + random_bytes(64 * 1024, seed=2) * 32 + b"tail"


def test_round_trip_is_byte_identical(store: CheckpointStore, tmp_path: Path) -> None:
    # Given an image directory and a work dir file
    images = tmp_path / "img"
    write_images(images, mixed_pages())
    os.chmod(images / "core-1.img", 0o640)
    log = tmp_path / "out.log"
    log.write_bytes(b"step 1\nstep 2\n")

    # When it is committed and fetched elsewhere
    result = store.commit(images, meta(1), extra_files={"workdir/out.log": log})
    manifest = store.fetch(result.checkpoint_id, tmp_path / "restore")

    # Then every file comes back byte for byte, with its mode, under images/ and workdir/
    fetched = tree_bytes(tmp_path / "restore")
    expected = {f"images/{k}": v for k, v in tree_bytes(images).items()} | {"workdir/out.log": log.read_bytes()}
    assert fetched == expected
    assert (tmp_path / "restore/images/core-1.img").stat().st_mode & 0o777 == 0o640
    assert manifest.checkpoint_id == result.checkpoint_id
    assert result.bytes_total == sum(len(v) for v in expected.values())
    # Half-zero, partly repeated content: compression and dedup send far less than the images hold
    assert result.bytes_uploaded < 0.6 * result.bytes_total
    # Tiny files ride inside the manifest rather than costing a PUT each
    by_path = {f.path: f for f in manifest.files}
    assert all(c.inline is not None for f in ("images/core-1.img", "images/sub/tty.img") for c in by_path[f].chunks)
    assert by_path["images/inventory.img"].chunks == ()
    # Every chunk sent went into one pack: one PUT for them all
    assert result.chunks_uploaded == len(manifest.chunk_hashes())
    assert len(list(store.backend.scan(f"{run_keys(store)}chunks/"))) == result.objects_uploaded == 1


def test_manifest_records_the_checkpoint_and_is_listed_newest_first(store: CheckpointStore, tmp_path: Path) -> None:
    images = tmp_path / "img"
    write_images(images, random_bytes(MiB, seed=3))
    store.commit(images, meta(1))
    store.commit(images, meta(2, parent=1, kind="final"))

    listed = store.checkpoints()

    assert [m.checkpoint_id for m in listed] == [checkpoint_id(2, kind="final"), checkpoint_id(1)]
    newest = listed[0]
    assert (newest.format, newest.job_id, newest.generation, newest.kind) == (3, store.job_id, 1, "final")
    assert newest.parent == checkpoint_id(1)
    assert (newest.criu_version, newest.kernel, newest.arch) == ("4.1.1", "6.18.0", "x86_64")
    assert newest.cpu_flags == ("sse4_2", "avx2")
    assert [(f.path, f.size) for f in newest.open_files] == [("/work/out.log", 12)]
    # A periodic checkpoint at the store's level, a final dump (racing the notice) at the fast level
    assert (listed[1].compression, newest.compression) == ("zstd-1", "zstd--1")
    assert newest.created_at.endswith("+00:00")
    raw = json.loads(store.backend.get(f"{run_keys(store)}checkpoints/{newest.checkpoint_id}.json"))
    assert raw["format"] == 3
    assert {"path", "size", "mode", "digest", "chunks"} <= set(raw["files"][0])


def test_second_checkpoint_sends_only_the_changed_region(store: CheckpointStore, tmp_path: Path) -> None:
    # Given a committed checkpoint of 64 MiB of memory
    images = tmp_path / "img"
    pages = bytearray(random_bytes(64 * MiB, seed=4))
    write_images(images, bytes(pages))
    first = store.commit(images, meta(1))

    # When 5% of it changes in one region and the job is checkpointed again
    start = 30 * MiB
    pages[start : start + len(pages) // 20] = random_bytes(len(pages) // 20, seed=5)
    (images / "pages-1.img").write_bytes(bytes(pages))
    second = store.commit(images, meta(2, parent=1))

    # Then only about that region is sent, by the store's own count, and the result is exact
    assert second.bytes_uploaded <= 0.10 * first.bytes_uploaded
    assert second.chunks_uploaded < 0.15 * second.chunks_total
    store.fetch(second.checkpoint_id, tmp_path / "restore")
    assert (tmp_path / "restore/images/pages-1.img").read_bytes() == pages


def test_a_commit_tells_its_progress_and_stops_before_its_manifest_when_told_to(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a committed checkpoint, then a quarter of its 64 MiB rewritten, with progress told at every chunk
    monkeypatch.setattr("spotcr_agent.store.store.PROGRESS_S", 0.0)
    images = tmp_path / "img"
    pages = bytearray(random_bytes(64 * MiB, seed=4))
    write_images(images, bytes(pages))
    store.commit(images, meta(1))
    pages[: 16 * MiB] = random_bytes(16 * MiB, seed=5)
    (images / "pages-1.img").write_bytes(bytes(pages))
    total = sum(p.stat().st_size for p in images.rglob("*") if p.is_file())

    # When the next commit is let go on
    seen: list[CommitProgress] = []

    def keep_going(progress: CommitProgress) -> bool:
        seen.append(progress)
        return True

    store.commit(images, meta(2, parent=1), keep_going=keep_going)

    # Then it was told how far it was, of all it reads, and how much of what it hashed had changed
    assert len(seen) > 10 and {p.total for p in seen} == {total}
    assert [p.done for p in seen] == sorted(p.done for p in seen) and 0 < seen[-1].done <= total
    assert 0 < seen[-1].changed <= 17 * MiB

    # And when a third is told to stop at its first report
    (images / "pages-1.img").write_bytes(random_bytes(64 * MiB, seed=6))
    with pytest.raises(CommitAbandoned, match="abandoned before its manifest"):
        store.commit(images, meta(3, parent=2), keep_going=lambda progress: False)

    # Then nothing of it is committed, no commit of it is left in flight, and the one before still restores whole
    assert store.checkpoint_ids() == [checkpoint_id(2), checkpoint_id(1)]
    assert not list(store.backend.scan(f"{run_keys(store)}commits/"))
    store.fetch(checkpoint_id(2), tmp_path / "restore")
    assert (tmp_path / "restore/images/pages-1.img").read_bytes() == pages


def test_pages_inserted_early_do_not_resend_everything_after(store: CheckpointStore, tmp_path: Path) -> None:
    # Given a committed checkpoint
    images = tmp_path / "img"
    pages = random_bytes(32 * MiB, seed=6)
    write_images(images, pages)
    first = store.commit(images, meta(1))

    # When the job touches 16 new pages early in its address space, shifting every later page
    shifted = pages[: 5 * MiB] + random_bytes(16 * 4096, seed=7) + pages[5 * MiB :]
    (images / "pages-1.img").write_bytes(shifted)
    second = store.commit(images, meta(2, parent=1))

    # Then content-defined boundaries resynchronise: only chunks around the insertion are sent
    assert second.bytes_uploaded <= 0.15 * first.bytes_uploaded
    store.fetch(second.checkpoint_id, tmp_path / "restore")
    assert (tmp_path / "restore/images/pages-1.img").read_bytes() == shifted


def test_commit_streams_files_while_they_are_written(store: CheckpointStore, tmp_path: Path) -> None:
    # Given CRIU still writing: a pages file growing in blocks, and a file that appears late
    images = tmp_path / "img"
    images.mkdir()
    blocks = [random_bytes(700 * 1024, seed=20 + i) for i in range(12)]

    def criu_writing() -> None:
        with open(images / "pages-1.img", "ab") as pages:
            for i, block in enumerate(blocks):
                pages.write(block)
                pages.flush()
                if i == 6:
                    (images / "core-1.img").write_bytes(b"late")
                time.sleep(0.03)

    writer = threading.Thread(target=criu_writing)
    writer.start()

    # When the store commits while the writer is alive
    result = store.commit(images, meta(1), still_writing=writer.is_alive)
    writer.join()

    # Then the checkpoint holds the final files exactly
    store.fetch(result.checkpoint_id, tmp_path / "restore")
    assert tree_bytes(tmp_path / "restore") == {"images/pages-1.img": b"".join(blocks), "images/core-1.img": b"late"}


@pytest.mark.claim("Restore walks back past damaged checkpoints")
@pytest.mark.parametrize("damage", ["bit-flip", "truncate", "delete"])
def test_damaged_chunk_is_named_by_corrupt_checkpoint(store: CheckpointStore, tmp_path: Path, damage: str) -> None:
    # Given a committed checkpoint
    images = tmp_path / "img"
    write_images(images, random_bytes(4 * MiB, seed=8))
    result = store.commit(images, meta(1))
    chunks = result.manifest.stored_chunks()
    victim = sorted(chunks)[1]

    # When one stored chunk is damaged (its pack cut short inside it, or deleted)
    damage_chunk(store, chunks[victim], damage)

    # Then fetching it fails, naming the chunk (or the pack, gone), and leaves no half-restored images behind
    with pytest.raises(CorruptCheckpoint, match=chunks[victim].pack if damage == "delete" else victim) as raised:
        store.fetch(result.checkpoint_id, tmp_path / "restore")
    assert raised.value.checkpoint_id == result.checkpoint_id
    assert tree_bytes(tmp_path / "restore") == {}


def test_a_committed_checkpoint_is_never_overwritten(store: CheckpointStore, tmp_path: Path) -> None:
    images = tmp_path / "img"
    write_images(images, random_bytes(MiB, seed=9))
    store.commit(images, meta(1))
    (images / "pages-1.img").write_bytes(b"a zombie's different memory")

    with pytest.raises(CheckpointExists, match=checkpoint_id(1)):
        store.commit(images, meta(1))

    store.fetch(checkpoint_id(1), tmp_path / "restore")
    assert (tmp_path / "restore/images/pages-1.img").read_bytes() == random_bytes(MiB, seed=9)


def test_newer_manifest_format_is_refused_by_version(store: CheckpointStore, tmp_path: Path) -> None:
    images = tmp_path / "img"
    write_images(images, b"x" * 10)
    result = store.commit(images, meta(1))
    doc = json.loads(result.manifest.to_json())
    doc |= {"format": 4, "checkpoint_id": checkpoint_id(2)}
    store.backend.put_new(f"{run_keys(store)}checkpoints/{checkpoint_id(2)}.json", json.dumps(doc).encode())

    with pytest.raises(UnsupportedManifest, match="format 4"):
        store.fetch(checkpoint_id(2), tmp_path / "restore")
    with pytest.raises(UnsupportedManifest):
        store.checkpoints()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"files": [{"path": "../../etc/cron.d/x", "size": 0, "mode": 420, "digest": "", "chunks": []}]}, "path"),
        ({"files": [{"path": ".", "size": 0, "mode": 420, "digest": "", "chunks": []}]}, "path"),
        (
            {
                "files": [
                    {
                        "path": "images/x",
                        "size": -1,
                        "mode": 420,
                        "digest": "",
                        "chunks": [{"hash": "0" * 64, "size": -1}],
                    }
                ]
            },
            "negative",
        ),
        (
            {
                "files": [
                    {
                        "path": "images/x",
                        "size": 10,
                        "mode": 420,
                        "digest": "",
                        "chunks": [{"hash": "0" * 64, "size": 10, "pack": 3, "at": 0, "len": 10}],
                    }
                ]
            },
            "names pack 3",
        ),
        ({"packs": ["../../etc"]}, "pack id"),
        ({"job_id": "someone-else"}, "job"),
        ({"format": "1"}, "format"),
    ],
)
def test_hostile_or_malformed_manifest_is_corrupt(
    store: CheckpointStore, tmp_path: Path, change: dict, reason: str
) -> None:
    images = tmp_path / "img"
    write_images(images, b"x" * 10)
    doc = json.loads(store.commit(images, meta(1)).manifest.to_json()) | change | {"checkpoint_id": checkpoint_id(2)}
    store.backend.put_new(f"{run_keys(store)}checkpoints/{checkpoint_id(2)}.json", json.dumps(doc).encode())

    with pytest.raises(CorruptCheckpoint, match=reason):
        store.fetch(checkpoint_id(2), tmp_path / "restore")
    assert not (tmp_path / "etc").exists()


def test_unknown_checkpoint_is_not_found(store: CheckpointStore, tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFound, match=checkpoint_id(7)):
        store.fetch(checkpoint_id(7), tmp_path / "restore")


def test_prune_deletes_a_pack_once_no_kept_checkpoint_uses_a_chunk_in_it(
    store: CheckpointStore, tmp_path: Path
) -> None:
    # Given checkpoint 1 (files A and X, sent in one pack), 2 (A and Y: only Y sent, in a pack of its own), 3 (B)
    for n, seeds in ((1, (1, 2)), (2, (1, 3)), (3, (4,))):
        store.commit(seeded_images(tmp_path / f"img{n}", *seeds), meta(n, parent=n - 1 if n > 1 else None))
    packs = [set(store.load(checkpoint_id(n)).packs()) for n in (1, 2, 3)]
    assert len(packs[0]) == 1 and packs[0] < packs[1]

    def stored() -> set[str]:
        return {o.key.rsplit("/", 1)[-1] for o in store.backend.scan(f"{run_keys(store)}chunks/")}

    # When pruned to the newest two with the default grace period
    first = store.prune(keep=2)

    # Then the oldest manifest goes (its successor is old) but its pack is too young to collect
    assert (first.deleted_checkpoints, first.deleted_chunks) == ([checkpoint_id(1)], 0)

    # When pruned again once the packs are past the grace period (here: none)
    second = store.prune(keep=2, grace_seconds=0)

    # Then checkpoint 1's pack stays whole: checkpoint 2 still uses A's chunks in it (X's are dead bytes there)
    assert second.deleted_chunks == 0 and stored() == packs[1] | packs[2]

    # When pruned to the newest one
    third = store.prune(keep=1, grace_seconds=0)

    # Then every pack checkpoint 3 does not use is deleted whole, and checkpoint 3 restores
    assert third.deleted_chunks == 2 and stored() == packs[2]
    store.fetch(checkpoint_id(3), tmp_path / "restore")
    assert (tmp_path / "restore/images/pages-4.img").read_bytes() == random_bytes(MiB, seed=4)


def test_jobs_sharing_a_store_do_not_see_each_other(make_store, tmp_path: Path) -> None:
    images = tmp_path / "img"
    write_images(images, b"x" * 10)
    mine, theirs = make_store("job-a"), make_store("job-b")
    mine.commit(images, meta(1, job="job-a"))

    assert theirs.checkpoints() == []
    with pytest.raises(ValueError, match="job-a"):
        theirs.commit(images, meta(2, job="job-a"))


def test_missing_mount_is_named(tmp_path: Path) -> None:
    store = CheckpointStore.for_directory(tmp_path / "not-mounted", "job-x")
    write_images(tmp_path / "img", b"x")

    with pytest.raises(StoreUnavailable, match=str(tmp_path / "not-mounted")):
        store.commit(tmp_path / "img", meta(1, job="job-x"))


def test_unwritable_directory_is_named(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    write_images(tmp_path / "img", b"x")
    try:
        store = CheckpointStore.for_directory(root, "job-x")
        if os.geteuid() == 0:
            # root ignores mode bits: make the chunk directory a file so the write really fails
            (root / "jobs").write_bytes(b"")
            with pytest.raises(StoreUnavailable, match="jobs"):
                store.commit(tmp_path / "img", meta(1, job="job-x"))
        else:
            with pytest.raises(StoreUnavailable, match=str(root)):
                store.commit(tmp_path / "img", meta(1, job="job-x"))
    finally:
        root.chmod(0o700)


def test_missing_bucket_is_named(aws: str, tmp_path: Path) -> None:
    store = CheckpointStore.for_s3("spotcr-no-such-bucket", "job-x")
    write_images(tmp_path / "img", b"x")

    with pytest.raises(StoreUnavailable, match="spotcr-no-such-bucket"):
        store.commit(tmp_path / "img", meta(1, job="job-x"))


def test_prune_keeps_a_manifest_a_running_commit_may_dedup_against(store: CheckpointStore, tmp_path: Path) -> None:
    # Given two checkpoints, the newer one taken just now
    images = tmp_path / "img"
    write_images(images, random_bytes(MiB, seed=14))
    now_ms = int(time.time() * 1000)
    older, newer = f"{now_ms - 60_000}-g1-periodic", f"{now_ms}-g1-periodic"
    for cid in (older, newer):
        store.commit(images, replace(meta(1), checkpoint_id=cid))

    # When pruned to one within the grace period of the newer one
    pruned = store.prune(keep=1)

    # Then the older manifest stays: a commit started before the newer one may still reference its chunks
    assert (pruned.kept, pruned.deleted_checkpoints) == ([newer, older], [])


def test_manifest_listing_a_file_twice_is_corrupt(store: CheckpointStore, tmp_path: Path) -> None:
    images = tmp_path / "img"
    write_images(images, b"x" * 10)
    doc = json.loads(store.commit(images, meta(1)).manifest.to_json()) | {"checkpoint_id": checkpoint_id(2)}
    doc["files"].append(doc["files"][0])
    store.backend.put_new(f"{run_keys(store)}checkpoints/{checkpoint_id(2)}.json", json.dumps(doc).encode())

    with pytest.raises(CorruptCheckpoint, match="twice"):
        store.fetch(checkpoint_id(2), tmp_path / "restore")


def test_a_damaged_chunk_of_a_newer_checkpoint_is_not_reused_by_a_commit_from_an_older_parent(
    store: CheckpointStore, tmp_path: Path
) -> None:
    # Given checkpoint 1, then checkpoint 2 whose new chunk got damaged in the store (so a restore fell back to 1)
    images = tmp_path / "img"
    write_images(images, random_bytes(2 * MiB, seed=21))
    first = store.commit(images, meta(1))
    changed = random_bytes(2 * MiB, seed=22)
    write_images(images, changed)
    damaged = store.commit(images, meta(2, parent=1))
    for digest, chunk in damaged.manifest.stored_chunks().items():
        if digest not in first.manifest.chunk_hashes():
            damage_chunk(store, chunk)

    # When the job restored from checkpoint 1 reaches the same memory again and is checkpointed with parent 1
    result = store.commit(images, meta(3, parent=1))

    # Then the new checkpoint sends its chunks again instead of pointing at the damaged ones, and restores
    assert result.chunks_uploaded > 0
    store.fetch(result.checkpoint_id, tmp_path / "restore")
    assert (tmp_path / "restore" / "images" / "pages-1.img").read_bytes() == changed


def test_a_commit_says_how_much_changed_since_its_parent_even_when_it_sends_everything(tmp_path: Path) -> None:
    # Given a store that sends every chunk afresh on its second periodic commit, and a first commit
    (tmp_path / "store").mkdir()
    store = CheckpointStore.for_directory(tmp_path / "store", "job-store-test")
    store.full_every = 1
    images = tmp_path / "img"
    pages = random_bytes(32 * MiB, seed=21)
    write_images(images, pages)
    first = store.commit(images, meta(1))
    assert first.bytes_changed == first.bytes_new > 0

    # When one MiB in the middle of the memory is rewritten and the next periodic commit sends everything
    (images / "pages-1.img").write_bytes(pages[: 16 * MiB] + random_bytes(MiB, seed=22) + pages[17 * MiB :])
    second = store.commit(images, meta(2, parent=1))

    # Then it sent all of it, but counts as changed only the chunks the parent did not hold (about that MiB)
    assert second.bytes_new == first.bytes_new
    assert MiB <= second.bytes_changed < 10 * MiB
    # And the store's time is accounted for by stage
    assert second.read_seconds > 0 and second.hash_seconds > 0 and second.upload_seconds > 0


@pytest.mark.claim("One identity per run")
def test_each_run_of_a_job_name_has_its_own_checkpoints(tmp_path: Path) -> None:
    # Given a run of the job that committed a checkpoint
    images = tmp_path / "img"
    write_images(images, random_bytes(MiB, seed=11))
    (tmp_path / "root").mkdir()
    earlier = CheckpointStore.for_directory(tmp_path / "root", JOB, run_id="r-00000000000000e1")
    earlier.commit(images, meta(1))

    # When the name is reused for a new run in the same store
    later = CheckpointStore.for_directory(tmp_path / "root", JOB, run_id="r-00000000000000e2")

    # Then the new run sees none of the earlier run's checkpoints, and a manifest copied across runs is refused
    assert later.checkpoint_ids() == [] and earlier.checkpoint_ids() == [checkpoint_id(1)]
    assert earlier.load(checkpoint_id(1)).run_id == "r-00000000000000e1"
    copied = earlier.backend.get(f"jobs/{JOB}/runs/r-00000000000000e1/checkpoints/{checkpoint_id(1)}.json")
    later.backend.put(f"jobs/{JOB}/runs/r-00000000000000e2/checkpoints/{checkpoint_id(1)}.json", copied)
    with pytest.raises(CorruptCheckpoint, match="run r-00000000000000e1"):
        later.load(checkpoint_id(1))


def test_checkpoints_are_listed_and_pruned_by_the_control_planes_order_not_the_vms_clock(tmp_path: Path) -> None:
    # Given ordered dumps (sequences 4, 5, 6) from a VM whose clock jumped back a minute after the first, then the
    # final dump it took on its own notice (no order: the highest sequence it was given), its clock behind still
    (tmp_path / "root").mkdir()
    store = CheckpointStore.for_directory(tmp_path / "root", JOB)
    images = tmp_path / "img"
    ids = [
        commands.checkpoint_id(1_700_000_100_000, 1, "periodic", 4),
        commands.checkpoint_id(1_700_000_040_000, 1, "periodic", 5),
        commands.checkpoint_id(1_700_000_070_000, 1, "periodic", 6),
        commands.checkpoint_id(1_700_000_065_000, 1, "final", 6),
    ]
    for n, checkpoint in enumerate(ids):
        write_images(images, random_bytes(MiB, seed=40 + n))
        store.commit(images, replace(meta(n), checkpoint_id=checkpoint, kind=checkpoint.rsplit("-")[-1]))

    # Then the listing (which the restore walks, newest first) follows the order, and prune keeps the newest
    assert store.checkpoint_ids() == ids[::-1]
    assert store.prune(keep=2, grace_seconds=0).deleted_checkpoints == [ids[1], ids[0]]
    assert store.checkpoint_ids() == [ids[3], ids[2]]


def test_chunks_that_do_not_compress_are_stored_fast_and_the_rest_still_compressed(tmp_path: Path) -> None:
    # Given a pages file whose chunks compress well (text), then not at all (random), then again (text)
    (tmp_path / "store").mkdir()
    store = CheckpointStore.for_directory(tmp_path / "store", JOB)
    text = b"".join(b"step %d of the job: loss 0.%03d\n" % (i, i % 1000) for i in range(100_000))
    images = tmp_path / "img"
    write_images(images, text[: 2 * MiB] + random_bytes(3 * MiB, seed=5) + text[: 2 * MiB])

    # When it is committed and fetched
    result = store.commit(images, meta(1))
    store.fetch(result.checkpoint_id, tmp_path / "restore")

    # Then it comes back byte for byte, the random part cost about its size and the text next to nothing
    assert tree_bytes(tmp_path / "restore/images") == tree_bytes(images)
    assert 3 * MiB < result.bytes_uploaded < 3 * MiB + 500 * 1024  # 200 KiB of random pagemap besides


@pytest.mark.parametrize("job_id", ["Job-1", "job.1", "job_1", "-job", "j" * 64, "job\n", ""])
def test_the_store_refuses_a_job_id_the_spotcr_job_tag_refuses(job_id, tmp_path):
    # Given a job id that the spotcr:job tag refuses
    with pytest.raises(tags.InvalidJobTags):
        tags.parse_job_tags({tags.JOB: job_id, tags.COMMAND: "true"})
    # Then the store refuses it too: one rule for the job id (tags.JOB_ID_PATTERN)
    with pytest.raises(ValueError, match="does not match"):
        CheckpointStore.for_directory(tmp_path, job_id)


def test_the_store_accepts_every_job_id_the_spotcr_job_tag_accepts(tmp_path):
    for job_id in ("a", "job-1", "j" * 63):
        assert tags.parse_job_tags({tags.JOB: job_id, tags.COMMAND: "true"}).job_id == job_id
        assert CheckpointStore.for_directory(tmp_path, job_id).job_id == job_id
