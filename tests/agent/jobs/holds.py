"""A job that holds one thing for its whole run: `ghost MIB` (an unlinked temp file) or `read PATH` (a file
opened read-only, as a model or a library), and writes a progress line per step."""

import os
import sys
import tempfile
import time

what, argument, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
held: object
if what == "ghost":
    temp = tempfile.TemporaryFile()  # noqa: SIM115 - unlinked at once, held for the whole run
    temp.write(os.urandom(int(argument) << 20))
    temp.flush()
    held = temp
else:
    held = open(argument, "rb")  # noqa: SIM115 - held for the whole run
with open("progress.log", "a") as progress:
    for step in range(steps):
        progress.write(f"step {step}\n")
        progress.flush()
        time.sleep(0.1)
