"""A checkpointable test job for lazy restores: MEGABYTES of random memory; once `go` exists in its work dir it
writes the SHA-256 of that memory to `digest` and exits. A page restored as zeros gives another digest.

Usage: lazy_memory.py MEGABYTES. It holds no file open, so a restore needs nothing but its images."""

import hashlib
import os
import random
import sys
import time

data = bytearray(random.Random(7).randbytes(int(sys.argv[1]) << 20))
os.close(os.open("ready", os.O_CREAT | os.O_WRONLY, 0o644))
while not os.path.exists("go"):
    time.sleep(0.01)
with open("digest.tmp", "w") as out:
    out.write(hashlib.sha256(data).hexdigest())
os.rename("digest.tmp", "digest")
