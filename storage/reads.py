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


def unreadable(path) -> str | None:
    """Why the file at `path` cannot be read as a file, as a clause ("it is a folder, not a file"; None: a regular file this process may read; a symlink to one
    is fine): a folder, a FIFO, a device or socket, or a file it may not open. Judged on the descriptor opened with
    O_NONBLOCK, so a FIFO without a writer is refused, never waited on; nothing is read."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except IsADirectoryError:
        return "it is a folder, not a file"
    except OSError as e:
        return f"opening it fails ({e.strerror})"
    try:
        mode = os.fstat(fd).st_mode
    finally:
        os.close(fd)
    if stat.S_ISDIR(mode):
        return "it is a folder, not a file"
    if not stat.S_ISREG(mode):
        kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a device or socket"
        return f"it is {kind}, not a regular file"
    return None
