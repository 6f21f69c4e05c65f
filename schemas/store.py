"""Where a cache lives: a local folder (a `pathlib.Path`, written by the rules of schemas/files.py) or a prefix on an
object store named by an fsspec URL (`s3://bucket/prefix`, `gs://`, `az://`, ...: a `StorePath`). `file://` URLs
are local folders. Credentials and endpoints come only from each store's own environment and config files
(AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws/config; GOOGLE_APPLICATION_CREDENTIALS; AZURE_STORAGE_*): nothing of
ours is passed to the filesystem.

A `StorePath` answers the part of pathlib's interface the cache's readers and writers use (`/`, name, is_file,
stat, read_text, glob, iterdir), so the rules of schemas/rules.py judge a remote cache as they judge a folder. The
store-specific parts are here: reading a shard once while hashing it (`hashed`), whole-object writes from a local
temporary file (`write_whole`), the manifest's conditional write, and the writer's lease (`lease`). FORMAT.md,
"Object storage", says what each store guarantees."""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import hashlib
import json
import os
import re
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path

from .files import UnsafeDestination, atomic_write, remove_file
from .findings import CacheError

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
CHUNK = 8 * 2**20  # bytes per read while streaming an object
LEASE_S = 120.0  # a writer's lease lasts this long unless refreshed (every LEASE_S / 4 while the job runs)
CONDITIONAL = ("s3", "s3a")  # protocols whose fsspec driver exposes If-None-Match / If-Match on a whole-object write
# The stores a cache is written and read on end to end (the whole-object writes, listings and the lease of this module,
# FORMAT.md "Object storage"), with the extra that installs each driver. `memory://` is fsspec's in-memory filesystem
# of this process (the tests' store without conditional writes). Any other protocol, and any fsspec protocol chain
# (`simplecache::s3://...`: a local cache layer that would write locally and upload later), is refused by name.
STORES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure",
          "memory": None}
BUCKETED = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl")  # a URL's first part is a bucket (container)
ENDPOINT = {"s3": "AWS_ENDPOINT_URL, ~/.aws/config", "gs": "STORAGE_EMULATOR_HOST, the gcloud config",
            "az": "AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_CONNECTION_STRING"}
UNREACHABLE = {errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT,
               errno.EHOSTDOWN}


class StoreConflict(UnsafeDestination):
    """An object a writer was about to replace was changed by someone else since it read it (a conditional write
    refused), or the prefix's lease is held by another writer."""


class StoreUnavailable(Exception):
    """The store itself is the problem, not a cache on it: its endpoint cannot be reached, the bucket does not
    exist, or access is denied. Not a CacheError (no rule of a cache judged it; audit-ref fails no check on it) and
    not an OSError (the handlers of a missing file must not take it for one): a command stops with the cause and the
    remedy (exit 2)."""

    def __init__(self, kind: str, message: str, remedy: str):
        self.kind, self.message, self.remedy = kind, message, remedy
        super().__init__(f"{message}\n  remedy:   {remedy}")


def _settings(protocol: str) -> str:
    return ENDPOINT.get({"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az", "adl": "az"}.get(protocol, protocol),
                        "the store's own settings")


# the store clients' "no credentials at all" errors, by class name (botocore's, google-auth's, azure-identity's), so
# that no driver need be imported to classify them
NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError",
                  "CredentialUnavailableError"}


