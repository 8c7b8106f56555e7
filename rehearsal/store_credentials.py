"""A stand-in for the store-credentials function URL (AuthType AWS_IAM), on the VMs' network.

moto serves no function URLs with IAM auth. In AWS, Lambda checks the SigV4 signature and names the caller's
instance profile session in the event; here the caller is known by its VM address on the rehearsal bridge (every
local VM has its own), and the event is built as Lambda builds it, then given to the real handler.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

InstanceAt = Callable[[str], str | None]  # VM address -> instance id
Handler = Callable[[dict[str, Any]], dict[str, Any]]


def url_event(
    *, account: str, role_name: str, instance_id: str, source_ip: str, path: str, query: str, user_agent: str
) -> dict[str, Any]:
    """A function URL request event (payload 2.0) for a caller signing with an instance profile session."""
    now = datetime.now(UTC)
    return {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": path,
        "rawQueryString": query,
        "headers": {"user-agent": user_agent},
        "queryStringParameters": dict(parse_qsl(query)) or None,
        "requestContext": {
            "accountId": account,
            "apiId": "rehearsal",
            "authentication": None,
            "authorizer": {
                "iam": {
                    "accessKey": "ASIAREHEARSALEXAMPLE",
                    "accountId": account,
                    "callerId": f"AROAREHEARSALEXAMPLE:{instance_id}",
                    "cognitoIdentity": None,
                    "principalOrgId": None,
                    "userArn": f"arn:aws:sts::{account}:assumed-role/{role_name}/{instance_id}",
                    "userId": f"AROAREHEARSALEXAMPLE:{instance_id}",
                }
            },
            "domainName": "rehearsal.lambda-url.local",
            "domainPrefix": "rehearsal",
            "http": {
                "method": "GET",
                "path": path,
                "protocol": "HTTP/1.1",
                "sourceIp": source_ip,
                "userAgent": user_agent,
            },
            "requestId": str(uuid.uuid4()),
            "routeKey": "$default",
            "stage": "$default",
            "time": now.strftime("%d/%b/%Y:%H:%M:%S +0000"),
            "timeEpoch": int(time.time() * 1000),
        },
        "isBase64Encoded": False,
    }


def serve(address: str, *, account: str, role_name: str, instance_at: InstanceAt, handler: Handler) -> Any:
    """Serve the stand-in on address (any free port); returns the server (`server_address`, `shutdown()`)."""

    class Request(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            caller = self.client_address[0]
            instance_id = instance_at(caller)
            if instance_id is None:
                # Lambda answers 403 to a request it cannot authenticate; here: an address that is no local VM.
                self._answer(403, {"message": f"Forbidden: {caller} is no local VM"})
                return
            split = urlsplit(self.path)
            event = url_event(
                account=account,
                role_name=role_name,
                instance_id=instance_id,
                source_ip=caller,
                path=split.path or "/",
                query=split.query,
                user_agent=self.headers.get("user-agent", ""),
            )
            response = handler(event)
            self._answer(int(response.get("statusCode", 200)), json.loads(response.get("body") or "{}"))

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            del format, args

    server = ThreadingHTTPServer((address, 0), Request)
    threading.Thread(target=server.serve_forever, name="store-credentials-url", daemon=True).start()
    return server
