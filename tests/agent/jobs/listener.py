"""A job holding a listening TCP socket (on 127.0.0.1, or the address given): answers each connection with its step."""

import socket
import sys

server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1", int(sys.argv[1])))
server.listen()
server.settimeout(0.05)
with open("progress.log", "a") as progress:
    for step in range(400):
        progress.write(f"step {step}\n")
        progress.flush()
        try:
            connection, _ = server.accept()
        except TimeoutError:
            continue
        with connection:
            connection.sendall(b"alive at step %d\n" % step)
