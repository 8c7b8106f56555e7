"""S3: a put's checksum checked as S3 checks it; and a hook before S3 serves a request, where the fault suite
(tests/faults) injects a store failure at an exact point: an outage (StoreFault) or an action at that moment (an agent
killed mid-upload)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from werkzeug.exceptions import Forbidden

from rehearsal.localaws import wrap

# The algorithms whose value moto computes as S3 does (it takes CRC32C and CRC64NVME for CRC32 without their libraries).
CHECKED_ALGORITHMS = ("CRC32", "SHA1", "SHA256")


def verify_checksums(patches: contextlib.ExitStack) -> None:
    """Until `patches` closes, a PutObject whose x-amz-checksum-<algorithm> is not its body's is refused, HTTP 400
    BadDigest, as S3 refuses it ("Checking object integrity in Amazon S3", Amazon S3 User Guide); moto keeps any
    value it is given (a TODO in its S3Response._get_checksum)."""
    from moto.s3.exceptions import S3ClientError
    from moto.s3.responses import S3Response
    from moto.s3.utils import compute_checksum

    def make(original: Any) -> Any:
        def checked(response: Any, response_headers: dict[str, Any]) -> tuple[str, str | None]:
            algorithm, value = original(response, response_headers)
            given = response.headers.get(f"x-amz-checksum-{algorithm.lower()}") if algorithm else None
            if given and algorithm.upper() in CHECKED_ALGORITHMS:
                body = response.body if isinstance(response.body, bytes) else bytes(response.body or b"")
                if compute_checksum(body, algorithm=algorithm.upper()).decode() != given:
                    raise S3ClientError(
                        "BadDigest", f"The {algorithm.upper()} you specified did not match the calculated checksum."
                    )
            return algorithm, value

        return checked

    wrap(patches, S3Response, "_get_checksum", make)


# Called as (action, bucket, key) before S3 serves the request; it may raise StoreFault.
Fault = Callable[[str, str, str], None]
FAULTY_ACTIONS = ("head_bucket", "put_object", "get_object", "head_object", "list_objects", "list_objects_v2")


class StoreFault(Forbidden):
    """A store failure injected by the fault suite: S3 refuses the request (HTTP 403, as when a bucket policy or
    a KMS key stops the job's role). Unlike a 503 it is not retried, so the failure comes at a known point."""


def inject_faults(patches: contextlib.ExitStack, fault: Callable[[], Fault | None]) -> None:
    """Until `patches` closes, the hook `fault()` returns (None: none now) sees each request of FAULTY_ACTIONS."""
    from moto.s3.models import S3Backend

    def faulty(action: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def hooked(backend: Any, *args: Any, **kwargs: Any) -> Any:
                named = [kwargs.get("bucket_name"), kwargs.get("key_name")]
                positional = [a for a in args if isinstance(a, str)]
                bucket = str(named[0] or (positional.pop(0) if positional else ""))
                key = str(named[1] or (positional[0] if positional and action.endswith("_object") else ""))
                hook = fault()
                if hook is not None:
                    hook(action, bucket, key)
                return original(backend, *args, **kwargs)

            return hooked

        return make

    for action in FAULTY_ACTIONS:
        wrap(patches, S3Backend, action, faulty(action))
