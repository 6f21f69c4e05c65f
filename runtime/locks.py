"""One writer per output folder: precompute-ref's --out and train-dpo's --output-dir are held, for the whole job, by
an exclusive lock on the folder's lock file (`.refcache.lock`, holding the writer's pid). The OS drops the lock when
the process ends, however it ends; the file itself stays and is not a sign of use. On an object store the lock is a
lease object of that name (schemas/store.py: host, pid and expiry, refreshed while the job runs)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path

from schemas import store
from schemas.files import open_nofollow
from schemas.format import LOCK

from .errors import JobError


def is_lock_file(path: Path) -> bool:
    """The lock file of a folder: the name, and a plain file (a symlink of that name is not one)."""
    try:
        return path.name == LOCK and stat.S_ISREG(store.lstat(path).st_mode)
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def exclusive(folder, command: str, option: str):
    """Make `folder` where missing and hold its lock until the block ends, or refuse naming the process that holds
    it. The lock file is opened without following a symlink (schemas.files.open_nofollow), so a link planted there
    is refused, never truncated through. A block that ends in an exception (a refusal, an interruption) takes back
    what this call made: the lock file (if it made it) and the folders it created, while empty; so a refused command
    leaves no folder holding only `.refcache.lock` (what the job wrote, e.g. finished shards to resume, stays)."""
    folder = store.location(folder)
    if store.is_remote(folder):
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(store.lease(folder, LOCK))
            except store.LeaseHeld as e:
                raise JobError(f"{folder} is being written by another {command} process ({store.describe(e.holder)});"
                               f" wait for it to finish or choose another {option} (a lease whose process ended on "
                               "this host, or that expired, is taken over)") from None
            yield
        return
    made = _make(folder)
    lock = folder / LOCK
    fresh = not os.path.lexists(lock)
    try:
        fd = open_nofollow(lock, os.O_RDWR | os.O_CREAT)
    except BaseException:
        _take_back(folder, made, None)
        raise
    with os.fdopen(fd, "r+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = f.read(32).strip() or "?"
            raise JobError(f"{folder} is being written by another {command} process (pid {holder}); wait for it to "
                           f"finish or choose another {option}") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        except BaseException:
            _take_back(folder, made, f.fileno() if fresh else None)  # still holding the lock
            raise


def _make(folder: Path) -> list[Path]:
    """mkdir -p `folder`; the folders it created, outermost first."""
    missing, p = [], folder.absolute()
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    folder.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def _take_back(folder: Path, made: list[Path], lock_fd: int | None) -> None:
    """Remove the lock file this call created (`lock_fd`: its open descriptor, the lock still held; None: it was
    there before, or none was made), then the folders made, innermost first, while each is empty."""
    with contextlib.suppress(OSError):
        if lock_fd is not None:
            here, ours = os.lstat(folder / LOCK), os.fstat(lock_fd)
            if (here.st_dev, here.st_ino) == (ours.st_dev, ours.st_ino):
                os.unlink(folder / LOCK)
        for path in reversed(made):
            os.rmdir(path)  # OSError when not empty: what is left there is kept

