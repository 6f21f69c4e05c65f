"""One writer per output folder: the folder is held, for the whole job, by an exclusive lock on a lock file in it
(holding the writer's pid). The OS drops the lock when the process ends, however it ends; the file itself stays and
is not a sign of use. On an object store the lock is a lease object of that name (storage/lease.py: host, pid and
expiry, refreshed while the job runs). The lock file's name and the refusal a command gives are the caller's
(runtime/locks.py)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path

from .files import open_nofollow
from .lease import LeaseHeld, describe, lease
from .places import is_remote, location, lstat


class LockHeld(Exception):
    """Another process holds the folder: `holder` says which ('pid N' for a folder; the lease's holder, host and
    expiry, on a store)."""

    def __init__(self, folder, holder: str, *, remote: bool):
        self.folder, self.holder, self.remote = folder, holder, remote
        super().__init__(f"{folder} is held by {holder}")


class NotALock(Exception):
    """The folder's lock file holds something other than a writer's pid: another program's file of that name, never
    truncated."""

    def __init__(self, lock):
        self.lock = lock
        super().__init__(f"{lock} is not a lock file (it holds other text)")


def is_lock(path: Path, name: str) -> bool:
    """Whether `path` is a folder's lock file `name`: the name, and a plain file (a symlink of that name is not
    one)."""
    try:
        return path.name == name and stat.S_ISREG(lstat(path).st_mode)
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def exclusive(folder, name: str):
    """Make `folder` where missing and hold its lock file `name` until the block ends, or raise LockHeld naming the
    process that holds it. The lock file is opened without following a symlink (storage.files.open_nofollow), so a
    link planted there is refused, never truncated through. A block that ends in an exception (a refusal, an
    interruption) takes back what this call made: the lock file (if it made it) and the folders it created, while
    empty; so a refused command leaves no folder holding only its lock file (what the job wrote, e.g. finished shards
    to resume, stays)."""
    folder = location(folder)
    if is_remote(folder):
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(lease(folder, name))
            except LeaseHeld as e:
                raise LockHeld(folder, describe(e.holder), remote=True) from None
            yield
        return
    made = _make(folder)
    lock = folder / name
    fresh = not os.path.lexists(lock)
    try:
        fd = open_nofollow(lock, os.O_RDWR | os.O_CREAT)
    except BaseException:
        _take_back(folder, name, made, None)
        raise
    with os.fdopen(fd, "r+", encoding="utf-8", errors="replace") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = f.read(32).strip() or "?"
            raise LockHeld(folder, f"pid {holder}", remote=False) from None
        held = f.read(32)
        if held.strip() and not (held.strip().isdigit() and len(held) < 32):  # a writer's pid, or nothing, only
            raise NotALock(lock)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        except BaseException:
            _take_back(folder, name, made, f.fileno() if fresh else None)  # still holding the lock
            raise


def _make(folder: Path) -> list[Path]:
    """mkdir -p `folder`; the folders it created, outermost first."""
    missing, p = [], folder.absolute()
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    folder.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def _take_back(folder: Path, name: str, made: list[Path], lock_fd: int | None) -> None:
    """Remove the lock file this call created (`lock_fd`: its open descriptor, the lock still held; None: it was
    there before, or none was made), then the folders made, innermost first, while each is empty."""
    with contextlib.suppress(OSError):
        if lock_fd is not None:
            here, ours = os.lstat(folder / name), os.fstat(lock_fd)
            if (here.st_dev, here.st_ino) == (ours.st_dev, ours.st_ino):
                os.unlink(folder / name)
        for path in reversed(made):
            os.rmdir(path)  # OSError when not empty: what is left there is kept
