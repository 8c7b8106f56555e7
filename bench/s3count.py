"""S3 requests counted as the endpoint sees them: MinIO's own request counters, or an HTTP proxy on loopback.

MinIO counts every request it serves by API (its metrics, public on loopback when the benchmark starts it): the
benchmark reads them before and after each figure, so nothing stands between the store and the endpoint. The keys
written are what a listing of the bucket finds new, and the GETs of objects (key and Range) are recorded on the
store's client, so that a benchmark can download the same bytes again without the store.

Without MinIO (moto's server, a mock) a proxy counts instead: the store's client talks to the proxy
(AWS_ENDPOINT_URL); each request is counted by kind (PUT, GET, LIST, HEAD, DELETE, POST) and relayed byte for
byte, so the signatures still match. Requests on the path style only (`/<bucket>/<key>`), as boto3 sends them to a
loopback endpoint. The proxy keeps the GETs of objects too.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import socket
import threading
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO
from urllib.parse import parse_qs, unquote, urlsplit

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux's, named in fcntl from Python 3.10
KINDS = ("PUT", "GET", "LIST", "HEAD", "DELETE", "POST")
PIPE_SIZE = 1 << 20  # a body is spliced from socket to socket through a pipe this large, never copied into Python


class ProxyError(Exception):
    """A request or response the proxy cannot relay (not HTTP/1.1 as S3 speaks it)."""


@dataclass(frozen=True)
class Request:
    kind: str  # one of KINDS
    key: str  # the object's key without the bucket; "" for bucket requests
    range: str = ""  # the Range header of a GET, if any


def classify(method: str, target: str) -> Request:
    """The kind of S3 request a method and request target make, for path-style addressing."""
    url = urlsplit(target)
    _, _, key = unquote(url.path).lstrip("/").partition("/")
    query = parse_qs(url.query, keep_blank_values=True)
    if method == "GET":
        return Request("LIST" if not key and ("list-type" in query or not url.query) else "GET", key)
    if method == "POST" and "delete" in query:
        return Request("DELETE", key)  # DeleteObjects: one request for up to 1,000 keys
    if method in KINDS:
        return Request(method, key)
    raise ProxyError(f"an S3 request with an unexpected method: {method} {target}")


@dataclass
class Tally:
    """What the endpoint was asked since the last reset."""

    requests: Counter[str] = field(default_factory=Counter)
    written: set[str] = field(default_factory=set)  # keys PUT (an object PUT twice is one object)
    gets: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: Request, status: int) -> None:
        with self.lock:
            self.requests[request.kind] += 1
            if request.kind == "PUT" and status < 300:
                self.written.add(request.key)
            if request.kind == "GET" and status < 300:
                self.gets.append(request)

    def take(self) -> Tally:
        """The tally so far, and a fresh one from now on."""
        with self.lock:
            taken = Tally(self.requests, self.written, self.gets)
            self.requests, self.written, self.gets = Counter(), set(), []
        return taken

    def summary(self) -> dict[str, int]:
        return {kind: self.requests[kind] for kind in KINDS} | {
            "total": sum(self.requests.values()),
            "objects_written": len(self.written),
        }


# MinIO's API names (minio_api_requests_total{name=...}) by the kind of request they are; others by their prefix.
MINIO_KINDS = {
    "NewMultipartUpload": "POST",
    "CompleteMultipartUpload": "POST",
    "AbortMultipartUpload": "DELETE",
    "DeleteMultipleObjects": "DELETE",
}
MINIO_PREFIXES = (("Put", "PUT"), ("Get", "GET"), ("List", "LIST"), ("Head", "HEAD"), ("Delete", "DELETE"))


def minio_kind(name: str) -> str:
    """The kind (one of KINDS) of a request MinIO counted under this API name."""
    if name in MINIO_KINDS:
        return MINIO_KINDS[name]
    return next((kind for prefix, kind in MINIO_PREFIXES if name.startswith(prefix)), "POST")


def minio_counters(text: str) -> Counter[str]:
    """Requests by kind from MinIO's metrics page (Prometheus text), summed over its servers."""
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("minio_api_requests_total{") and 'type="s3"' in line:
            labels, _, value = line.rpartition(" ")
            name = labels.split('name="', 1)[1].split('"', 1)[0]
            counts[minio_kind(name)] += int(float(value))
    return counts


