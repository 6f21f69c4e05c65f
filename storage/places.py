"""Where a cache lives, the one reading of a path-or-URL for every option, config key and rule: a local folder (a
`pathlib.Path`, written by the rules of storage/files.py) or a prefix on an object store named by an fsspec URL
(`s3://bucket/prefix`, `gs://`, `az://`, ...: a `StorePath`). `file://` URLs are local folders. Credentials and
endpoints come only from each store's own environment and config files (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL,
~/.aws/config; GOOGLE_APPLICATION_CREDENTIALS; AZURE_STORAGE_*): nothing of ours is passed to the filesystem.

A `StorePath` answers the part of pathlib's interface the cache's readers and writers use (`/`, name, is_file,
stat, read_text, glob, iterdir), so the rules of schemas/rules.py judge a remote cache as they judge a folder. What
is read and written on a store is in storage/reads.py, storage/writes.py and storage/lease.py; FORMAT.md, "Object
storage", says what each store guarantees."""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from .faults import Guarded
from .files import UnsafeDestination

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
# The stores a cache is written and read on end to end (the listings here, the whole-object writes and the lease of
# storage/writes.py and storage/lease.py, FORMAT.md "Object storage"), with the extra that installs each driver.
# `memory://` is fsspec's in-memory filesystem of this process (the tests' store without conditional writes). Any
# other protocol, and any fsspec protocol chain (`simplecache::s3://...`: a local cache layer that would write locally
# and upload later), is refused by name.
STORES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure",
          "memory": None}


class LocationError(UnsafeDestination, ValueError):
    """A path or URL refcache does not take: the message names what it is and what to give instead (a refusal like
    any unsafe destination, exit 2; a ValueError to a caller of the library)."""


def is_url(value) -> bool:
    return isinstance(value, str) and bool(URL.match(value))


def _protocol(text: str) -> str | None:
    """The fsspec protocol `text` starts with (`s3` of `s3://b/x`, `simplecache` of `simplecache::s3://b/x`, `s3` of
    a mistyped `s3:/b/x`), if fsspec knows it; None for a plain local path."""
    m = SCHEME.match(text)
    if not m:
        return None
    from fsspec.registry import known_implementations, registry

    name = m.group(1).lower()
    return name if name in known_implementations or name in registry or name in STORES else None


def location(value) -> Path | StorePath:
    """What a path-or-URL given to refcache names, the one reading of it for every option, config key and rule: a
    local `Path` (as given, not resolved: a symlink there must stay visible to the rules that refuse writing through
    one; `file:///PATH` and `file://localhost/PATH` are PATH), or a `StorePath` for a URL of a store in STORES.
    Anything else raises LocationError naming it: a file:// URL of another host, a protocol chain, another
    protocol, a URL missing its `//`, an empty text."""
    if isinstance(value, (StorePath, Path)):
        return value
    text = os.fspath(value)
    if not isinstance(text, str):
        text = os.fsdecode(text)
    if not text.strip():
        raise LocationError("an empty path names the current folder by accident; give the path")
    protocol = _protocol(text)
    if protocol is None:
        return Path(text)
    if "::" in text:
        last = text.rsplit("::", 1)[1]
        chain = "::".join(p.split("://", 1)[0] for p in text.split("::"))
        raise LocationError(f"{text}: the fsspec protocol chain {chain} is not supported (refcache writes and reads "
                            "a cache on the store itself, with its conditional writes and lease; a caching layer "
                            f"would write a local copy instead); give the store's own URL ({last})")
    if not URL.match(text):
        raise LocationError(f"{text}: starts like a {protocol}:// URL but has no '//' after '{protocol}:'; write the "
                            f"URL in full ({protocol}://...) or, for a local path, ./{text}")
    if protocol in ("file", "local"):
        return _file_url(text)
    if protocol not in STORES:
        names = ", ".join(f"{p}://" for p in STORES)
        raise LocationError(f"{text}: {protocol}:// is not a store refcache writes and reads caches on ({names}); "
                            "give a local path, or one of those")
    place = StorePath.open(text)
    if not place.key.strip("/"):
        raise LocationError(f"{text}: names no bucket or prefix; give {protocol}://BUCKET/PREFIX")
    return place


def _file_url(text: str) -> Path:
    """file:///PATH and file://localhost/PATH (RFC 8089, percent-decoded) as the local PATH."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(text)
    if parts.netloc not in ("", "localhost"):
        raise LocationError(f"{text}: a file:// URL on host {parts.netloc!r} names a file of another machine; give "
                            "the local path (or file:///PATH)")
    if parts.query or parts.fragment:
        raise LocationError(f"{text}: a file:// URL with a query or fragment ('?' or '#'); write those characters "
                            "as %3F and %23, or give the local path")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise LocationError(f"{text}: a file:// URL names an absolute path (file:///PATH); give the local path")
    return Path(path)


def named(value) -> str:
    """How a location is named to a person (pages, cards, summaries): a local path resolved, a store prefix by its
    URL (never as a local path, which it is not)."""
    place = location(value)
    return place.url if isinstance(place, StorePath) else str(place.resolve())


def is_remote(value) -> bool:
    """A location on a store: a StorePath, or text `location` reads as one (a URL of a store in STORES). A local
    path or a file:// URL is not, nor text `location` refuses."""
    if isinstance(value, StorePath):
        return True
    return is_url(value) and "::" not in value and _protocol(value) in STORES


