"""The lazy-restore benchmark's job: holds GIB of half-random memory and, once told to go, reads all of it again
and again, one byte per page, reporting its progress.

It runs as `lazyjob.py GIB` in its work dir: it writes `ready` once its memory is filled, waits for `go`, then
after every 64 MiB read appends "<wall-clock time> <MiB read so far>" to `progress` (opened and closed each time:
no file is open when it is dumped). Stdlib only, so any python3 runs it.
"""

from __future__ import annotations

import os
import sys
import time

PAGE = 4096
REPORT = 64 << 20


def main() -> None:
    size = int(float(sys.argv[1]) * (1 << 30)) // PAGE * PAGE
    memory = bytearray(size)
    for page in range(0, size, PAGE):
        memory[page : page + PAGE // 2] = os.urandom(PAGE // 2)
    os.close(os.open("ready", os.O_CREAT | os.O_WRONLY, 0o644))
    while not os.path.exists("go"):
        time.sleep(0.005)
    done = 0
    while True:
        for start in range(0, size, REPORT):
            sum(memory[start : start + REPORT : PAGE])
            done += min(REPORT, size - start) >> 20
            fd = os.open("progress", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
            os.write(fd, f"{time.time():.4f} {done}\n".encode())
            os.close(fd)


if __name__ == "__main__":
    main()
