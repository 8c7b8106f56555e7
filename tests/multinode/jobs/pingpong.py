"""One node of a two-node job talking over one TCP connection between VMs, as two MPI ranks do.

Usage: pingpong.py serve PORT STEPS STEP_SECONDS | pingpong.py dial ADDRESS PORT STEPS STEP_SECONDS.
Each step the dialing node sends the step's number, the serving node folds it into its running total and
answers the total; both append "step N TOTAL" to progress.log. The serving node accepts one connection only,
so the same output on both sides means the one connection carried the whole run, across any checkpoint and
restore. A broken connection ends the node with an error.
"""

import socket
import struct
import sys
import time

role = sys.argv[1]
if role == "serve":
    port, steps, step_seconds = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(1)
    connection, _ = listener.accept()
    listener.close()
else:
    address, port, steps, step_seconds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    connection = socket.create_connection((address, port), timeout=10)
connection.settimeout(None)  # a restore elsewhere may take a while: TCP retransmits meanwhile


def receive(size):
    data = b""
    while len(data) < size:
        more = connection.recv(size - len(data))
        if not more:
            raise SystemExit(f"the connection was closed after {len(data)} of {size} bytes")
        data += more
    return data


total = 1
with open("progress.log", "a") as progress:
    for step in range(steps):
        if role == "serve":
            (number,) = struct.unpack("!Q", receive(8))
            total = (total * 1000003 + number) % (1 << 61)
            connection.sendall(struct.pack("!Q", total))
        else:
            connection.sendall(struct.pack("!Q", step))
            (total,) = struct.unpack("!Q", receive(8))
        progress.write(f"step {step} {total}\n")
        progress.flush()
        time.sleep(step_seconds)
connection.close()
