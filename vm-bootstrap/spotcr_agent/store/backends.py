"""Where checkpoint objects live: an S3 bucket, or a mounted file system (EBS, EFS, FSx for Lustre).

Both hold the same keys under the same layout; the store above them never knows which one it has.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import io
import os
import threading
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .errors import CheckpointExists, StoreError, StoreUnavailable

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
else:
    S3Client = Any


class ObjectNotFound(StoreError):
    def __init__(self, location: str) -> None:
        super().__init__(f"{location} does not exist")
        self.location = location


@dataclass(frozen=True)
class StoredObject:
    key: str
    size: int
    modified: float  # unix seconds


class Backend(Protocol):
    def describe(self, key: str = "") -> str:
        """A human-readable location of a key, for error messages."""
        ...

    def check(self) -> None:
        """Raise StoreUnavailable, naming the path or bucket, if objects cannot be written."""
        ...

    def put(self, key: str, data: bytes | memoryview) -> None: ...

    def put_new(self, key: str, data: bytes) -> None:
        """Write only if the key does not exist yet (manifests are never overwritten)."""
        ...

    def get(self, key: str) -> bytes: ...

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """`length` bytes of an object from `offset`, fewer where the object ends sooner."""
        ...

    def scan(self, prefix: str) -> Iterator[StoredObject]: ...

    def delete(self, keys: list[str]) -> None: ...

    def flush(self) -> None:
        """Make every put so far durable before a manifest refers to it."""
        ...


WRITE_BLOCK = 1024 * 1024  # a pack is written to a file in writes of this size: on ext4 here (Linux 6.18) one 32 MiB
# write() into a new file took 1.2-2.7 s per 256 MiB, 4 MiB writes up to 3 s, 1 MiB writes 0.13-0.44 s
DIRECT_BLOCK = 4096  # O_DIRECT writes whole blocks of the device's size (512 or 4096) from memory aligned alike
DIRECT_MIN = 1024 * 1024  # objects this large (packs) skip the page cache when their memory is page-aligned
SEND_BLOCK = 1024 * 1024  # a pack is handed to the HTTP connection in blocks of this size, uncopied (_ViewReader)


class DirectoryBackend:
    """Objects as files under a mount point: temp file, fdatasync, atomic rename; the directories renamed into are
    fsynced before a manifest (flush), which gets its own fsync and directory fsync.

    A pack is fdatasynced by the thread that writes it, while the commit goes on. A syncfs() of the whole mount
    before the manifest (what this did when each chunk was a file: 2.4 s against 4.7-6.6 s for 1 GiB of per-chunk
    fsyncs on ext4) also waited for whatever else was dirty there: a dump's scratch on the same disk, other jobs.

    A pack handed over in page-aligned memory (the store's pack buffers) is written with O_DIRECT, past the page
    cache: 1 GiB of packs to ext4 here took 0.05 s of CPU and 0.7 s, durable, against 1.1-2.5 s of CPU (copying
    into fresh page-cache pages) and 2.1-3.8 s buffered. Where the file system or the memory refuses it (tmpfs,
    unaligned bytes) the same bytes are written through the page cache.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._unsynced: set[Path] = set()
        self._lock = threading.Lock()

    def describe(self, key: str = "") -> str:
        return str(self.root / key) if key else str(self.root)

    def check(self) -> None:
        if not self.root.is_dir():
            raise StoreUnavailable(f"storage directory {self.root} does not exist (is the volume mounted?)")
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreUnavailable(f"storage directory {self.root} is not writable")

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self.root / key
        tmp = self._write_temp(path, data, sync=True)
        os.replace(tmp, path)
        with self._lock:
            self._unsynced.add(path.parent)

    def put_new(self, key: str, data: bytes) -> None:
        path = self.root / key
        tmp = self._write_temp(path, data, sync=True)
        try:
            os.link(tmp, path)  # link() fails if the name exists: an atomic create-if-absent
        except FileExistsError:
            raise CheckpointExists(Path(key).stem) from None
        finally:
            tmp.unlink()
        _fsync_dir(path.parent)

    def get(self, key: str) -> bytes:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(self.describe(key)) from None

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            fd = os.open(self.root / key, os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectNotFound(self.describe(key)) from None
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def scan(self, prefix: str) -> Iterator[StoredObject]:
        base = self.root / prefix
        if not base.is_dir():
            return
        for dirpath, _, names in os.walk(base):
            for name in names:
                path = Path(dirpath) / name
                with contextlib.suppress(FileNotFoundError):
                    st = path.stat()
                    yield StoredObject(path.relative_to(self.root).as_posix(), st.st_size, st.st_mtime)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                (self.root / key).unlink()

    def flush(self) -> None:
        """Each object put is durable already: make their names durable, with the directories made for them."""
        with self._lock:
            directories, self._unsynced = self._unsynced, set()
        synced: set[Path] = set()
        for renamed_into in directories:
            for directory in (renamed_into, *renamed_into.parents):
                if directory in synced or not directory.is_relative_to(self.root):
                    break
                _fsync_dir(directory)
                synced.add(directory)

    def _write_temp(self, path: Path, data: bytes | memoryview, *, sync: bool) -> Path:
        tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:12]}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:
            raise StoreUnavailable(f"storage directory {self.root} does not exist (is the volume mounted?)") from None
        except OSError as e:
            raise StoreUnavailable(f"cannot write under storage directory {path.parent}: {e.strerror or e}") from e
        try:
            view = memoryview(data)
            if len(view) >= DIRECT_MIN:
                view = view[_write_direct(fd, view[: len(view) - len(view) % DIRECT_BLOCK]) :]
            while view:
                view = view[os.write(fd, view[:WRITE_BLOCK]) :]
            if sync:
                os.fdatasync(fd)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreUnavailable(f"cannot write {tmp}: {e.strerror}") from e
        finally:
            os.close(fd)
        return tmp


