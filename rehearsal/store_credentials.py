"""A stand-in for the store-credentials function URL (AuthType AWS_IAM), or the private API, on the VMs' network.

moto serves neither function URLs with IAM auth nor private APIs. This stand-in authenticates as AWS does: the
request must carry a SigV4 signature, for the address's service (`lambda` or `execute-api`), made with the secret of
a key the local AWS issued (a job VM's instance-profile session); then the caller's policies and the resource's own
(the function's permissions, the API's policy) must allow what AWS authorizes on the call (`StoreCredentialsAddress`,
read from the synthesized template). Anything else is refused with AWS's 403, before the function runs; an allowed
request becomes the event Lambda or API Gateway builds, naming the caller, and is given to the real handler.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from rehearsal.iam.enforce import Enforcer
from rehearsal.iam.principals import StoreCredentialsAddress

Handler = Callable[[dict[str, Any]], dict[str, Any]]

_AUTHORIZATION = re.compile(
    r"^AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<date>\d{8})/(?P<region>[^/]+)/(?P<service>[^/]+)/aws4_request,"
    r"\s*SignedHeaders=(?P<headers>[^,]+),\s*Signature=(?P<signature>[0-9a-f]{64})$"
)
# Lambda's and API Gateway's answers to a request they do not authenticate or authorize.
FORBIDDEN = "Forbidden"
INVALID_TOKEN = "The security token included in the request is invalid."  # noqa: S105 (a message)
BAD_SIGNATURE = "The request signature we calculated does not match the signature you provided."


class Refused(Exception):
    """A request AWS answers 403 to, before the function runs: the message is AWS's."""


def authenticate(
    method: str,
    url: str,
    headers: Mapping[str, str],
    *,
    service: str,
    region: str,
    secret_of: Callable[[str], str | None],
) -> str:
    """The access key that signed this request (SigV4, for `service` in `region`); Refused otherwise."""
    match = _AUTHORIZATION.match(headers.get("authorization", ""))
    if match is None:
        raise Refused(FORBIDDEN)  # unsigned, or not SigV4
    key = match["key"]
    secret = secret_of(key)
    if secret is None:
        raise Refused(INVALID_TOKEN)
    if (match["service"], match["region"]) != (service, region):
        raise Refused(f"Credential should be scoped to correct service: '{service}' in region '{region}'")
    signed = match["headers"].split(";")
    if "host" not in signed or "x-amz-date" not in signed or any(h not in headers for h in signed):
        raise Refused(BAD_SIGNATURE)
    request = AWSRequest(method=method, url=url, headers={h: headers[h] for h in signed})
    request.context["timestamp"] = headers["x-amz-date"]
    signer = SigV4Auth(Credentials(key, secret, headers.get("x-amz-security-token")), service, region)
    expected = signer.signature(signer.string_to_sign(request, signer.canonical_request(request)), request)
    if expected != match["signature"] or not headers["x-amz-date"].startswith(match["date"]):
        raise Refused(BAD_SIGNATURE)
    return key


def url_event(
    *, account: str, key: str, caller_arn: str, source_ip: str, path: str, query: str, user_agent: str
) -> dict[str, Any]:
    """A function URL request event (payload 2.0) for a caller authenticated with AWS_IAM."""
    now = datetime.now(UTC)
    caller_id = f"AROAREHEARSALEXAMPLE:{caller_arn.rsplit('/', 1)[-1]}"
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
                    "accessKey": key,
                    "accountId": account,
                    "callerId": caller_id,
                    "cognitoIdentity": None,
                    "principalOrgId": None,
                    "userArn": caller_arn,
                    "userId": caller_id,
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


def api_event(
    *, account: str, key: str, caller_arn: str, source_ip: str, path: str, query: str, user_agent: str
) -> dict[str, Any]:
    """A private REST API's proxy event (payload 1.0) for a caller authenticated with AWS_IAM."""
    parameters = parse_qsl(query)
    multi: dict[str, list[str]] = {}
    for name, value in parameters:
        multi.setdefault(name, []).append(value)
    return {
        "resource": "/",
        "path": path,
        "httpMethod": "GET",
        "headers": {"User-Agent": user_agent},
        "queryStringParameters": dict(parameters) or None,
        "multiValueQueryStringParameters": multi or None,
        "requestContext": {
            "accountId": account,
            "apiId": "rehearsal",
            "httpMethod": "GET",
            "identity": {
                "accessKey": key,
                "accountId": account,
                "caller": f"AROAREHEARSALEXAMPLE:{caller_arn.rsplit('/', 1)[-1]}",
                "sourceIp": source_ip,
                "userAgent": user_agent,
                "userArn": caller_arn,
            },
            "path": path,
            "requestId": str(uuid.uuid4()),
            "resourcePath": "/",
            "stage": "v1",
        },
        "body": None,
        "isBase64Encoded": False,
    }


def serve(
    address: str, *, account: str, region: str, store: StoreCredentialsAddress, enforcer: Enforcer, handler: Handler
) -> Any:
    """Serve the stand-in on address (any free port); returns the server (`server_address`, `shutdown()`)."""
    event_of = url_event if store.signing_service == "lambda" else api_event

    class Request(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            headers = {name.lower(): value for name, value in self.headers.items()}
            url = f"http://{headers.get('host', '')}{self.path}"
            try:
                key = authenticate(
                    "GET", url, headers, service=store.signing_service, region=region, secret_of=enforcer.secrets.get
                )
                principal, decision = enforcer.authorize(key, account, store.requests)
                if principal is None or not decision.allowed:
                    raise Refused(FORBIDDEN)
            except Refused as refused:
                self._answer(403, {"Message": str(refused)})
                return
            split = urlsplit(self.path)
            event = event_of(
                account=account,
                key=key,
                caller_arn=principal.arn,
                source_ip=self.client_address[0],
                path=split.path or "/",
                query=split.query,
                user_agent=headers.get("user-agent", ""),
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
