"""The blob store's S3 backend: s3fs (over aiobotocore) on S3 or an S3-compatible server.

:class:`nbfleet.storage.blobs.BlobStore` checks keys and hands an ``s3://`` URL's
work to :class:`S3Backend`, which talks in the store's keys (relative to its
prefix). Credentials, region and endpoint come from what botocore reads
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``,
``AWS_ENDPOINT_URL`` for an S3-compatible server, or ``~/.aws``), never from a
command line.

- Keys are stored verbatim: s3fs cuts a path at ``?versionId=`` (its syntax for an
  object's version), so a file named ``notes.txt?versionId=1`` would overwrite
  ``notes.txt``; :class:`_VerbatimS3` never does (nbfleet uses no versions).
- Listings are never cached: the control plane and every agent write the same
  bucket, and s3fs answers ``info`` (which ``cat_file`` asks first) from a cached
  listing of the parent, which hides another process's new objects.
- Objects are written as ``application/octet-stream`` and presigned URLs make S3
  answer with that type and ``Content-Disposition: attachment``: a job's
  ``report.html`` must download, never render as a page of the endpoint's origin.
- Deletions and listings name objects (DeleteObjects, ListObjectsV2) rather than
  going through ``fs.rm`` and ``fs.find``, which expand ``*`` and ``[...]`` in a
  user's file name as a glob and report directory placeholders as objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import re
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from botocore.exceptions import ClientError, NoCredentialsError
from fsspec.asyn import sync
from s3fs import S3FileSystem

from nbfleet.model.errors import InvalidInput, NotFound, Unavailable
from nbfleet.storage.blobs import BlobInfo, BlobStoreUnusable, PathConflict

#: URL schemes served by s3fs.
S3_PROTOCOLS = ("s3", "s3a")

#: S3's longest key, in bytes of UTF-8, the store's prefix included.
MAX_KEY_BYTES = 1024

#: How every object is stored and served: bytes, never a page or an image.
OCTET_STREAM = "application/octet-stream"

#: Keys per DeleteObjects request, S3's limit.
_DELETE_BATCH = 1000

#: ``s3://bucket`` or ``s3://bucket/prefix``: a bucket name as S3's rules allow
#: (and legacy names with capitals or ``_``), nothing after the path.
_URL = re.compile(r"(?P<scheme>s3a?)://(?P<bucket>[A-Za-z0-9][A-Za-z0-9._-]{1,254})"
                  r"(?:/(?P<prefix>[^?#]*))?")

#: s3fs options: a private instance (fsspec's shared one would share its caches,
#: and is not fork-safe), no listings cache (see the module docstring), and
#: SigV4, which every S3-compatible server accepts, for presigned URLs too.
_OPTIONS: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False,
                            "config_kwargs": {"signature_version": "s3v4"}}

#: For the start-up check: one attempt, and a short wait for a connection, so an
#: unreachable endpoint is an answer within seconds rather than after retries.
_CHECK_OPTIONS: dict[str, Any] = {
    **_OPTIONS, "config_kwargs": {"signature_version": "s3v4", "connect_timeout": 3,
                                  "read_timeout": 10,
                                  "retries": {"mode": "standard", "total_max_attempts": 1}}}


class _VerbatimS3(S3FileSystem):  # type: ignore[misc]
    """s3fs with keys taken as they are: ``bucket/key`` split at the first ``/``
    only, never at ``?versionId=``."""

    def split_path(self, path: str) -> tuple[str, str, None]:
        trail = path[len(path.rstrip("/")):]
        bucket, _, key = self._strip_protocol(path).lstrip("/").partition("/")
        return bucket, f"{key}{trail}" if key else "", None


class _CheckS3(_VerbatimS3):
    retries = 1  # s3fs's own retries, on top of botocore's


def parse_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://bucket[/prefix]``; ValueError for anything else."""
    match = _URL.fullmatch(url)
    if match is None:
        raise ValueError(f"{url!r} is not s3://bucket or s3://bucket/prefix")
    prefix = (match["prefix"] or "").rstrip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"{url!r}: the prefix must be plain names separated by single '/'")
    return match["bucket"], prefix


