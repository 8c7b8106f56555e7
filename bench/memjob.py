"""The benchmark's job: holds N GiB of half-random memory and dirties 5% of it when asked.

Each 4 KiB page is 2 KiB random then 2 KiB zero, so CRIU's images compress about 2x (as in criu-notes).
It runs as `memjob.py GIB DIRTY_FRACTION` in its work dir: it writes `ready` once its memory is filled;
when `dirty-request` appears it rewrites one contiguous region (DIRTY_FRACTION of the memory) with new
random bytes, removes the request and writes `dirty-done`. Stdlib only, so any python3 runs it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

PAGE = 4096


def fill(memory: bytearray, start: int, end: int) -> None:
    # Page by page, so no large temporary buffer is left in the heap to show up as dirtied memory too.
    for page in range(start, end, PAGE):
        memory[page : page + PAGE // 2] = os.urandom(PAGE // 2)


def main() -> None:
    size = int(float(sys.argv[1]) * (1 << 30)) // PAGE * PAGE
    dirty = float(sys.argv[2])
    memory = bytearray(size)
    fill(memory, 0, size)
    Path("ready").write_text(str(size))
    rounds = 0
    while True:
        if Path("dirty-request").exists():
            rounds += 1
            region = int(size * dirty) // PAGE * PAGE
            # A different region each round, as a job moving through its data would.
            start = (size // 3 + rounds * region) % (size - region) // PAGE * PAGE
            fill(memory, start, start + region)
            Path("dirty-request").unlink()
            Path("dirty-done").write_text(str(rounds))
        time.sleep(0.05)


if __name__ == "__main__":
    main()