class MinioCount:
    """What MinIO at `endpoint` served since the last take(): its own counters, the bucket's new keys, and the GETs
    of the clients watched."""

    by = "the endpoint"

    def __init__(self, endpoint: str, bucket: str, client: Any) -> None:
        self.metrics = f"{endpoint}/minio/metrics/v3/api/requests"
        self.bucket = bucket
        self.client = client  # lists the bucket: between the readings, so that its LIST is nobody's
        self.gets: list[Request] = []
        self.lock = threading.Lock()
        self.counted = self.read()
        self.keys = self.listing()
        self.counted = self.read()

    def read(self) -> Counter[str]:
        with urllib.request.urlopen(self.metrics, timeout=10) as page:  # noqa: S310 - loopback http, ours
            return minio_counters(page.read().decode())

    def listing(self) -> set[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        return {item["Key"] for page in pages for item in page.get("Contents", [])}

    def watch(self, client: Any) -> None:
        """Record each GetObject this client sends (key and Range), as the proxy does."""

        def record(request: Any, **_: Any) -> None:
            _bucket, _slash, key = unquote(urlsplit(request.url).path).lstrip("/").partition("/")
            span = request.headers.get("Range") or ""
            with self.lock:
                self.gets.append(Request("GET", key, span.decode() if isinstance(span, bytes) else span))

        client.meta.events.register("before-send.s3.GetObject", record)

    def take(self) -> Tally:
        """The requests since the last take, and a fresh count from now on."""
        now = self.read()
        keys = self.listing()
        with self.lock:
            gets, self.gets = self.gets, []
        taken = Tally(Counter(now - self.counted), keys - self.keys, gets)
        self.keys, self.counted = keys, self.read()
        return taken


@contextlib.contextmanager
def counting_proxy(upstream: str) -> Iterator[tuple[str, Tally]]:
    """A proxy on a free loopback port in front of upstream (http://host:port); yields its URL and its tally."""
    target = urlsplit(upstream)
    if target.scheme != "http" or not target.hostname or not target.port:
        raise ProxyError(f"the counting proxy relays plain http://host:port endpoints, not {upstream!r}")
    address = (target.hostname, target.port)
    tally = Tally()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener closed: the proxy is done
            threading.Thread(target=serve, args=(client, address, tally), daemon=True).start()

    acceptor = threading.Thread(target=accept, name="s3count-accept", daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{port}", tally
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        acceptor.join(5)


def serve(client: socket.socket, upstream: tuple[str, int], tally: Tally) -> None:
    """Relay one client connection's requests (keep-alive) to one upstream connection, counting each."""
    with client, socket.create_connection(upstream) as server:
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        from_client, to_client = client.makefile("rb"), client
        from_server, to_server = server.makefile("rb"), server
        with contextlib.suppress(ConnectionError, ProxyError):
            while True:
                head = read_head(from_client)
                if head is None:
                    return
                method, target, _ = head[0].split(" ", 2)
                request = classify(method, target)
                headers = header_map(head)
                if request.kind == "GET":
                    request = Request("GET", request.key, headers.get("range", ""))
                to_server.sendall(join_head(head))
                if headers.get("expect", "").lower() == "100-continue":
                    answer = read_response(from_server, to_client, request, tally, interim=True)
                    if answer is None:
                        return
                    if status_of(answer) != 100:  # refused before the body: the client may not send it
                        relay_body(from_server, to_client, header_map(answer), method, status_of(answer))
                        return
                relay_body(from_client, to_server, headers, method, None)
                response = read_response(from_server, to_client, request, tally)
                if response is None:
                    return
                answer_headers = header_map(response)
                relay_body(from_server, to_client, answer_headers, method, status_of(response))
                if answer_headers.get("connection", "").lower() == "close":
                    return


def read_response(
    source: BinaryIO, sink: socket.socket, request: Request, tally: Tally, *, interim: bool = False
) -> list[str] | None:
    """Relay the head of the server's answer (interim 100 Continue answers too, if asked for), and return it.

    The final answer is counted before the client sees it, so a tally taken right after a call includes it."""
    while True:
        head = read_head(source)
        if head is None:
            return None
        status = status_of(head)
        if status >= 200:
            tally.add(request, status)
        sink.sendall(join_head(head))
        if status >= 200 or (interim and status == 100):
            return head


def read_head(stream: BinaryIO) -> list[str] | None:
    """The start line and header lines of one message; None at a clean end of the connection."""
    lines: list[str] = []
    while True:
        line = stream.readline(65536)
        if not line:
            if lines:
                raise ProxyError("the connection closed inside a message head")
            return None
        if line in (b"\r\n", b"\n"):
            if lines:
                return lines
            continue
        lines.append(line.decode("latin-1").rstrip("\r\n"))


def join_head(lines: list[str]) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def header_map(head: list[str]) -> dict[str, str]:
    return {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in head[1:])}


def status_of(head: list[str]) -> int:
    return int(head[0].split(" ", 2)[1])


def relay_body(
    source: io.BufferedReader, sink: socket.socket, headers: dict[str, str], method: str, status: int | None
) -> None:
    """Copy one message body; status None for a request. HTTP/1.1's framing rules (RFC 9112, section 6.3)."""
    if status is not None and (method == "HEAD" or status in (204, 304) or 100 <= status < 200):
        return
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = source.readline(65536)
            sink.sendall(size_line)
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while (trailer := source.readline(65536)) not in (b"\r\n", b"\n", b""):
                    sink.sendall(trailer)
                sink.sendall(b"\r\n")
                return
            copy(source, sink, size + 2)  # the chunk and its CRLF
    elif "content-length" in headers:
        copy(source, sink, int(headers["content-length"]))
    elif status is not None:
        raise ProxyError("a response without a length: the proxy does not relay bodies ended by closing")


def copy(source: io.BufferedReader, sink: socket.socket, size: int) -> None:
    """Relay `size` bytes: those the reader holds already, then the rest spliced from its socket to the sink's in
    the kernel. A Python copy of every GiB here cost the store's S3 figures as much as the store's own work."""
    if not size:
        return
    ahead = source.peek(1)[:size]  # at most one read of the socket when the reader holds nothing
    if not ahead:
        raise ProxyError("the connection closed inside a message body")
    sink.sendall(source.read(len(ahead)))
    size -= len(ahead)
    if not size:
        return
    pipe_out, pipe_in = os.pipe()
    try:
        fcntl.fcntl(pipe_in, F_SETPIPE_SZ, PIPE_SIZE)
        while size:
            moved = os.splice(source.fileno(), pipe_in, min(size, PIPE_SIZE))
            if not moved:
                raise ProxyError("the connection closed inside a message body")
            size -= moved
            while moved:
                moved -= os.splice(pipe_out, sink.fileno(), moved)
    finally:
        os.close(pipe_out)
        os.close(pipe_in)
