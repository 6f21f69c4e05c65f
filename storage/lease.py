"""One writer per store prefix: a lease object (host, pid and expiry) created only if absent, refreshed while the
job runs, taken over only if its holder is gone and only if unchanged meanwhile (FORMAT.md, "Object storage")."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import tempfile
import threading
import time
from pathlib import Path

from .files import UnsafeDestination, remove_file
from .places import StorePath, etag
from .writes import Refused, StoreConflict, put_if

LEASE_S = 120.0  # a writer's lease lasts this long unless refreshed (every LEASE_S / 4 while the job runs)


class LeaseHeld(StoreConflict):
    def __init__(self, url: str, holder: dict):
        self.holder = holder
        super().__init__(f"{url} is held by {describe(holder)}")


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
        except Refused:
            pass
        fs.invalidate_cache(key)
        try:
            with fs.open(key, "rb") as f:
                raw, tag = f.read(), etag(getattr(f, "details", None) or self.path.info())
        except FileNotFoundError:  # released meanwhile: one more try
            try:
                self._put(None)
                return
            except Refused:
                raise self._raced() from None
        try:
            holder = json.loads(raw)
        except ValueError:
            holder = {}
        if _alive(holder):
            raise LeaseHeld(self.path.parent.url, holder)
        try:  # the dead or expired holder's lease, taken over only if no one else did meanwhile
            self._put(tag)
        except Refused:
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
