"""Chunk boundaries depend on content only: a streamed final dump dedups against a periodic one read whole."""

from __future__ import annotations

import random

import pytest
from spotcr_agent.store import Chunking
from spotcr_agent.store.chunking import PAGE, Chunker

from .support import MiB, random_bytes


def chunk(data: bytes, feeds: list[int], chunking: Chunking) -> list[bytes | memoryview]:
    chunker, out, offset = Chunker(chunking), list[bytes | memoryview](), 0
    for size in feeds:
        out += chunker.feed(data[offset : offset + size])
        offset += size
    out += chunker.feed(data[offset:])
    return out + chunker.finish()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_boundaries_do_not_depend_on_how_the_file_was_read(seed: int) -> None:
    data = random_bytes(12 * MiB + 1234, seed=seed) + bytes(3 * MiB)
    whole = chunk(data, [], Chunking())
    rng = random.Random(seed)
    streamed = chunk(data, [rng.randint(1, 700_000) for _ in range(40)], Chunking())

    assert streamed == whole
    assert b"".join(whole) == data
    assert all(Chunking().min_size <= len(c) <= Chunking().max_size for c in whole[:-1])
    assert all(len(c) % PAGE == 0 for c in whole[:-1])


def test_small_files_are_one_chunk_or_none() -> None:
    for size in (0, 1, PAGE - 1, PAGE, PAGE + 1, 100_000):
        data = random_bytes(size, seed=size)
        assert chunk(data, [], Chunking()) == ([data] if data else [])


def test_chunk_sizes_must_be_pages() -> None:
    with pytest.raises(ValueError, match="page multiples"):
        Chunking(min_size=1000)


def test_a_mapped_file_fed_in_views_gives_the_same_chunks_without_copying_them() -> None:
    data = random_bytes(9 * MiB + 777, seed=4)
    whole = chunk(data, [], Chunking())
    view = memoryview(data)
    chunker, out = Chunker(Chunking()), []
    for start, end in ((0, 3 * MiB + PAGE), (3 * MiB + PAGE, 3 * MiB + 3 * PAGE), (3 * MiB + 3 * PAGE, len(data))):
        out += chunker.feed(view[start:end])  # as the store maps a file CRIU is still writing: whole pages
    out += chunker.finish()

    assert out == whole
    inside = [c for c in out[:-1] if isinstance(c, memoryview)]
    assert inside and all(c.obj is data for c in inside)  # chunks within one block are views of it, not copies


def test_chunks_known_to_start_somewhere_are_taken_whole_and_the_rest_cut_as_before() -> None:
    # Given a file's chunks, cut by scanning its pages
    data = random_bytes(12 * MiB, seed=5) + bytes(2 * MiB)
    whole = chunk(data, [], Chunking())
    starts, offset = {}, 0
    for piece in whole:
        starts[offset] = len(piece)
        offset += len(piece)

    # When it is cut again, streamed, with every other of those chunks known where it starts (the last one aside:
    # the end of the file cut it)
    known_here = {start: size for n, (start, size) in enumerate(list(starts.items())[:-1]) if n % 2 == 0}
    asked: list[int] = []

    def known(position: int, view: memoryview) -> int:
        asked.append(position)
        size = known_here.get(position, 0)
        return size if size <= len(view) else 0

    chunker, out, offset = Chunker(Chunking()), list[bytes | memoryview](), 0
    for size in (3 * MiB + PAGE, 5 * MiB, len(data)):
        out += chunker.feed(data[offset : offset + size], known)
        offset += size
    out += chunker.finish()

    # Then the chunks are the same, and known() was asked at chunk starts only
    assert out == whole
    assert set(asked) <= set(starts) and len(asked) > len(known_here) > 1
