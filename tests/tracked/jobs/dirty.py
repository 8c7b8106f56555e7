"""A job that rewrites a hot part of its memory in steps the test releases, then prints a checksum of all of it.

Usage: dirty.py MEGABYTES STEPS HOT_PERCENT. Before each step the job waits until the number in the file `allow`
(in its work dir) exceeds the step, so the test decides what changes between checkpoints. Each step rewrites every
page of the first HOT_PERCENT of memory from the previous content: a restore that missed a page dirtied after a
checkpoint prints another checksum. Output is the same however the job was checkpointed and restored on the way.
"""

import hashlib
import random
import sys
import time

PAGE = 4096
megabytes, steps, hot_percent = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
data = bytearray(random.Random(42).randbytes(megabytes << 20))
hot = len(data) * hot_percent // 100 // PAGE * PAGE


def allowed() -> int:
    try:
        with open("allow") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


with open("progress.log", "a") as progress:
    for step in range(steps):
        while allowed() <= step:
            time.sleep(0.05)
        digest = hashlib.sha256(data[:hot]).digest()
        for page in range(0, hot, PAGE):
            data[page : page + 32] = digest
            digest = hashlib.sha256(digest).digest()
        progress.write(f"step {step} {digest.hex()[:16]}\n")
        progress.flush()
print(hashlib.sha256(data).hexdigest(), flush=True)
