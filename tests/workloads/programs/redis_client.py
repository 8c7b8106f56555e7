"""A redis job: starts redis-server, keeps one client connection to it on loopback, and records each answer."""

import socket
import subprocess
import sys
import time

PORT = 6399


def command(connection: socket.socket, reader, *args: str) -> str:
    request = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
    connection.sendall(request.encode())
    return reply(reader)


def reply(reader) -> str:
    line = reader.readline().decode().rstrip("\r\n")
    kind, rest = line[0], line[1:]
    if kind == "$":
        return "nil" if rest == "-1" else reader.read(int(rest) + 2)[:-2].decode()
    if kind == "*":
        return "[" + ",".join(reply(reader) for _ in range(int(rest))) + "]"
    return rest


def main() -> None:
    steps, pace = int(sys.argv[1]), int(sys.argv[2]) / 1000
    server = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(PORT),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            ".",
            "--logfile",
            "redis.log",
        ],
        stdin=subprocess.DEVNULL,
    )
    for _ in range(500):
        try:
            connection = socket.create_connection(("127.0.0.1", PORT))
            break
        except ConnectionRefusedError:
            time.sleep(0.01)
    reader = connection.makefile("rb")
    with open("progress.log", "a") as progress, open("result.txt", "w") as result:
        for step in range(steps):
            answers = [
                command(connection, reader, "INCRBY", "counter", str(step * 3 + 1)),
                command(connection, reader, "RPUSH", "log", f"entry-{step}"),
                command(connection, reader, "HSET", "squares", str(step), str(step * step)),
                command(connection, reader, "LRANGE", "log", "-3", "-1"),
                command(connection, reader, "HGET", "squares", str(step // 2)),
            ]
            result.write(f"{step} {' '.join(answers)}\n")
            progress.write(f"step {step}\n")
            progress.flush()
            time.sleep(pace)
        command(connection, reader, "DBSIZE")
    connection.sendall(b"*2\r\n$8\r\nSHUTDOWN\r\n$6\r\nNOSAVE\r\n")
    server.wait()


if __name__ == "__main__":
    main()