def _write_direct(fd: int, view: memoryview) -> int:
    """Write whole blocks of view with O_DIRECT, as far as the file system and view's memory allow; return how many
    bytes were written. The descriptor is left without O_DIRECT, for the rest to go through the page cache."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return 0  # no O_DIRECT on this file system
        raise
    written = 0
    try:
        while written < len(view):
            written += os.write(fd, view[written : written + WRITE_BLOCK])
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise  # EINVAL: memory or file system not aligned for O_DIRECT; the rest goes buffered
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return written


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crc32_header(data: bytes | memoryview) -> str:
    """The body's CRC32 as S3's x-amz-checksum-crc32 carries it: S3 verifies every put by it (zlib's CRC32 runs at
    1.5-2.2 GiB/s a core here, SHA-256 at 1.1; every chunk is verified by its id on restore). No body is SHA-256'd
    for the request's signature either (payload_signing_enabled off: botocore does so on its own over HTTPS with a
    checksum, but on a plain-http endpoint, e.g. MinIO on loopback, the server then hashed it again to check).

    Given with the put, botocore computes none: its own pass read the body through the request's file object (a
    copy of every block, then the blocks again to send); zlib reads the pack's memory in place, outside the GIL
    (2 GiB of 32 MiB packs to MinIO, 4 at once: the client's CPU 1.09 s a GiB with botocore's pass, 0.88 with this)."""
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def _checksum(data: bytes | memoryview) -> dict[str, str]:
    """A put's checksum arguments: the value, and the algorithm's name, which S3 keeps with the object."""
    return {"ChecksumAlgorithm": "CRC32", "ChecksumCRC32": crc32_header(data)}


class S3Backend:
    """Objects in an S3 bucket: one shared, lazily made client; CRC32 checksums on put, checked on whole gets."""

    def __init__(
        self,
        bucket: str,
        max_connections: int = 32,
        region: str | None = None,
        client: S3Client | None = None,
        *,
        session: Any = None,
        scope: str = "",
    ) -> None:
        self.bucket = bucket
        self.region = region
        self.scope = scope  # the prefix these credentials are limited to (jobs/<job>/); empty: the whole bucket
        self._session = session
        self._max_connections = max_connections
        self._client = client
        self._lock = threading.Lock()

    @property
    def client(self) -> S3Client:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    import boto3
                    from botocore.config import Config

                    config = Config(
                        max_pool_connections=self._max_connections,
                        retries={"mode": "standard", "max_attempts": 6},
                        connect_timeout=5,
                        read_timeout=60,
                        s3={"payload_signing_enabled": False},
                    )
                    # AWS_ENDPOINT_URL (and the region, unless given) come from the environment, as boto3 reads them.
                    session = self._session or boto3.session.Session()
                    self._client = session.client("s3", region_name=self.region or None, config=config)
        return self._client

    def describe(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}"

    def check(self) -> None:
        try:
            if self.scope:
                # Credentials limited to one prefix may list only under it; HeadBucket would need the bucket.
                self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.scope, MaxKeys=1)
            else:
                self.client.head_bucket(Bucket=self.bucket)
        except Exception as e:
            raise StoreUnavailable(f"S3 bucket {self.bucket} cannot be used: {_error_text(e)}") from e

    def put(self, key: str, data: bytes | memoryview) -> None:
        body = data if isinstance(data, bytes) else _ViewReader(data)
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body, **_checksum(data))
        except Exception as e:
            raise self._translate(e, key) from e

    def put_new(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*", **_checksum(data))
        except Exception as e:
            if _error_code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise CheckpointExists(Path(key).stem) from e
            raise self._translate(e, key) from e

    def get(self, key: str) -> bytes:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
            return response["Body"].read()
        except Exception as e:
            if _error_code(e) in ("NoSuchKey", "404"):
                raise ObjectNotFound(self.describe(key)) from e
            raise self._translate(e, key) from e

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """A ranged GET: S3 checks no checksum of a part of an object; the store verifies each chunk's sha256."""
        try:
            part = f"bytes={offset}-{offset + length - 1}"
            return self.client.get_object(Bucket=self.bucket, Key=key, Range=part)["Body"].read()
        except Exception as e:
            if _error_code(e) in ("NoSuchKey", "404"):
                raise ObjectNotFound(self.describe(key)) from e
            if _error_code(e) in ("InvalidRange", "416"):
                return b""  # the object ends before offset
            raise self._translate(e, key) from e

    def scan(self, prefix: str) -> Iterator[StoredObject]:
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    yield StoredObject(obj["Key"], obj["Size"], obj["LastModified"].timestamp())
        except Exception as e:
            raise self._translate(e, prefix) from e

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start : start + 1000]]
            try:
                response = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            except Exception as e:
                raise self._translate(e, batch[0]["Key"]) from e
            if errors := response.get("Errors"):
                raise StoreError(f"could not delete {len(errors)} objects, first {errors[0]}")

    def flush(self) -> None:
        """S3 puts are durable when they return."""

    def _translate(self, error: Exception, key: str) -> Exception:
        code = _error_code(error)
        if code in ("NoSuchBucket", "AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return StoreUnavailable(f"S3 bucket {self.bucket} cannot be used ({code}) at {self.describe(key)}")
        return StoreError(f"S3 request for {self.describe(key)} failed: {_error_text(error)}")


class _ViewReader(io.RawIOBase):
    """A pack's memory as the file botocore reads (its CRC32, then the request body) and seeks in: a copy of the
    whole pack into fresh memory took as long as 4 pack writers sending it, here, in page faults alone.

    read() hands out the pack's own memory, SEND_BLOCK at a time however little is asked: urllib3 asks for 16 KiB
    and sends each block with a sendall() of its own, which copied every block into a new bytes first (1 GiB of
    32 MiB packs to MinIO, 4 at once: the client's CPU 0.98 s with 16 KiB copies, 0.78 s with this)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._at = 0

    def __len__(self) -> int:
        return len(self._view)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> memoryview:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._at + max(size, SEND_BLOCK))
        data = self._view[self._at : end]
        self._at = max(self._at, end)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self._view[self._at : self._at + len(buffer)]
        buffer[: len(data)] = data
        self._at += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def tell(self) -> int:
        return self._at


class Under:
    """Another backend's keys under `prefix`, seen as the whole store: `spotcr-agent probe` on a job VM keeps its
    scratch job inside the run's own prefix, the only one the run's store credentials may write."""

    def __init__(self, backend: Backend, prefix: str) -> None:
        self.backend = backend
        self.prefix = prefix

    def describe(self, key: str = "") -> str:
        return self.backend.describe(self.prefix + key)

    def check(self) -> None:
        self.backend.check()

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.backend.put(self.prefix + key, data)

    def put_new(self, key: str, data: bytes) -> None:
        self.backend.put_new(self.prefix + key, data)

    def get(self, key: str) -> bytes:
        return self.backend.get(self.prefix + key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.backend.get_range(self.prefix + key, offset, length)

    def scan(self, prefix: str) -> Iterator[StoredObject]:
        for found in self.backend.scan(self.prefix + prefix):
            yield replace(found, key=found.key.removeprefix(self.prefix))

    def delete(self, keys: list[str]) -> None:
        self.backend.delete([self.prefix + key for key in keys])

    def flush(self) -> None:
        self.backend.flush()


def _error_code(error: Exception) -> str:
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"
