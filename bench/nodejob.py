"""The nodes benchmark's job, one share per node: holds GIB of half-random memory (as memjob.py) and a TCP ring
between the nodes: it listens on its own address, connects to the next node's, and sends a counter every 20 ms,
so every coordinated checkpoint has connections between nodes to hold.

Usage: nodejob.py GIB INDEX ADDRESSES (comma-separated, this node's at INDEX). Writes `ready` in its work dir once
its memory is filled and its ring connections are up. Stdlib only.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

PAGE = 4096
PORT = 7200


def main() -> None:
    size = int(float(sys.argv[1]) * (1 << 30)) // PAGE * PAGE
    index, addresses = int(sys.argv[2]), sys.argv[3].split(",")
    memory = bytearray(size)
    for page in range(0, size, PAGE):
        memory[page : page + PAGE // 2] = os.urandom(PAGE // 2)
    if len(addresses) > 1:
        listener = socket.create_server((addresses[index], PORT))
        following = addresses[(index + 1) % len(addresses)]
        while True:
            try:
                out = socket.create_connection((following, PORT), timeout=2)
                break
            except OSError:
                time.sleep(0.1)
        incoming, _ = listener.accept()
        threading.Thread(target=lambda: [None for _ in iter(lambda: incoming.recv(4096), b"")], daemon=True).start()
    Path("ready").write_text(str(size))
    counter = 0
    while True:
        counter += 1
        if len(addresses) > 1:
            out.sendall(f"{counter}\n".encode())
        time.sleep(0.02)


if __name__ == "__main__":
    main()
