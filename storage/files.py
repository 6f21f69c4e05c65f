"""How every refcache command writes a file: never through a symlink, never into a file that has other names (hard
links), never over something that is not a regular file. Whole files are written atomically (a temporary file in the
same folder, fsynced, renamed over the destination, the folder fsynced); appends and locks open the file itself with
O_NOFOLLOW. A destination that breaks the rule is refused with `UnsafeDestination`, and nothing is written, followed
or deleted."""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

TEMP = re.compile(r"^\..+\.tmp-\d+$")  # atomic_write's temporary names: `.{name}.tmp-{pid}`


class UnsafeDestination(Exception):
    """A path a command was about to write, replace or delete is a symlink, a hard link or not a regular file."""


def why_unsafe(st: os.stat_result, *, in_place: bool = True) -> str | None:
    """Why a destination with this lstat must not be written (None: a plain regular file). A hard-linked file may be
    replaced or deleted (its other names keep their content), not written in place."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if stat.S_ISDIR(st.st_mode):
        return "is a folder"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if in_place and st.st_nlink > 1:
        return f"is a hard link (the same file has {st.st_nlink} names)"
    return None


def refusal(path, why: str) -> UnsafeDestination:
    path = Path(path)
    target = f" (to {os.readlink(path)})" if why == "is a symlink" else ""
    return UnsafeDestination(f"{path} {why}{target}: refcache does not write there (it never follows, replaces or "
                             "deletes a link, nor writes over what is not a plain file); remove it yourself, or choose "
                             "another output location")


def check_destination(path) -> None:
    """Refuse a destination to be replaced or deleted that exists and is a link, a folder or another non-regular
    file (a missing one is fine)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    why = why_unsafe(st, in_place=False)
    if why:
        raise refusal(path, why)


def open_nofollow(path, flags: int, mode: int = 0o666) -> int:
    """os.open that never follows a symlink at `path` and only opens a plain regular file (O_NONBLOCK while opening,
    so a FIFO planted there cannot block); returns the descriptor."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EEXIST):
            try:
                why = why_unsafe(os.lstat(path)) or "already exists"
            except FileNotFoundError:
                why = "is not a regular file"
            raise refusal(path, why) from None
        raise
    why = why_unsafe(os.fstat(fd))
    if why:
        os.close(fd)
        raise refusal(path, why)
    os.set_blocking(fd, True)
    return fd


def append_text(path, text: str) -> None:
    """Append to a file of ours (created if missing)."""
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(text)


def remove_file(path) -> None:
    """Delete a plain file of ours (nothing if missing); a link or anything else is refused, not deleted."""
    check_destination(path)
    Path(path).unlink(missing_ok=True)


def atomic_write(path, write) -> None:
    """Write `path` whole: `write(f)` fills a new temporary file `.{name}.tmp-{pid}` beside it (created exclusively,
    never through a symlink), which is fsynced and renamed over `path`; then the folder is fsynced. A destination
    that is a symlink, a folder or another non-regular file is refused before anything is written."""
    path = Path(path)
    check_destination(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)  # ours from here on
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
