"""One writer per output folder: precompute-ref's --out and train-dpo's --output-dir are held, for the whole job, by
an exclusive lock on the folder's lock file (`.refcache.lock`, holding the writer's pid), or on an object store a
lease object of that name (the mechanism: storage/locks.py). A folder another process holds is refused naming it."""

from __future__ import annotations

import contextlib
from pathlib import Path

import storage.locks
from schemas.format import LOCK
from storage.locks import LockHeld, NotALock, is_lock

from .errors import JobError


def is_lock_file(path: Path) -> bool:
    """The lock file of a folder: the name, and a plain file (a symlink of that name is not one)."""
    return is_lock(path, LOCK)


@contextlib.contextmanager
def exclusive(folder, command: str, option: str):
    """Make `folder` where missing and hold its lock until the block ends (storage.locks.exclusive: a symlink planted
    as the lock is refused; a block that fails takes back the lock file and folders this call made), or refuse
    naming the process that holds it."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(storage.locks.exclusive(folder, LOCK))
        except LockHeld as e:
            taken_over = " (a lease whose process ended on this host, or that expired, is taken over)" if e.remote else ""
            raise JobError(f"{e.folder} is being written by another {command} process ({e.holder}); wait for it to "
                           f"finish or choose another {option}{taken_over}") from None
        except NotALock as e:
            raise JobError(f"{option} {folder}: {e}, so it is not this job's to take: it was left as it is; move it "
                           f"elsewhere, or choose another {option}") from None
        yield
