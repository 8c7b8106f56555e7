"""A Python job: a process pool computes blocks spilled into an unlinked temp file (> 1 MiB), read back at the end."""

import hashlib
import multiprocessing
import sys
import tempfile
import time

BLOCK = 64 * 1024


def block(args: tuple[int, int]) -> bytes:
    step, index = args
    seed = hashlib.sha256(f"{step}-{index}".encode()).digest()
    return (seed * (BLOCK // len(seed)))[:BLOCK]


def main() -> None:
    steps, pace = int(sys.argv[1]), int(sys.argv[2]) / 1000
    with (
        tempfile.TemporaryFile(prefix="spill-") as spill,
        multiprocessing.Pool(2) as pool,
        open("progress.log", "a") as progress,
    ):
        for step in range(steps):
            for data in pool.map(block, [(step, i) for i in range(4)]):
                spill.write(data)
            spill.flush()
            progress.write(f"step {step} spilled {spill.tell()}\n")
            progress.flush()
            time.sleep(pace)
        spill.seek(0)
        digest = hashlib.sha256()
        while chunk := spill.read(1 << 20):
            digest.update(chunk)
        size = spill.tell()
    with open("result.txt", "w") as result:
        result.write(f"{size} {digest.hexdigest()}\n")


if __name__ == "__main__":
    main()
