"""Writing a whole file or object, and deleting one of ours: locally by the rules of storage/files.py; on a store
from a local temporary file in one request, with the manifest's conditional write (If-None-Match / If-Match where
the driver exposes them, checked just before elsewhere: FORMAT.md, "Object storage")."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from .faults import missing_bucket
from .files import UnsafeDestination, atomic_write, remove_file
from .places import StorePath, etag
from .reads import file_sha256

CONDITIONAL = ("s3", "s3a")  # protocols whose fsspec driver exposes If-None-Match / If-Match on a whole-object write


class StoreConflict(UnsafeDestination):
    """An object a writer was about to replace was changed by someone else since it read it (a conditional write
    refused), or the prefix's lease is held by another writer."""


def write_whole(path, write, *, conditional: bool = False) -> tuple[int, str] | None:
    """Write a whole file: locally atomic_write (returns None); on a store `write(f)` fills a local temporary file of
    ours (removed after), which is uploaded under the final name in one request (a single PUT, or a multipart upload,
    which the store publishes only when complete); returns its (size, sha256). `conditional`: the object is written
    only if absent or still the one this process first saw (If-None-Match: * / If-Match: its ETag), else
    StoreConflict; on stores whose driver exposes no condition it is checked just before (FORMAT.md)."""
    if not isinstance(path, StorePath):
        atomic_write(path, write)
        return None
    session = path._s
    fd, tmp = tempfile.mkstemp(prefix=f"refcache-upload-{os.getpid()}-", suffix=f"-{path.name}")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        size, digest = os.path.getsize(tmp), file_sha256(tmp)
        if conditional:
            _conditional_put(path, Path(tmp).read_bytes())
        else:
            path.fs.put_file(tmp, path.key)
    finally:
        os.unlink(tmp)
    path.fs.invalidate_cache(path.key)
    there = path.fs.info(path.key).get("size")
    if there != size:  # a failed multipart upload some drivers do not raise
        raise OSError(errno.EIO, f"{path.url}: {size} bytes were uploaded, the store holds {there}")
    if session.lease is not None:
        session.lease.check()
    return size, digest


class Refused(Exception):
    """A conditional write the store refused: the object was not as expected."""


def put_if(path: StorePath, data: bytes, expected: str | None) -> str | None:
    """Write `data` as `path` only if the object is absent (expected None) or still has ETag `expected`; returns the
    new ETag, or raises Refused. On S3 the store decides (If-None-Match: * / If-Match); on stores whose driver
    exposes no condition it is checked just before the write, which leaves a window (FORMAT.md)."""
    fs, key = path.fs, path.key
    if path._s.protocol in CONDITIONAL:
        try:
            out = fs.pipe_file(key, data, **({"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}))
        except FileExistsError:
            raise Refused() from None
        except OSError as e:  # botocore's 412 PreconditionFailed (s3fs: EINVAL), or If-Match on a missing key
            if isinstance(e, FileNotFoundError):
                # no object to compare with is the condition failing, but only where the bucket exists: a write
                # into a missing bucket is not another writer's doing
                fault = missing_bucket(path.parent)
                if fault is not None:
                    raise fault from None
                raise Refused() from None
            if e.errno == errno.EINVAL and "condition" in str(e).lower():
                raise Refused() from None
            raise
        return (out or {}).get("ETag") or etag(path.info())
    fs.invalidate_cache(key)
    if etag(path.info()) != expected:
        raise Refused()
    fs.pipe_file(key, data)
    return etag(path.info())


def _conditional_put(path: StorePath, data: bytes) -> None:
    session = path._s
    if session.lease is not None:
        session.lease.check()  # a writer whose lease was taken over writes no manifest
    if path.key not in session.seen:
        path.exists()  # first seen now
    expected = session.seen[path.key]
    try:
        session.seen[path.key] = put_if(path, data, expected)
    except Refused:
        raise StoreConflict(f"{path.url} was {'created' if expected is None else 'changed'} by another writer since "
                            "this job read it; nothing was overwritten: re-run the command to resume from what is "
                            "there now") from None


def remove(path) -> None:
    """Delete a file or object of ours (nothing if missing): locally storage.files.remove_file."""
    if not isinstance(path, StorePath):
        remove_file(path)
        return
    try:
        path.fs.rm_file(path.key)
    except FileNotFoundError:
        pass
    path._s.seen[path.key] = None
    path.fs.invalidate_cache(path.key)