class _Session:
    """What one StorePath root and every path made from it share: the filesystem, the ETag each object had when this
    process first saw it (None: absent then), and the writer's lease."""

    def __init__(self, fs, protocol: str):
        self.fs, self.protocol = fs, protocol
        self.seen: dict[str, str | None] = {}
        self.lease = None  # the writer's lease (storage.lease), while one is held


class StorePath:
    """An object (or prefix) on a store, shaped like the pathlib.Path methods the cache code calls."""

    def __init__(self, session: _Session, key: str, info: dict | None = None, content: bytes | None = None):
        self._s, self.key, self._info, self.content = session, key.rstrip("/"), info, content

    @classmethod
    def open(cls, url: str) -> StorePath:
        import fsspec.core

        try:
            fs, key = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            protocol = url.split("://", 1)[0]
            extra = STORES.get(protocol)
            hint = f" (pip install 'refcache[{extra}]')" if extra else ""
            raise LocationError(f"{url}: no filesystem for this URL{hint}: {e}") from None
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        return cls(_Session(Guarded(fs, url, protocol), protocol), key)

    # -- pathlib's shape ---------------------------------------------------------------------------------------
    @property
    def fs(self):
        return self._s.fs

    @property
    def url(self) -> str:
        return self.fs.unstrip_protocol(self.key)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"StorePath({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, StorePath) and other.url == self.url

    def __lt__(self, other) -> bool:
        return self.url < other.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __copy__(self) -> StorePath:
        return self

    def __deepcopy__(self, memo) -> StorePath:  # dataclasses.asdict of a config holding one: the same place
        return self

    def __reduce__(self):  # another process (a torchrun rank) opens the same URL with its own filesystem
        return StorePath.open, (self.url,)

    def __truediv__(self, name: str) -> StorePath:
        return StorePath(self._s, f"{self.key}/{name}")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        return Path(self.name).suffix

    @property
    def parent(self) -> StorePath:
        return StorePath(self._s, self.key.rsplit("/", 1)[0])

    def with_content(self, content: bytes) -> StorePath:
        return StorePath(self._s, self.key, self._info, content)

    def resolve(self) -> StorePath:
        return self

    def info(self) -> dict | None:
        """The object's listing entry (None: there is none), asked of the store each time unless listed."""
        if self._info is not None:
            return self._info
        self.fs.invalidate_cache(self.key)
        try:
            return self.fs.info(self.key)
        except FileNotFoundError:
            return None

    def exists(self) -> bool:
        info = self.info()
        self._s.seen.setdefault(self.key, etag(info))
        return info is not None

    def is_file(self) -> bool:
        info = self.info()
        return info is not None and info.get("type") == "file"

    def is_dir(self) -> bool:
        self.fs.invalidate_cache(self.key)
        return self.fs.isdir(self.key)

    def is_symlink(self) -> bool:
        return False  # a store has no links

    def stat(self) -> os.stat_result:
        info = self.info()
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", self.url)
        return lstat(self)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """A prefix needs no making (its bucket must exist)."""

    def read_bytes(self) -> bytes:
        if self.content is not None:
            return self.content
        with self.fs.open(self.key, "rb") as f:
            data = f.read()
            self._s.seen.setdefault(self.key, etag(getattr(f, "details", None) or self.info()))
        return data

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def iterdir(self):
        self.fs.invalidate_cache(self.key)
        for entry in self.fs.ls(self.key, detail=True):
            name = entry["name"].rstrip("/")
            if name != self.key:
                yield StorePath(self._s, name, entry)

    def glob(self, pattern: str):
        import fnmatch

        return [p for p in self.iterdir() if p.is_file() and fnmatch.fnmatchcase(p.name, pattern)]


def etag(info) -> str | None:
    """The version of an object as its listing entry gives it (None: no object): its ETag, else (a driver that
    reports none) its size and times."""
    if not info:
        return None
    tag = info.get("ETag") or info.get("etag")
    if tag:
        return tag
    when = [str(info[k]) for k in ("generation", "mtime", "LastModified", "last_modified", "created") if k in info]
    return f"size={info.get('size')};" + ";".join(when)


def lstat(path) -> os.stat_result:
    """os.lstat, and for an object its size and kind (a regular file, or a folder: a prefix holding objects)."""
    if not isinstance(path, StorePath):
        return os.lstat(path)
    info = path.info()
    if info is None:
        raise FileNotFoundError(errno.ENOENT, "no such object", path.url)
    mode = (stat.S_IFREG | 0o644) if info.get("type") == "file" else (stat.S_IFDIR | 0o755)
    return os.stat_result((mode, 0, 0, 1, 0, 0, int(info.get("size") or 0), 0, 0, 0))


def filesystem(path: StorePath):
    """The fsspec filesystem itself, for a library that takes one (pyarrow's datasets): its calls are not classified
    (run them after the store answered this job's own)."""
    fs = path.fs
    return fs._fs if isinstance(fs, Guarded) else fs
