"""A job that talks to itself over TCP through its VM's address, as a client of a local service (redis) would.

Listens on LISTEN:PORT (default 0.0.0.0) and keeps one established connection to ADDRESS:PORT; each step sends a
ping and reads the pong. A connection that breaks (after a restore that closed it) is reported in progress.log and
made again (through 127.0.0.1 when listening on all addresses), as a client reconnects after a network blip.
With OUTSIDE (host:port of an echo server on another VM), each step also has that peer echo a line; a break there
is reported as "outside reset" and the connection made again.
"""

import socket
import sys
import time

address, port, steps, step_seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
listen = sys.argv[5] if len(sys.argv) > 5 else "0.0.0.0"
outside = sys.argv[6] if len(sys.argv) > 6 else ""
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((listen, port))
server.listen()


def connect(to):
    client = socket.create_connection((to, port), timeout=5)
    accepted, _ = server.accept()
    accepted.settimeout(5)
    return client, accepted


def dial_outside():
    host, _, outside_port = outside.rpartition(":")
    return socket.create_connection((host, int(outside_port)), timeout=5)


client, accepted = connect(address)
peer = dial_outside() if outside else None
with open("progress.log", "a") as progress:
    for step in range(steps):
        try:
            client.sendall(b"ping %d\n" % step)
            ping = accepted.recv(64)
            if not ping:
                raise ConnectionError("the connection was closed")
            accepted.sendall(ping.replace(b"ping", b"pong"))
            pong = client.recv(64)
            if pong != b"pong %d\n" % step:
                raise ConnectionError(f"got {pong!r}")
            progress.write(f"step {step} ok\n")
        except OSError as error:
            progress.write(f"step {step} reconnect after {type(error).__name__}\n")
            client.close()
            accepted.close()
            client, accepted = connect("127.0.0.1" if listen == "0.0.0.0" else listen)
        if peer is not None:
            try:
                peer.sendall(b"echo %d\n" % step)
                if peer.recv(64) != b"echo %d\n" % step:
                    raise ConnectionError("the echo differs")
            except OSError as error:
                progress.write(f"step {step} outside reset after {type(error).__name__}\n")
                peer.close()
                peer = dial_outside()
        progress.flush()
        time.sleep(step_seconds)