def content_disposition(filename: str) -> str:
    """``attachment`` with ``filename``: quoted (``"`` and ``\\`` escaped, anything
    outside printable ASCII replaced), and the exact name in RFC 5987's
    ``filename*`` when that changed it."""
    plain = "".join(c if " " <= c <= "~" else "_" for c in filename)
    header = 'attachment; filename="{}"'.format(plain.replace("\\", "\\\\").replace('"', '\\"'))
    if plain != filename:
        header += f"; filename*=UTF-8''{quote(filename, safe='')}"
    return header


class S3Backend:
    """The objects under ``s3://bucket/prefix``, by the store's keys."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.bucket, self.prefix = parse_url(url)
        self.fs = _VerbatimS3(**_OPTIONS)
        #: ``bucket/prefix``, as s3fs names paths.
        self.root = f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket

    # -- keys ------------------------------------------------------------------
    def object_key(self, key: str) -> str:
        """The S3 key of a store's key: the prefix, then the key."""
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fits(self, key: str) -> bool:
        return len(self.object_key(key).encode("utf-8")) <= MAX_KEY_BYTES

    def _writable(self, key: str) -> str:
        if not self._fits(key):
            raise InvalidInput(f"{key}: too long for S3, whose keys (with the store's "
                               f"prefix) are at most {MAX_KEY_BYTES} bytes", path=key)
        return self.object_key(key)

    def _path(self, object_key: str) -> str:
        return f"{self.bucket}/{object_key}"

    # -- the start-up check -------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`BlobStoreUnusable` unless the store's prefix can be listed.
        A one-key listing of the prefix, not HeadBucket: that needs s3:ListBucket on
        the whole bucket, which a policy scoped to the prefix does not grant."""
        fs = _CheckS3(**_CHECK_OPTIONS)
        try:
            fs.call_s3("list_objects_v2", Bucket=self.bucket,
                       Prefix=f"{self.prefix}/" if self.prefix else "", MaxKeys=1)
        except FileNotFoundError:
            raise BlobStoreUnusable(f"{self.url}: no such bucket: {self.bucket}") from None
        except PermissionError:
            raise BlobStoreUnusable(
                f"{self.url}: access to bucket {self.bucket} was refused: check the "
                "credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or ~/.aws) and "
                "that they may list and use this prefix") from None
        except NoCredentialsError:
            raise BlobStoreUnusable(
                f"{self.url}: no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "in the environment (or use ~/.aws)") from None
        except Exception as exc:  # botocore's own: no endpoint, a bad region, ...
            raise BlobStoreUnusable(f"{self.url}: {type(exc).__name__}: {exc}") from None

    # -- writing -----------------------------------------------------------------
    def put(self, key: str, data: bytes, check_tree: bool) -> None:
        object_key = self._writable(key)
        if check_tree:
            self._check_tree(key, object_key)
        with _refused(key):
            self.fs.pipe_file(self._path(object_key), data, ContentType=OCTET_STREAM)

    def put_file(self, key: str, local: str, check_tree: bool) -> None:
        object_key = self._writable(key)
        if check_tree:
            self._check_tree(key, object_key)
        with _refused(key):
            self.fs.put_file(local, self._path(object_key), ContentType=OCTET_STREAM)

    def _check_tree(self, key: str, object_key: str) -> None:
        """What a filesystem refuses: a key under an object (``a.txt/b`` when
        ``a.txt`` exists), or an object where others are under it. One HEAD per
        parent and a one-key listing, all at once."""
        parents = [object_key[:i] for i, c in enumerate(object_key)
                   if c == "/" and i > len(self.prefix)]
        client = self.fs.s3  # connects, outside the event loop

        async def probe() -> list[bool]:
            return list(await asyncio.gather(
                *(self._head(client, parent) for parent in parents),
                self._has_children(client, object_key)))

        found: list[bool] = sync(self.fs.loop, probe)
        if any(found[:-1]):
            raise PathConflict(key, "a parent of this path is a file")
        if found[-1]:
            raise PathConflict(key, "a directory of this name exists")

    async def _head(self, client: Any, object_key: str) -> bool:
        """Whether an object of this key exists. S3 answers 403 rather than 404 for a
        missing key to credentials without s3:ListBucket: that is the deployment's
        to fix, so it is a clear 503, never a guess."""
        try:
            await client.head_object(Bucket=self.bucket, Key=object_key)
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if status == 404 or code in ("404", "NoSuchKey", "NotFound"):
                return False
            if status == 403 or code in ("403", "AccessDenied", "Forbidden"):
                raise Unavailable(
                    f"the blob store refused to say whether {object_key} exists (403): "
                    f"its credentials need s3:GetObject on {self.url} and s3:ListBucket "
                    "on this prefix") from None
            raise
        return True

    async def _has_children(self, client: Any, object_key: str) -> bool:
        out = await client.list_objects_v2(Bucket=self.bucket, Prefix=f"{object_key}/",
                                           MaxKeys=1)
        return bool(out.get("Contents"))

    def exists(self, key: str) -> bool:
        if not self._fits(key):
            return False
        client = self.fs.s3
        return bool(sync(self.fs.loop, self._head, client, self.object_key(key)))

    # -- reading -----------------------------------------------------------------
    def get(self, key: str) -> bytes:
        if not self._fits(key):
            raise NotFound(f"no such file: {key}")
        with _refused(key), _missing(key):
            data: bytes = self.fs.cat_file(self._path(self.object_key(key)))
        return data

    def get_file(self, key: str, local: str) -> None:
        if not self._fits(key):
            raise NotFound(f"no such file: {key}")
        with _refused(key), _missing(key):
            self.fs.get_file(self._path(self.object_key(key)), local)

    def signed_url(self, key: str, expires_in_s: int, filename: str) -> str:
        """A presigned GET that S3 answers as a download of ``filename``, whatever
        type the object was stored with."""
        return str(self.fs.sign(self._path(self.object_key(key)),
                                expiration=max(1, int(expires_in_s)),
                                ResponseContentDisposition=content_disposition(filename),
                                ResponseContentType=OCTET_STREAM))

    def list(self, prefix: str) -> list[BlobInfo]:
        """Every object under ``prefix``, by keys relative to it. A name ending in
        ``/`` is a directory placeholder (as consoles create), never a blob."""
        if not self._fits(prefix):
            return []
        start = f"{self.object_key(prefix)}/"
        out: list[BlobInfo] = []
        for item in self._objects(start):
            name = str(item["Key"])
            if name.endswith("/"):
                continue
            modified = item.get("LastModified")
            out.append(BlobInfo(name[len(start):], int(item.get("Size") or 0),
                                modified.astimezone(UTC) if isinstance(modified, datetime)
                                else None))
        return sorted(out, key=lambda blob: blob.key)

    def _objects(self, start: str) -> Iterator[dict[str, Any]]:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": start}
        while True:
            with _refused(start):
                page = self.fs.call_s3("list_objects_v2", **kwargs)
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    # -- deleting ----------------------------------------------------------------
    def delete(self, key: str) -> None:
        if not self.exists(key):
            raise NotFound(f"no such file: {key}")
        with _refused(key):
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.object_key(key))

    def delete_prefix(self, prefix: str) -> None:
        """The objects under it, and one of its own name, as a local store's removal
        of a directory or a file would."""
        if not self._fits(prefix):
            return
        base = self.object_key(prefix)
        found = [str(item["Key"]) for item in self._objects(f"{base}/")]
        self._delete_objects([*found, base])

    def delete_many(self, keys: Sequence[str]) -> None:
        """These keys, a thousand to a request; one that is not there is no error."""
        self._delete_objects([self.object_key(key) for key in keys if self._fits(key)])

    def _delete_objects(self, keys: Sequence[str]) -> None:
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": key} for key in keys[start:start + _DELETE_BATCH]]
            with _refused(batch[0]["Key"]):
                out = self.fs.call_s3("delete_objects", Bucket=self.bucket,
                                      Delete={"Objects": batch, "Quiet": True})
            if out.get("Errors"):
                first = out["Errors"][0]
                raise OSError(errno.EIO, f"cannot delete {first.get('Key')}: "
                                         f"{first.get('Code')} {first.get('Message')}")


@contextlib.contextmanager
def _missing(key: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError as exc:
        raise NotFound(f"no such file: {key}") from exc


@contextlib.contextmanager
def _refused(what: str) -> Iterator[None]:
    """S3 refused the deployment's credentials (s3fs says PermissionError): a clear
    503 for whoever runs the fleet, not a 500."""
    try:
        yield
    except PermissionError as exc:
        raise Unavailable(f"the blob store refused access to {what}: {exc}") from None
