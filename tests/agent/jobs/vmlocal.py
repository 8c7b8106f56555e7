"""A job that keeps its state in VM-local places, as real programs do, and checks it all at the end.

- /tmp/vmlocal/job.log: a log opened without O_APPEND (CRIU records its size);
- /tmp/hsperf/<pid>: a file mapped shared with its descriptor closed, as a default JVM's hsperfdata;
- /var/tmp/spill-<n>: closed files read back at the end, as GNU sort's spills;
- an unlinked 3 MiB temp file (over CRIU's default 1 MiB ghost limit), as tempfile.TemporaryFile spilling;
- a named POSIX semaphore in /dev/shm (glibc links it from an unlinked temp name: CRIU needs --link-remap);
- a FIFO in /tmp held open both ways with bytes in it, as Open MPI's mpirun holds its debugger_attach_fifo.
Writes progress.log each step and result.txt at the end; both the same for any run that ends.
"""

import ctypes
import hashlib
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

steps, step_seconds = int(sys.argv[1]), float(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
libc.sem_open.restype = ctypes.c_void_p
libc.sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint]
libc.sem_post.argtypes = libc.sem_getvalue.argtypes = [ctypes.c_void_p]
libc.sem_getvalue.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]

os.makedirs("/tmp/vmlocal", exist_ok=True)
log = open("/tmp/vmlocal/job.log", "w")  # noqa: SIM115 - held open for the whole run
os.makedirs("/tmp/hsperf", exist_ok=True)
perf_path = f"/tmp/hsperf/{os.getpid()}"
with open(perf_path, "wb+") as perf_file:
    perf_file.truncate(4096)
    perf = mmap.mmap(perf_file.fileno(), 4096)
ghost = tempfile.TemporaryFile()  # noqa: SIM115 - unlinked at once, held for the whole run
ghost_bytes = hashlib.shake_256(b"ghost").digest(3 << 20)
ghost.write(ghost_bytes)
ghost.flush()
semaphore = libc.sem_open(b"/spotcr-vmlocal", os.O_CREAT, 0o600, 0)
if not semaphore or semaphore == ctypes.c_void_p(-1).value:
    sys.exit(f"sem_open failed: errno {ctypes.get_errno()}")
os.mkfifo("/tmp/vmlocal/attach_fifo", 0o600)
fifo = os.open("/tmp/vmlocal/attach_fifo", os.O_RDWR | os.O_NONBLOCK)  # held for the whole run

with open("progress.log", "a") as progress:
    for step in range(steps):
        log.write(f"step {step}\n")
        log.flush()
        perf[0:8] = (int.from_bytes(perf[0:8], "little") + step).to_bytes(8, "little")
        if step % 5 == 0:
            with open(f"/var/tmp/spill-{step}", "w") as spill:
                spill.write(f"spilled at {step}\n" * 100)
        libc.sem_post(semaphore)
        os.write(fifo, b"f")  # the pipe's buffered bytes travel in CRIU's images, the FIFO's name in the carry
        progress.write(f"step {step}\n")
        progress.flush()
        time.sleep(step_seconds)

value = ctypes.c_int()
libc.sem_getvalue(semaphore, ctypes.byref(value))
ghost.seek(0)
log.close()
spills = "".join(Path(f"/var/tmp/spill-{s}").read_text() for s in range(0, steps, 5))
with open("result.txt", "w") as result:
    result.write(f"log {hashlib.sha256(Path('/tmp/vmlocal/job.log').read_bytes()).hexdigest()}\n")
    result.write(f"perf {int.from_bytes(perf[0:8], 'little')}\n")
    result.write(f"spills {hashlib.sha256(spills.encode()).hexdigest()}\n")
    result.write(f"ghost {ghost.read() == ghost_bytes}\n")
    result.write(f"semaphore {value.value}\n")
    result.write(f"fifo {len(os.read(fifo, 1 << 16))}\n")
