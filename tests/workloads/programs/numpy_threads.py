"""A numpy job: seeded matrix products on OpenBLAS's threads, a digest of the state each step."""

import hashlib
import sys
import time

import numpy as np

steps, pace = int(sys.argv[1]), int(sys.argv[2]) / 1000
rng = np.random.default_rng(1234)
a = rng.standard_normal((384, 384))
b = rng.standard_normal((384, 384)) / 20
with open("progress.log", "a") as progress, open("result.txt", "w") as result:
    for step in range(steps):
        a = np.tanh(a @ b + a)
        result.write(f"{step} {hashlib.sha256(a.tobytes()).hexdigest()}\n")
        progress.write(f"step {step}\n")
        progress.flush()
        time.sleep(pace)
