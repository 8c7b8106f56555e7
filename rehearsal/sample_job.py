"""The rehearsal's sample job: a long, deterministic computation over a large in-memory state.

It hashes blocks of its state and writes each digest back, so every step depends on all the
earlier ones: any lost, repeated or corrupted step changes the final checksum. `--pace` sleeps
between steps to stretch the run (it does not change the result); the uninterrupted reference
run uses `--pace 0`.

Usage: sample_job.py --mb 256 --steps 3000 [--pace 0.02] [--result result.txt] [--stop-file NAME] [--hurry-file NAME]

`--stop-file` lets the fault suite end the job at a chosen moment: once that file exists in the work dir, the
job exits with code 3 (STOPPED_EXIT_CODE) before its next step. `--hurry-file` lets it end the job sooner once
nothing is left to test: once that file exists, the job stops pacing (the result is the same).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

BLOCK = 1 << 20
DIGEST = 32
STOPPED_EXIT_CODE = 3


class Stopped(Exception):
    pass


def run(mb: int, steps: int, pace: float, stop_file: str = "", hurry_file: str = "") -> str:
    size = mb * (1 << 20)
    state = bytearray(hashlib.shake_256(b"spotcr sample job").digest(size))
    view = memoryview(state)
    blocks = size // BLOCK
    chain = hashlib.blake2b(digest_size=DIGEST)
    report_every = max(1, steps // 20)
    for step in range(steps):
        if stop_file and os.path.exists(stop_file):
            raise Stopped(f"stopped at step {step}: {stop_file} exists")
        block = (step * 2_654_435_761) % blocks
        offset = block * BLOCK
        digest = hashlib.blake2b(view[offset : offset + BLOCK], digest_size=DIGEST, salt=step.to_bytes(16, "big"))
        value = digest.digest()
        target = ((block + 1) % blocks) * BLOCK + (step * DIGEST) % (BLOCK - DIGEST)
        state[target : target + DIGEST] = value
        chain.update(value)
        if (step + 1) % report_every == 0:
            print(f"step {step + 1}/{steps}", flush=True)
        if pace and hurry_file and os.path.exists(hurry_file):
            pace = 0.0
        if pace:
            time.sleep(pace)
    whole = hashlib.blake2b(view, digest_size=DIGEST).hexdigest()
    return f"{whole}-{chain.hexdigest()[:16]}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="size of the state in MiB")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--pace", type=float, default=0.0, help="seconds to sleep after each step")
    parser.add_argument("--result", default="", help="also write the result to this file")
    parser.add_argument("--stop-file", default="", help="exit with code 3 once this file exists")
    parser.add_argument("--hurry-file", default="", help="stop pacing once this file exists")
    args = parser.parse_args(argv)
    try:
        result = run(args.mb, args.steps, args.pace, args.stop_file, args.hurry_file)
    except Stopped as stopped:
        print(stopped, file=sys.stderr, flush=True)
        return STOPPED_EXIT_CODE
    print(f"result {result}", flush=True)
    if args.result:
        with open(args.result, "a") as out:
            out.write(result + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
