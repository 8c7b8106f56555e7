"""Content-defined chunking at page granularity.

CRIU's pages-*.img is a sequence of 4 KiB pages in VMA order. When the job maps or first touches
memory in the middle of its address space, everything after shifts by whole pages, so fixed-size
chunks would all change. Here a chunk may end only after a page whose CRC32 has its low bits zero
(between a minimum and a maximum size): boundaries follow content, a page-sized shift resynchronises
at the next boundary, and cutting costs one C-speed CRC per page instead of a rolling hash per byte.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

PAGE = 4096


@dataclass(frozen=True)
class Chunking:
    min_size: int = 256 * 1024
    max_size: int = 4 * 1024 * 1024
    boundary_bits: int = 8  # a page ends a chunk with probability 1/256: about 1 MiB past min_size on average

    def __post_init__(self) -> None:
        if self.min_size % PAGE or self.max_size % PAGE or not PAGE <= self.min_size <= self.max_size:
            raise ValueError(f"chunk sizes must be page multiples with min <= max: {self}")

    def describe(self) -> dict[str, Any]:
        return {
            "method": "page-cdc-crc32",
            "page": PAGE,
            "min": self.min_size,
            "max": self.max_size,
            "boundary_bits": self.boundary_bits,
        }


class Chunker:
    """Cuts one file's byte stream into chunks as it arrives; feed() may be called as the file grows."""

    def __init__(self, chunking: Chunking) -> None:
        self._chunking = chunking
        self._mask = (1 << chunking.boundary_bits) - 1
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf already ruled out as a cut point
        self.emitted = 0  # chunks returned so far

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return the chunks whose end is now known."""
        self._buf += data
        chunks = []
        while (cut := self._find_cut()) is not None:
            chunks.append(bytes(self._buf[:cut]))
            del self._buf[:cut]
            self._scanned = 0
        self.emitted += len(chunks)
        return chunks

    def finish(self) -> list[bytes]:
        """The file is complete: return what is left as the last chunk."""
        if not self._buf:
            return []
        last = bytes(self._buf)
        self._buf.clear()
        self._scanned = 0
        self.emitted += 1
        return [last]

    @property
    def pending(self) -> int:
        return len(self._buf)

    def _find_cut(self) -> int | None:
        size = len(self._buf)
        pos = max(self._scanned, self._chunking.min_size - PAGE)
        max_size, mask = self._chunking.max_size, self._mask
        view = memoryview(self._buf)
        try:
            while pos + PAGE <= size:
                end = pos + PAGE
                if end >= max_size:
                    return max_size
                if zlib.crc32(view[pos:end]) & mask == 0:
                    return end
                pos = end
        finally:
            view.release()
        self._scanned = pos
        return None
