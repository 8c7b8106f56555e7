"""A job holding a vsock socket (as a VM guest agent would), which CRIU cannot dump."""

import socket
import sys
import time

held = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
with open("progress.log", "a") as progress:
    for step in range(int(sys.argv[1])):
        progress.write(f"step {step}\n")
        progress.flush()
        time.sleep(0.1)
