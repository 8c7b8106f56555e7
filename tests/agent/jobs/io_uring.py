"""A job holding an io_uring instance (as Node.js does with UV_USE_IO_URING=1), which CRIU cannot dump."""

import ctypes
import os
import sys
import time

IO_URING_SETUP = 425  # x86_64 and arm64
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
ring = libc.syscall(IO_URING_SETUP, 4, params)
if ring < 0:
    sys.exit(f"io_uring_setup failed: {os.strerror(ctypes.get_errno())}")
with open("progress.log", "a") as progress:
    for step in range(int(sys.argv[1])):
        progress.write(f"step {step}\n")
        progress.flush()
        time.sleep(0.1)
