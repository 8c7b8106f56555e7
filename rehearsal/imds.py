"""A per-VM instance metadata service: the IMDSv2 paths the agent reads.

It listens on the host end of the VMs' network (`host`); inside the VM, 169.254.169.254:80 is
forwarded to it (rehearsal.vm.VmNetwork), so the agent uses its default endpoint, as on EC2.

Tags are read live from the local cloud (spotcr:error may be added while the VM runs);
`spot/instance-action` is 404 until the interruption injector sets it, as on EC2.
"""

from __future__ import annotations

import json
import secrets
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"  # noqa: S105 (a header name)
TOKEN_HEADER = "X-aws-ec2-metadata-token"  # noqa: S105 (a header name)


class Imds:
    """Serves one instance's metadata until `stop()`."""

    def __init__(
        self,
        instance_id: str,
        instance_type: str,
        availability_zone: str,
        user_data: bytes,
        tags: Callable[[], Mapping[str, str]],
        *,
        host: str = "127.0.0.1",
    ) -> None:
        self.instance_id = instance_id
        self.instance_type = instance_type
        self.availability_zone = availability_zone
        self.user_data = user_data
        self.tags = tags
        self.instance_action: dict[str, str] | None = None
        self.rebalance: dict[str, str] | None = None  # {"noticeTime": ...} once a rebalance recommendation came
        self.local_ipv4 = ""
        self._token = secrets.token_hex(16)
        self._server = ThreadingHTTPServer((host, 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"imds-{instance_id}", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """Where the host reaches it; a VM uses http://169.254.169.254."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _resolve(self, path: str) -> str | bytes | None:
        if path == "/latest/user-data":
            return self.user_data or None
        meta = "/latest/meta-data/"
        if not path.startswith(meta):
            return None
        key = path[len(meta) :]
        values: dict[str, str | None] = {
            "instance-id": self.instance_id,
            "instance-type": self.instance_type,
            "placement/availability-zone": self.availability_zone,
            "placement/region": self.availability_zone[:-1],
            "local-ipv4": self.local_ipv4 or None,
            "spot/instance-action": json.dumps(self.instance_action) if self.instance_action else None,
            "events/recommendations/rebalance": json.dumps(self.rebalance) if self.rebalance else None,
        }
        if key in values:
            return values[key]
        if key.rstrip("/") == "tags/instance":
            return "\n".join(sorted(self.tags()))
        if key.startswith("tags/instance/"):
            return self.tags().get(key[len("tags/instance/") :])
        return None

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        imds = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def _reply(self, status: int, body: bytes = b"") -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:
                if self.path == "/latest/api/token" and self.headers.get(TOKEN_TTL_HEADER):
                    self._reply(200, imds._token.encode())
                else:
                    self._reply(400)

            def do_GET(self) -> None:
                if self.headers.get(TOKEN_HEADER) != imds._token:
                    self._reply(401)
                    return
                value = imds._resolve(urllib.parse.unquote(self.path.split("?", 1)[0]))
                if value is None:
                    self._reply(404)
                else:
                    self._reply(200, value if isinstance(value, bytes) else value.encode())

        return Handler
