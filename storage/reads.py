"""Reading a file or an object whole, hashed as it is read (the sha256 every manifest entry and stamp is made of), or
ranged (`source`: what pyarrow reads a shard from)."""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

from .places import StorePath

CHUNK = 8 * 2**20  # bytes per read while hashing a file or streaming an object


def file_sha256(path: str | os.PathLike, chunk: int = CHUNK) -> str:
    """The sha256 of a local file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hashed(path) -> tuple[str, Path | StorePath]:
    """The sha256 of a file or object, and the path to read it by from then on: an object is streamed once, its
    bytes hashed as they arrive and held in memory (one shard at a time), so its footer and columns are read from
    what was verified, not fetched again."""
    if not isinstance(path, StorePath):
        return file_sha256(path), path
    h, parts = hashlib.sha256(), []
    with path.fs.open(path.key, "rb", cache_type="none") as f:
        while block := f.read(CHUNK):
            h.update(block)
            parts.append(block)
    return h.hexdigest(), path.with_content(b"".join(parts))


def sha256(path) -> str:
    return hashed(path)[0]


def measure(path) -> tuple[int, str]:
    """(size, sha256) of a written file or object."""
    if not isinstance(path, StorePath):
        return Path(path).stat().st_size, file_sha256(path)
    digest, held = hashed(path)
    return len(held.content), digest


@contextlib.contextmanager
def source(path):
    """What pyarrow reads a shard from: the local path; an object's verified bytes; else the object opened for
    ranged reads (only the footer and the column chunks asked for are fetched)."""
    if not isinstance(path, StorePath):
        yield path
    elif path.content is not None:
        import pyarrow as pa

        yield pa.BufferReader(path.content)
    else:
        with path.fs.open(path.key, "rb", cache_type="none") as f:
            yield f


RECORD_LIMIT = 256 * 2**20  # a manifest of a million shards is about 300 MB; every other record far less


class NotARecord(OSError):
    """A record file (a manifest, a run record, a config.json) that is not a regular file (`kind`: what it is), or
    larger than any record is (`size`, when known): refused without reading it, or waiting on it."""

    def __init__(self, message: str, kind: str | None = None, size: int | None = None):
        super().__init__(message)
        self.kind, self.size = kind, size


def _not_regular(mode: int) -> str | None:
    """What a file of st_mode `mode` is when it is not a regular file (None: it is one)."""
    import stat

    if stat.S_ISREG(mode):
        return None
    return "a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a device or socket"


def record_bytes(path, limit: int = RECORD_LIMIT) -> bytes:
    """The bytes of a record file: a regular file (a symlink to one is fine), read bounded from the descriptor its
    kind was judged on; a FIFO, a device or a folder is refused (NotARecord) without a read that could wait forever
    or never end (a symlink to /dev/zero), and so is a file over `limit`. An object in a store is read as it is."""
    if isinstance(path, StorePath):
        return path.read_bytes()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except IsADirectoryError:
        raise NotARecord(f"{path}: a folder, not a regular file", kind="a folder") from None
    st = os.fstat(fd)
    why = _not_regular(st.st_mode)
    if why or st.st_size > limit:
        os.close(fd)
        raise (NotARecord(f"{path}: {why}, not a regular file", kind=why) if why else
               NotARecord(f"{path}: {st.st_size:,} bytes, more than a file of this kind holds ({limit:,})",
                          size=st.st_size))
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew while read
        raise NotARecord(f"{path}: more than {limit:,} bytes, more than a file of this kind holds")
    return data


def unreadable(path) -> str | None:
    """Why the file at `path` cannot be read as a file, as a clause ("it is a folder, not a file"; None: a regular
    file this process may read; a symlink to one is fine): a folder, a FIFO, a device or socket, or a file it may not
    open. Judged on the descriptor opened with O_NONBLOCK, so a FIFO without a writer is refused, never waited on;
    nothing is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except IsADirectoryError:
        return "it is a folder, not a file"
    except OSError as e:
        return f"opening it fails ({e.strerror})"
    try:
        kind = _not_regular(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    if kind == "a folder":
        return "it is a folder, not a file"
    return f"it is {kind}, not a regular file" if kind else None
