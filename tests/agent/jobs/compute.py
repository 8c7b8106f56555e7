"""A checkpointable test job: holds MB of state, computes over it in steps, appends progress, prints a checksum.

Usage: compute.py MEGABYTES STEPS STEP_SECONDS. Output is the same whether or not the job was
checkpointed and restored on the way, which is what the tests compare.
"""

import hashlib
import random
import sys
import time

megabytes, steps, step_seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
data = bytearray(random.Random(42).randbytes(megabytes << 20))
block = len(data) // steps
with open("progress.log", "a") as progress:
    for step in range(steps):
        start = step * block
        digest = hashlib.sha256(data[start : start + block]).digest()
        data[start : start + 32] = digest
        progress.write(f"step {step} {digest.hex()[:16]}\n")
        progress.flush()
        time.sleep(step_seconds)
print(hashlib.sha256(data).hexdigest(), flush=True)