def store_fault(url: str, protocol: str, error: BaseException) -> StoreUnavailable | None:
    """The store fault behind `error` (anywhere in its chain), or None: an endpoint that cannot be reached
    (connection refused or reset, no route, a name that does not resolve, a timeout: by exception type and errno,
    botocore's and aiohttp's included), no credentials at all, or access denied."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        kind = type(e)
        names = {c.__name__ for c in kind.__mro__}
        if (isinstance(e, (ConnectionError, TimeoutError, socket.gaierror))
                or isinstance(e, OSError) and e.errno in UNREACHABLE
                or names & {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError",
                            "ServerTimeoutError", "ClientConnectorError"}):
            detail = " ".join(str(e).split())[:300] or kind.__name__
            return StoreUnavailable(
                "unreachable", f"{url}: the store cannot be reached ({detail})",
                f"check the endpoint and the network ({_settings(protocol)}), then re-run the same command")
        if names & NO_CREDENTIALS:
            detail = " ".join(str(e).split())[:300] or kind.__name__
            return StoreUnavailable(
                "no_credentials", f"{url}: no credentials for the store were found ({detail})",
                f"give this process the store's credentials ({_settings(protocol)}), then re-run the same command")
        if isinstance(e, PermissionError):
            detail = " ".join(str(e).split())[:300] or kind.__name__
            return StoreUnavailable(
                "denied", f"{url}: the store refused access ({detail})",
                f"check the credentials and their permissions on this bucket and prefix ({_settings(protocol)})")
        e = e.__cause__ or e.__context__
    return None


class _Guarded:
    """A session's filesystem: every call that fails because of the store itself (store_fault) raises
    StoreUnavailable, so no caller takes an unreachable endpoint for a missing object or a crash."""

    def __init__(self, fs, url: str, protocol: str):
        self._fs, self._url, self._protocol = fs, url, protocol

    def __getattr__(self, name):
        attr = getattr(self._fs, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        @functools.wraps(attr)
        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except Exception as e:
                fault = store_fault(self._url, self._protocol, e)
                if fault is None:
                    raise
                raise fault from e

        return call


def filesystem(path: StorePath):
    """The fsspec filesystem itself, for a library that takes one (pyarrow's datasets): its calls are not classified
    (run them after the store answered this job's own)."""
    fs = path.fs
    return fs._fs if isinstance(fs, _Guarded) else fs


def missing_bucket(root: StorePath) -> StoreUnavailable | None:
    """A bucket (container) that does not exist on the store, or None (it exists, or the store has no buckets)."""
    if root._s.protocol not in BUCKETED:
        return None
    bucket = root.key.split("/", 1)[0]
    try:
        root.fs.info(bucket)
    except FileNotFoundError:
        return StoreUnavailable(
            "no_bucket", f"{root.url}: the bucket {bucket!r} does not exist on this store",
            f"check the URL's bucket name (and the endpoint: {_settings(root._s.protocol)}), or create the bucket "
            "first; refcache makes prefixes, never buckets")
    except StoreUnavailable:
        raise
    except Exception:  # e.g. no permission to look at the bucket itself: nothing to say about it here
        return None
    return None


def absent_cache(root: StorePath) -> Exception | None:
    """Why a store prefix has no manifest, when it is not an interrupted writer's: the bucket does not exist, or the
    prefix holds nothing at all (mistyped, or never written: its neighbours are named) or holds no cache's files.
    None where it holds a cache's shards or lease (precompute-ref running or interrupted)."""
    fault = missing_bucket(root)
    if fault is not None:
        return fault
    try:
        names = sorted(p.name for p in root.iterdir())
    except FileNotFoundError:
        names = []
    if any(n.endswith(".parquet") or n.startswith(".refcache") for n in names):
        return None
    remedy = (f"check the URL (a cache's prefix holds manifest.json), or make the cache there with precompute-ref "
              f"--out {root.url}")
    if names:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        return CacheError("no_cache", f"{root.url} holds no cache: no manifest.json and no shard, only other "
                          f"objects ({shown})", remedy=remedy)
    near = _neighbours(root)
    return CacheError("no_cache", f"{root.url} holds no cache: nothing is stored under this prefix (mistyped, or "
                      "never written)" + (f"; next to it: {', '.join(near)}" if near else ""), remedy=remedy)


def _neighbours(root: StorePath) -> list[str]:
    """The prefixes beside `root` whose names are closest to its own (a typo's likely target)."""
    if "/" not in root.key:
        return []
    try:
        siblings = {p.name: p.url for p in root.parent.iterdir()}
    except (FileNotFoundError, StoreUnavailable):
        return []
    return [siblings[n] for n in difflib.get_close_matches(root.name, list(siblings), n=3, cutoff=0.75)]


class LeaseHeld(StoreConflict):
    def __init__(self, url: str, holder: dict):
        self.holder = holder
        super().__init__(f"{url} is held by {describe(holder)}")


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
        self.lease: _Lease | None = None


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
        return cls(_Session(_Guarded(fs, url, protocol), protocol), key)

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


# ---------------------------------------------------------------------------------------------------------------
# reading


def hashed(path) -> tuple[str, Path | StorePath]:
    """The sha256 of a file or object, and the path to read it by from then on: an object is streamed once, its
    bytes hashed as they arrive and held in memory (one shard at a time), so its footer and columns are read from
    what was verified, not fetched again."""
    if not isinstance(path, StorePath):
        from .stamps import file_sha256

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
        from .stamps import file_sha256

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


# ---------------------------------------------------------------------------------------------------------------
# writing


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
        from .stamps import file_sha256

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


class _Refused(Exception):
    """A conditional write the store refused: the object was not as expected."""


def put_if(path: StorePath, data: bytes, expected: str | None) -> str | None:
    """Write `data` as `path` only if the object is absent (expected None) or still has ETag `expected`; returns the
    new ETag, or raises _Refused. On S3 the store decides (If-None-Match: * / If-Match); on stores whose driver
    exposes no condition it is checked just before the write, which leaves a window (FORMAT.md)."""
    fs, key = path.fs, path.key
    if path._s.protocol in CONDITIONAL:
        try:
            out = fs.pipe_file(key, data, **({"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}))
        except FileExistsError:
            raise _Refused() from None
        except OSError as e:  # botocore's 412 PreconditionFailed (s3fs: EINVAL), or If-Match on a missing key
            if isinstance(e, FileNotFoundError):
                # no object to compare with is the condition failing, but only where the bucket exists: a write
                # into a missing bucket is not another writer's doing
                fault = missing_bucket(path.parent)
                if fault is not None:
                    raise fault from None
                raise _Refused() from None
            if e.errno == errno.EINVAL and "condition" in str(e).lower():
                raise _Refused() from None
            raise
        return (out or {}).get("ETag") or etag(path.info())
    fs.invalidate_cache(key)
    if etag(path.info()) != expected:
        raise _Refused()
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
    except _Refused:
        raise StoreConflict(f"{path.url} was {'created' if expected is None else 'changed'} by another writer since "
                            "this job read it; nothing was overwritten: re-run the command to resume from what is "
                            "there now") from None


def remove(path) -> None:
    """Delete a file or object of ours (nothing if missing): locally schemas.files.remove_file."""
    if not isinstance(path, StorePath):
        remove_file(path)
        return
    try:
        path.fs.rm_file(path.key)
    except FileNotFoundError:
        pass
    path._s.seen[path.key] = None
    path.fs.invalidate_cache(path.key)


# ---------------------------------------------------------------------------------------------------------------
# one writer per prefix: a lease object


def describe(holder: dict) -> str:
    left = holder.get("expires", 0) - time.time()
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} "
            + (f"(lease valid {left:.0f} s more)" if left > 0 else "(lease expired)"))


def _alive(holder: dict) -> bool:
    """A lease another writer still holds: not expired, and not of a process of this host that has ended."""
    if not isinstance(holder, dict) or not isinstance(holder.get("expires"), (int, float)):
        return False
    if holder["expires"] <= time.time():
        return False
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        return _pid_alive(holder["pid"])
    return True


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


UPLOAD = re.compile(r"^refcache-upload-(\d+)-")  # write_whole's local temporary files: refcache-upload-<pid>-...


def sweep_uploads() -> None:
    """Remove the local temporary upload files that writers killed mid-shard left (their process has ended)."""
    for path in Path(tempfile.gettempdir()).glob("refcache-upload-*"):
        m = UPLOAD.match(path.name)
        if m and not _pid_alive(int(m.group(1))):
            with contextlib.suppress(OSError, UnsafeDestination):  # another user's, or not a plain file: left alone
                remove_file(path)


class _Lease:
    def __init__(self, path: StorePath):
        self.path, self.etag, self.lost = path, None, None
        self._stop = threading.Event()

    def body(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "expires": time.time() + LEASE_S}).encode()

    def _put(self, expected: str | None) -> None:
        self.etag = put_if(self.path, self.body(), expected)

    def take(self) -> None:
        fs, key = self.path.fs, self.path.key
        try:
            self._put(None)
            return
        except _Refused:
            pass
        fs.invalidate_cache(key)
        try:
            with fs.open(key, "rb") as f:
                raw, tag = f.read(), etag(getattr(f, "details", None) or self.path.info())
        except FileNotFoundError:  # released meanwhile: one more try
            try:
                self._put(None)
                return
            except _Refused:
                raise self._raced() from None
        try:
            holder = json.loads(raw)
        except ValueError:
            holder = {}
        if _alive(holder):
            raise LeaseHeld(self.path.parent.url, holder)
        try:  # the dead or expired holder's lease, taken over only if no one else did meanwhile
            self._put(tag)
        except _Refused:
            raise self._raced() from None

    def _raced(self) -> LeaseHeld:
        """Another writer took the lease between this one's read and its conditional write."""
        return LeaseHeld(self.path.parent.url, {"host": "another writer", "pid": "?", "expires": time.time() + LEASE_S})

    def refresh_until_stopped(self) -> None:
        while not self._stop.wait(LEASE_S / 4):
            try:
                self._put(self.etag)
            except Exception as e:  # taken over (our lease had expired) or the store unreachable
                self.lost = e
                return

    def check(self) -> None:
        if self.lost is not None:
            raise StoreConflict(f"{self.path.parent.url}: this writer lost its lease ({self.lost}); another writer "
                                "may hold the prefix now: nothing more was written")

    def release(self) -> None:
        self._stop.set()
        if self.lost is not None:
            return
        self.path.fs.invalidate_cache(self.path.key)
        try:
            if etag(self.path.fs.info(self.path.key)) == self.etag:  # still ours (a window: FORMAT.md)
                self.path.fs.rm_file(self.path.key)
        except FileNotFoundError:
            pass


@contextlib.contextmanager
def lease(root: StorePath, name: str):
    """Hold `root`'s lease object `name` for the block: created only if absent (If-None-Match: *), holding host,
    pid and an expiry, refreshed while the block runs; a lease whose holder is gone (same host, pid ended) or
    expired is taken over only if unchanged meanwhile (If-Match). Another writer's live lease raises LeaseHeld."""
    held = _Lease(root / name)
    held.take()
    sweep_uploads()
    root._s.lease = held
    thread = threading.Thread(target=held.refresh_until_stopped, name="refcache-lease", daemon=True)
    thread.start()
    try:
        yield held
    finally:
        root._s.lease = None
        held.release()
        thread.join(timeout=5)
